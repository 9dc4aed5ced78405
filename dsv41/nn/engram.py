"""Engram (arXiv 2601.07372; DESIGN §3.7): n-gram hash rows written into the residual streams.

The hash ids come from the host (`dsv41.engram_hash`, int64 NumPy). The rows of all (n-gram, head)
columns are concatenated and projected by wkv into one key per stream and one shared value; each
stream is gated by σ(sign(dot)·sqrt(max(|dot|, 1e-6))), where dot is the RMS-normalised product of
the stream and its key weighted by q_weight ⊙ k_weight, over sqrt(D). No convolution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41.nn import weights
from dsv41.nn.linear import Dense
from dsv41.nn.policy import Policy

GATE_FLOOR = 1e-6


class Engram(nnx.Module):
    def __init__(self, dim: int, streams: int, rows: int, row_dim: int, columns: int, eps: float, *,
                 policy: Policy, rngs: nnx.Rngs):
        self.dim, self.streams, self.eps = dim, streams, eps
        # The release ships the tables as FP8 with a UE8M0 scale per 32 of a row (`dsv41.nn.weights`): `table` and
        # `table_scale`; the gathered rows are dequantised, never the table.
        self.kind = weights.kind_for(policy, weights.ROWS)
        self.table, self.table_scale = weights.make(rngs, (rows, row_dim), ("engram_rows", "engram_dim"), policy,
                                                    self.kind, what="engram.table")
        self.policy = policy
        self.wkv = Dense(columns * row_dim, (streams + 1) * dim, ("engram_in", "embed"), policy=policy, rngs=rngs,
                         shipped=True)
        self.q_weight = nnx.Param(jnp.ones((streams, dim), jnp.float32), out_sharding=(None, "embed"),
                                  eager_sharding=False)
        self.k_weight = nnx.Param(jnp.ones((streams, dim), jnp.float32), out_sharding=(None, "embed"),
                                  eager_sharding=False)

    def __call__(self, x_BSND, ids_BSC):
        b, s, n, d = x_BSND.shape
        rows = jnp.take(self.table[...], ids_BSC, axis=0)
        if self.table_scale is not None:
            rows = weights.dequantize(self.kind, rows, jnp.take(self.table_scale[...], ids_BSC, axis=0),
                                      self.policy.compute_dtype)
        rows = rows.reshape(b, s, -1)
        kv = self.wkv(rows)
        key = kv[..., : n * d].astype(jnp.float32).reshape(b, s, n, d)
        value = kv[..., n * d:].astype(jnp.float32)
        weight = self.q_weight[...].astype(jnp.float32) * self.k_weight[...].astype(jnp.float32)
        h = x_BSND.astype(jnp.float32)
        rstd = (jax.lax.rsqrt(jnp.mean(h * h, axis=-1) + self.eps)
                * jax.lax.rsqrt(jnp.mean(key * key, axis=-1) + self.eps))
        dot = jnp.sum(h * weight * key, axis=-1) * rstd * d ** -0.5
        gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), GATE_FLOOR)), dot))
        return (h + gate[..., None] * value[..., None, :]).astype(x_BSND.dtype)
