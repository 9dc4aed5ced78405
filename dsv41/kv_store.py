"""The cache's stores as a layer reads and writes them (DESIGN §3.8, §6): ring slots, rows, bytes to floats.

A store is a [B, T, ...] leaf of `cache.Cache`: the FP8 window ring (slot p % W holds position p), a Full
layer's FP4 entries with their E4M3 scale bytes and its MXFP4 indexer keys with their UE8M0 scale bytes,
the one-byte codes kept as uint8 (`quant.to_bytes`). The float cache (`quant: none`, V4 compat) holds the
values themselves, which the dequantisers pass through. Plain JAX over `dsv41.quant`: the cached attention
step (`nn.attention_cache`) and the kernels' references (`dsv41.kernels`) read the stores through these.
"""

from __future__ import annotations

import jax.numpy as jnp

from dsv41 import quant


def _rows(x):
    return jnp.arange(x.shape[0])[:, None]


def ring_positions(lengths_B, window: int):
    """[B, W]: the position held by each ring slot (slot p % W holds p); negative where empty."""
    last = lengths_B[:, None] - 1
    return last - jnp.mod(last - jnp.arange(window), window)


def write_rows(store, values_BNX, index_BN, keep_BN):
    """store[b, index[b, n]] = values[b, n] where keep (others dropped)."""
    index = jnp.where(keep_BN, index_BN, store.shape[1])
    return store.at[_rows(index), index].set(values_BNX.astype(store.dtype), mode="drop")


def gather_rows(store, index_BSk):
    """store[b, index[b, s, j]] -> [B, S, k, ...] (index clamped; the caller masks invalid picks)."""
    b = jnp.arange(store.shape[0])[:, None, None]
    return store[b, jnp.clip(index_BSk, 0, store.shape[1] - 1)]


def packed(store) -> bool:
    """True when a store leaf holds the packed bytes, False for the float cache."""
    return store.dtype == jnp.uint8


def dequant_entries(packed_values, scale_bytes):
    """FP4 main entries (+ E4M3 scale bytes) -> float32; the float cache's entries as they are."""
    if not packed(packed_values):
        return packed_values
    return quant.dequantize_fp4_e4m3_16(quant.unpack_fp4(packed_values),
                                        quant.from_bytes(scale_bytes, jnp.float8_e4m3fn))


def dequant_keys(packed_values, scale_bytes):
    """MXFP4 indexer keys (+ UE8M0 scale bytes) -> float32; the float cache's keys as they are."""
    if not packed(packed_values):
        return packed_values
    return quant.dequantize_mxfp4(quant.unpack_fp4(packed_values), quant.from_bytes(scale_bytes, jnp.float8_e8m0fnu))


def dequant_window(value_bytes, scale_bytes):
    """FP8 window values (+ UE8M0 scale bytes) [..., K] -> float32 [..., K]; the packed ring only."""
    return quant.dequantize_fp8_ue8m0_32(quant.from_bytes(value_bytes, jnp.float8_e4m3fn),
                                         quant.from_bytes(scale_bytes, jnp.float8_e8m0fnu))
