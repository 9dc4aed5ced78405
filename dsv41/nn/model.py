"""The whole stack: embedding → N residual streams → layers → final collapse → norm → head.

The final collapse uses the last FFN site's `pre` (single-pass mHC, V4.1) or its own `hc_head`
(classic mHC, V4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41.nn import mhc, rope
from dsv41.nn.block import Block
from dsv41.nn.linear import Dense, param
from dsv41.nn.norm import RMSNorm
from dsv41.nn.policy import Policy
from dsv41.plan import layer_plan


class Transformer(nnx.Module):
    def __init__(self, cfg, engram_rows: dict[int, int], *, policy: Policy, rngs: nnx.Rngs):
        a = cfg.architecture
        plan = layer_plan(cfg)
        tables = rope.inv_freq_tables(cfg)
        pools = {r.candidate_source for r in plan if r.candidate_source is not None}
        self.streams = a.mhc.streams
        self.engram_layers = tuple(r.index for r in plan if r.engram)
        self.embed = param(rngs, (a.vocab_size, a.hidden_size), ("vocab", "embed"), policy.param_dtype, policy.init_std)
        self.layers = nnx.List([
            Block(cfg, r, tables, r.index in pools, engram_rows.get(r.index), policy=policy, rngs=rngs)
            for r in plan])
        self.hc_head = (mhc.HyperHead(a.mhc.streams, a.hidden_size, eps=a.mhc.eps, norm_eps=a.norm_eps,
                                     init_std=policy.init_std, rngs=rngs)
                        if a.mhc.variant == "classic" else None)
        self.norm = RMSNorm(a.hidden_size, a.norm_eps, "embed")
        self.head = Dense(a.hidden_size, a.vocab_size, ("embed", "vocab"), policy=policy, rngs=rngs)

    def __call__(self, tokens_BS, positions_BS, engram_ids_BSLC=None):
        """Logits [B, S, V] in fp32 of a whole sequence (teacher forced)."""
        x = jnp.take(self.embed[...], tokens_BS, axis=0)
        x_BSND = jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], self.streams, x.shape[-1]))
        pre = jax.nn.one_hot(jnp.zeros(tokens_BS.shape, jnp.int32), self.streams, dtype=jnp.float32)
        published: dict = {}
        for layer in self.layers:
            ids = None
            if layer.engram is not None:
                ids = engram_ids_BSLC[:, :, self.engram_layers.index(layer.attn.record.index)]
            x_BSND, pre = layer(x_BSND, pre, lambda attn, h: attn(h, positions_BS, published), ids, tokens_BS)
        h = self.norm(self.hc_head(x_BSND) if self.hc_head is not None else mhc.collapse(x_BSND, pre))
        return self.head(h).astype(jnp.float32)
