"""Pallas kernels, installed as `dsv41.kernels`: one file per kernel beside its plain-JAX reference (DESIGN §8)."""
