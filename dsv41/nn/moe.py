"""Mixture of experts (DESIGN §3.6): sqrt-softplus router, top-k, clamped SwiGLU experts, shared expert.

Scores s = sqrt(softplus(x W_g)) in fp32; the picks are the top-k of s + bias, where the bias is a
balancing term updated outside the gradient (a `BalanceBias` variable, stop-gradient here); the
weights are s at the picks, normalised (+1e-20) and scaled by the route scale. An expert computes
w2((silu(min(w1 x, L)) · clip(w3 x, ±L)) · weight). Routed tokens are sorted by expert and run
through `jax.lax.ragged_dot`: no dense all-experts compute.
V4 (compat, DESIGN §3.6): the first `hash_layers` layers pick their experts from a fixed token → experts
table (`tid2eid`, a `HashRoute` variable) instead of the top-k; the weights are computed as above.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41.nn.linear import Dense, param
from dsv41.nn.policy import Policy


class BalanceBias(nnx.Variable):
    """The router's selection bias: not a parameter of the loss, updated from expert load."""


class HashRoute(nnx.Variable):
    """A hash-routed layer's token id → expert ids table [vocab, k] (int32): fixed, never trained."""


class MoE(nnx.Module):
    def __init__(self, dim: int, experts: int, top_k: int, inter: int, shared: int, route_scale: float,
                 swiglu_limit: float, hash_vocab: int = 0, *, policy: Policy, rngs: nnx.Rngs):
        """hash_vocab > 0: a hash-routed layer (V4) with a table of that many token ids, no balance bias."""
        self.top_k, self.route_scale, self.limit, self.policy = top_k, route_scale, swiglu_limit, policy
        self.num_experts = experts
        self.gate = param(rngs, (dim, experts), ("embed", "experts"), policy.param_dtype)
        if hash_vocab:
            # Distinct random experts per token until a checkpoint brings the real table.
            order = jnp.argsort(jax.random.uniform(rngs.params(), (hash_vocab, experts)), axis=-1)
            self.tid2eid = HashRoute(order[:, :top_k].astype(jnp.int32), out_sharding=("vocab", None),
                                     eager_sharding=False)
            self.bias = None
        else:
            self.tid2eid = None
            self.bias = BalanceBias(jnp.zeros((experts,), jnp.float32), out_sharding=("experts",),
                                    eager_sharding=False)
        self.w1 = param(rngs, (experts, dim, inter), ("experts", "embed", "mlp"), policy.param_dtype)
        self.w3 = param(rngs, (experts, dim, inter), ("experts", "embed", "mlp"), policy.param_dtype)
        self.w2 = param(rngs, (experts, inter, dim), ("experts", "mlp", "embed"), policy.param_dtype)
        self.shared = SwiGLU(dim, inter * shared, swiglu_limit, policy=policy, rngs=rngs) if shared else None

    def route(self, x_ND, tokens_N=None):
        """(weights [N, k] fp32, expert ids [N, k]) for tokens x (a hash-routed layer reads their ids)."""
        logits = jnp.dot(x_ND.astype(jnp.float32), self.gate[...].astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)
        scores = jnp.sqrt(jax.nn.softplus(logits))
        if self.tid2eid is not None:
            idx = jnp.take(self.tid2eid[...], tokens_N, axis=0)
        else:
            _, idx = jax.lax.top_k(scores + jax.lax.stop_gradient(self.bias[...]), self.top_k)
        weights = jnp.take_along_axis(scores, idx, axis=-1)
        if self.top_k > 1:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return weights * self.route_scale, idx

    def __call__(self, x_BSD, tokens_BS=None):
        shape = x_BSD.shape
        x = x_BSD.reshape(-1, shape[-1])
        weights, idx = self.route(x, None if tokens_BS is None else tokens_BS.reshape(-1))
        self.sow(nnx.Intermediate, "experts", idx.reshape(*shape[:-1], -1))
        y = self.routed(x, weights, idx)
        if self.shared is not None:
            y = y + self.shared(x).astype(jnp.float32)
        return y.astype(x_BSD.dtype).reshape(shape)

    def routed(self, x_ND, weights_Nk, idx_Nk):
        """Σ_k weight_k · expert_{idx_k}(x) in fp32, experts run over tokens sorted by expert."""
        n, k = idx_Nk.shape
        flat = idx_Nk.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        xs = x_ND[order // k].astype(self.policy.compute_dtype)
        dot = lambda a, w: jax.lax.ragged_dot(a, w[...].astype(self.policy.compute_dtype), sizes,
                                              precision=self.policy.precision,
                                              preferred_element_type=jnp.float32)
        h = swiglu(dot(xs, self.w1), dot(xs, self.w3), self.limit) * weights_Nk.reshape(-1)[order][:, None]
        ys = dot(h.astype(self.policy.compute_dtype), self.w2)
        y = jnp.zeros_like(ys).at[order].set(ys)
        return y.reshape(n, k, -1).sum(axis=1)


def swiglu(gate, up, limit: float):
    """silu(min(gate, L)) · clip(up, -L, L) in fp32 (the clamps keep FP8/FP4 activations in range)."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    return jax.nn.silu(gate) * up


class SwiGLU(nnx.Module):
    """The shared expert: a dense clamped SwiGLU."""

    def __init__(self, dim: int, inter: int, limit: float, *, policy: Policy, rngs: nnx.Rngs):
        self.limit = limit
        self.w1 = Dense(dim, inter, ("embed", "mlp"), policy=policy, rngs=rngs)
        self.w3 = Dense(dim, inter, ("embed", "mlp"), policy=policy, rngs=rngs)
        self.w2 = Dense(inter, dim, ("mlp", "embed"), policy=policy, rngs=rngs)

    def __call__(self, x):
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit).astype(x.dtype))
