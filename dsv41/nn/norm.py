"""RMSNorm (eps from the config: 1e-20 for V4.1, 1e-6 for V4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41.nn.linear import ones


def rms_normalize(x, eps: float):
    """x / rms(x) over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """weight ⊙ (x / rms(x)); statistics in fp32, the product in the input dtype (as the port)."""

    def __init__(self, dim: int, eps: float, axis_name: str, dtype=jnp.float32):
        self.eps = eps
        self.weight = ones((dim,), (axis_name,), dtype)

    def __call__(self, x):
        return self.weight[...].astype(x.dtype) * rms_normalize(x, self.eps).astype(x.dtype)
