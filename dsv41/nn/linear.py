"""Bias-free dense projection, the only kind DeepSeek-V4/V4.1 use."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41.nn import weights
from dsv41.nn.policy import Policy


def param(rngs: nnx.Rngs, shape, axes, dtype, std: float) -> nnx.Param:
    """A parameter with logical axis names, drawn from normal(0, std) (`architecture.initializer_range`)."""
    init = jax.nn.initializers.normal(std)
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=tuple(axes), eager_sharding=False)


def ones(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), out_sharding=tuple(axes), eager_sharding=False)


class Dense(nnx.Module):
    """y = x @ w with w [din, dout]. shipped: the release ships this matrix as FP8 with 32×32 block scales, and
    the `shipped` weight format holds it so (`w` E4M3 and `w_scale` UE8M0, `dsv41.nn.weights`)."""

    def __init__(self, din: int, dout: int, axes: tuple[str, str], *, policy: Policy, rngs: nnx.Rngs,
                 shipped: bool = False):
        self.policy = policy
        self.axes = tuple(axes)
        self.kind = weights.kind_for(policy, weights.FP8 if shipped else None)
        self.w, self.w_scale = weights.make(rngs, (din, dout), axes, policy, self.kind)

    def weight(self, dtype=None):
        """w as the matmul reads it, in `dtype` (default the compute dtype): gathered where the parameters are
        FSDP-sharded (`Policy.at_use`), dequantised in the program when held as shipped."""
        return weights.read(self.w[...], None if self.w_scale is None else self.w_scale[...], self.kind, self.axes,
                            self.policy, dtype)

    def __call__(self, x):
        if self.kind == weights.FP8 and self.policy.lowering.weights is None:  # as held on each chip
            y = weights.fp8_matmul(x, self.w[...], self.w_scale[...], self.policy)
            if y is not None:
                return y
        return self.policy.dot(x, self.weight())
