"""Bias-free dense projection, the only kind DeepSeek-V4/V4.1 use."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41.nn.policy import Policy


def param(rngs: nnx.Rngs, shape, axes, dtype, std: float) -> nnx.Param:
    """A parameter with logical axis names, drawn from normal(0, std) (`architecture.initializer_range`)."""
    init = jax.nn.initializers.normal(std)
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=tuple(axes), eager_sharding=False)


def ones(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), out_sharding=tuple(axes), eager_sharding=False)


class Dense(nnx.Module):
    """y = x @ w with w [din, dout]."""

    def __init__(self, din: int, dout: int, axes: tuple[str, str], *, policy: Policy, rngs: nnx.Rngs):
        self.policy = policy
        self.axes = tuple(axes)
        self.w = param(rngs, (din, dout), axes, policy.param_dtype, policy.init_std)

    def weight(self):
        """w as the matmul reads it (`Policy.at_use`: gathered where the parameters are FSDP-sharded)."""
        return self.policy.at_use(self.w[...], self.axes)

    def __call__(self, x):
        return self.policy.dot(x, self.weight())
