"""Manifold-constrained hyper-connections (arXiv 2512.24880; DESIGN §3.1), all in float32.

The residual is N streams X [B, S, N, D]. A site (attention or FFN) owns `fn` [(2+N)·N, N·D],
`base` [(2+N)·N] and `scale` [3]; from the RMS-normalised flattened streams it computes
  pre  = σ(mix[:N]·scale0 + base) + eps                  how the site's input collapses the streams
  post = 2σ(mix[N:2N]·scale1 + base)                       how the site's output enters each stream
  comb = Sinkhorn(softmax_rows(mix[2N:]·scale2 + base))    [source, destination] residual mixing
and updates X'_k = post_k · y + Σ_j comb[j, k] · X_j.
Single-pass (V4.1): a site collapses with the `pre` of the previous site; classic (V4): its own,
and the model ends with a `HyperHead` collapse that has its own parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41.nn.linear import param
from dsv41.nn.norm import rms_normalize


class HyperConnection(nnx.Module):
    """The mixing parameters of one site."""

    def __init__(self, streams: int, dim: int, *, sinkhorn_iters: int, eps: float, norm_eps: float,
                 init_std: float, rngs: nnx.Rngs, unroll: bool = False):
        self.streams, self.sinkhorn_iters, self.eps, self.norm_eps = streams, sinkhorn_iters, eps, norm_eps
        self.unroll = unroll
        mix = (2 + streams) * streams
        self.fn = param(rngs, (mix, streams * dim), ("hc_mix", "hc_embed"), jnp.float32, init_std)
        self.base = nnx.Param(jnp.zeros((mix,), jnp.float32), out_sharding=("hc_mix",), eager_sharding=False)
        self.scale = nnx.Param(jnp.ones((3,), jnp.float32), out_sharding=(None,), eager_sharding=False)

    def mixes(self, x_BSND):
        """(pre [B,S,N], post [B,S,N], comb [B,S,N,N]) from the streams."""
        n = self.streams
        flat = rms_normalize(x_BSND.reshape(*x_BSND.shape[:-2], -1), self.norm_eps)
        mix = jnp.dot(flat, self.fn[...].T, precision=jax.lax.Precision.HIGHEST)
        base, scale = self.base[...], self.scale[...]
        pre = jax.nn.sigmoid(mix[..., :n] * scale[0] + base[:n]) + self.eps
        post = 2 * jax.nn.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
        logits = (mix[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(*mix.shape[:-1], n, n)
        # Sinkhorn with the [source, destination] axes leading: the row and column sums are then adds of
        # whole [B, S] planes, which XLA fuses; summing the trailing size-4 axes was half of a CPU
        # training step's mHC time (fwd + bwd, 20 iterations per site).
        comb = jnp.moveaxis(logits, (-2, -1), (0, 1))
        comb = jax.nn.softmax(comb, axis=1) + self.eps
        comb = comb / (comb.sum(axis=0, keepdims=True) + self.eps)
        eps = self.eps

        def iteration(_, comb):
            comb = comb / (comb.sum(axis=1, keepdims=True) + eps)
            return comb / (comb.sum(axis=0, keepdims=True) + eps)

        # A loop, not an unrolled chain: traced and compiled once whatever the iteration count (unrolled
        # only for XLA's cost analysis, which counts a loop body once: `Lowering.unroll_layers`).
        if self.unroll:
            for i in range(self.sinkhorn_iters - 1):
                comb = iteration(i, comb)
        else:
            comb = jax.lax.fori_loop(0, self.sinkhorn_iters - 1, iteration, comb)
        return pre, post, jnp.moveaxis(comb, (0, 1), (-2, -1))


class HyperHead(nnx.Module):
    """Classic mHC's final collapse (V4): its own `pre` from the streams (fn [N, N·D], base [N], scale [1])."""

    def __init__(self, streams: int, dim: int, *, eps: float, norm_eps: float, init_std: float, rngs: nnx.Rngs):
        self.eps, self.norm_eps = eps, norm_eps
        self.fn = param(rngs, (streams, streams * dim), ("hc_mix", "hc_embed"), jnp.float32, init_std)
        self.base = nnx.Param(jnp.zeros((streams,), jnp.float32), out_sharding=("hc_mix",), eager_sharding=False)
        self.scale = nnx.Param(jnp.ones((1,), jnp.float32), out_sharding=(None,), eager_sharding=False)

    def __call__(self, x_BSND):
        """The model output before the final norm: Σ_j pre_j · X_j, [B, S, D]."""
        flat = rms_normalize(x_BSND.reshape(*x_BSND.shape[:-2], -1), self.norm_eps)
        mix = jnp.dot(flat, self.fn[...].T, precision=jax.lax.Precision.HIGHEST)
        pre = jax.nn.sigmoid(mix * self.scale[0] + self.base[...]) + self.eps
        return collapse(x_BSND, pre)


def collapse(x_BSND, pre_BSN):
    """The site input: Σ_j pre_j · X_j, as N multiply-adds of whole [B, S, D] planes (j = 0 first): XLA's
    CPU fusion of the same sum as a reduce over the size-N axis took ~13 ms per site on a 1,024-token
    chunk at width 128, about a third of the prefill."""
    x = x_BSND.astype(jnp.float32)
    out = pre_BSN[..., 0, None] * x[..., 0, :]
    for j in range(1, x.shape[-2]):
        out = out + pre_BSN[..., j, None] * x[..., j, :]
    return out.astype(x_BSND.dtype)


def expand(y_BSD, x_BSND, post_BSN, comb_BSNN):
    """X'_k = post_k · y + Σ_j comb[j, k] · X_j."""
    mixed = jnp.einsum("bsjk,bsjd->bskd", comb_BSNN, x_BSND.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    return (post_BSN[..., None] * y_BSD.astype(jnp.float32)[..., None, :] + mixed).astype(x_BSND.dtype)
