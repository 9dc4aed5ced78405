"""One layer: attention site → FFN site, each wrapped in mHC (DESIGN §3.1). A layer's Engram (DESIGN §3.7)
runs before its Block, from the model (`Transformer.engram_step`): its table has its own number of rows."""

from __future__ import annotations

import jax
from flax import nnx

from dsv41 import schema
from dsv41.nn import mhc
from dsv41.nn.attention import Attention
from dsv41.nn.attention_v4 import AttentionV4
from dsv41.nn.moe import MoE
from dsv41.nn.norm import RMSNorm
from dsv41.nn.policy import Policy
from dsv41.plan import LayerRecord


class Block(nnx.Module):
    def __init__(self, cfg, record: LayerRecord, inv_freq: dict, builds_pool: bool, *, policy: Policy,
                 rngs: nnx.Rngs):
        a = cfg.architecture
        d, n = a.hidden_size, a.mhc.streams
        hc = dict(sinkhorn_iters=a.mhc.sinkhorn_iters, eps=a.mhc.eps, norm_eps=a.norm_eps, init_std=policy.init_std,
                  rngs=rngs, unroll=policy.lowering.unroll_layers)
        self.classic = a.mhc.variant == "classic"
        self.hc_attn = mhc.HyperConnection(n, d, **hc)
        self.attn_norm = RMSNorm(d, a.norm_eps, "embed")
        attention = AttentionV4 if a.family == schema.V4 else Attention
        self.attn = attention(cfg, record, inv_freq, builds_pool, policy=policy, rngs=rngs)
        self.hc_ffn = mhc.HyperConnection(n, d, **hc)
        self.ffn_norm = RMSNorm(d, a.norm_eps, "embed")
        m = a.moe
        hashed = record.index < m.hash_layers  # V4: the first layers route by a fixed token table
        self.ffn = MoE(d, m.num_experts, m.top_k, m.intermediate_size, m.num_shared_experts, m.route_scale,
                       m.swiglu_limit, a.vocab_size if hashed else 0, policy=policy, rngs=rngs)

    def __call__(self, x_BSND, pre_BSN, attend, tokens_BS=None, token_block: int = 0, *, experts=None):
        """Single-pass mHC: each site collapses with the previous site's `pre` and hands its own on.
        Classic mHC (V4): each site collapses with its own `pre` (pre_BSN is not read).
        `attend(attn, h) -> (y, state)` runs the attention layer on its normalised input: over the whole
        sequence (`forward`: state is the layer's `Handoff` or None) or over the cache (`dsv41.steps`: its
        new window ring, the updated stores and its Handoff). token_block, experts: the MoE's (`MoE.__call__`).
        Returns (x, pre, state)."""
        # Named scopes label the compiled program's operations (`dsv41 compile-report --breakdown`).
        with jax.named_scope("mhc"):
            attn_pre, post, comb = self.hc_attn.mixes(x_BSND)
            h = mhc.collapse(x_BSND, attn_pre if self.classic else pre_BSN)
        self.sow(nnx.Intermediate, "attn_input", h)
        with jax.named_scope("attention"):
            y, state = attend(self.attn, self.attn_norm(h))
        with jax.named_scope("mhc"):
            x_BSND = mhc.expand(y, x_BSND, post, comb)
            ffn_pre, post, comb = self.hc_ffn.mixes(x_BSND)
            h = mhc.collapse(x_BSND, ffn_pre if self.classic else attn_pre)
        with jax.named_scope("moe"):
            y = self.ffn(self.ffn_norm(h), tokens_BS, token_block=token_block, experts=experts)
        with jax.named_scope("mhc"):
            return mhc.expand(y, x_BSND, post, comb), ffn_pre, state
