"""The attention layer of every V4.1 layer (DESIGN §3.2), full-sequence form.

qr = q_norm(wq_a x); q = rope(wq_b qr) [B,S,H,K]; kv = fp8(rope(kv_norm(wkv x))) [B,S,K], the single
shared latent used as key and value. One softmax with a per-head sink (denominator only) runs over
the window keys (t-window+1 … t) and the entries selected for the query; the output's RoPE dims are
rotated back at the query position, then projected by the grouped wo_a (block-diagonal over
o_groups) and wo_b. Full layers own a compressor (and indexer keys); Full and Reindex layers own an
indexer query; Reuse layers read what their sources hand on (`attend.Handoff`). `step` runs the same
layer over the inference cache (`attention_cache`). V4 (compat): `attention_v4.AttentionV4`, the same
interface with its own compressed branch, and the per-head query RMSNorm V4 had
(`architecture.q_head_norm`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41 import quant
from dsv41.nn import attention_cache
from dsv41.nn import indexer as ix
from dsv41.nn.attend import NEG_INF, Handoff, attend_step, window_mask
from dsv41.nn.compressor import Compressor
from dsv41.nn.linear import Dense, param
from dsv41.nn.norm import RMSNorm, rms_normalize
from dsv41.nn.policy import Policy
from dsv41.nn.rope import apply_rope
from dsv41.plan import FULL, REINDEX, LayerRecord


class Attention(nnx.Module):
    def __init__(self, cfg, record: LayerRecord, inv_freq: dict, builds_pool: bool, *, policy: Policy,
                 rngs: nnx.Rngs):
        a = cfg.architecture
        d, h, k = a.hidden_size, a.num_heads, a.head_dim
        self.record = record
        self.heads, self.head_dim, self.groups = h, k, a.o_groups
        self.window = cfg.kv_cache.swa_window_size
        self.fake_quant = cfg.quant == "qat"
        self.kernels = cfg.runtime.kernels  # the cached step's Pallas kernels or XLA path (DESIGN §8)
        # V4's per-head query RMSNorm (unweighted); V4.1 dropped it (DESIGN §2).
        self.q_head_eps = a.norm_eps if a.q_head_norm else None
        # Static tables (tuples, not arrays: they are part of the module's structure, not its state).
        self.inv_freq = tuple(float(f) for f in inv_freq[record.rope])
        self.compressed_inv_freq = tuple(float(f) for f in inv_freq["compressed"])

        self.wq_a = Dense(d, a.q_lora_rank, ("embed", "q_lora"), policy=policy, rngs=rngs)
        self.q_norm = RMSNorm(a.q_lora_rank, a.norm_eps, "q_lora")
        self.wq_b = Dense(a.q_lora_rank, h * k, ("q_lora", "q_heads"), policy=policy, rngs=rngs)
        self.wkv = Dense(d, k, ("embed", "kv"), policy=policy, rngs=rngs)
        self.kv_norm = RMSNorm(k, a.norm_eps, "kv")
        self.wo_a = param(rngs, (a.o_groups, h * k // a.o_groups, a.o_lora_rank), ("o_groups", "o_in", "o_lora"),
                          policy.param_dtype, policy.init_std)
        self.wo_b = Dense(a.o_groups * a.o_lora_rank, d, ("o_proj", "embed"), policy=policy, rngs=rngs)
        self.attn_sink = nnx.Param(jnp.zeros((h,), jnp.float32), out_sharding=("heads",), eager_sharding=False)
        self.policy = policy
        self._build_compressed_branch(cfg, builds_pool, policy, rngs)

    def _build_compressed_branch(self, cfg, builds_pool: bool, policy: Policy, rngs: nnx.Rngs):
        """V4.1 (CSA2): Full layers own a compressor and indexer keys, Full/Reindex an indexer query."""
        a, record = cfg.architecture, self.record
        d, k = a.hidden_size, a.head_dim
        ixc = cfg.csa2.indexer
        self.top_k = ixc.top_k
        self.score_tile = cfg.runtime.score_tile  # the cached step scores the filled tiles of its store
        self.builds_pool = builds_pool
        self.pool_max_blocks, self.pool_block_size = ixc.hierarchical.max_blocks, ixc.hierarchical.positions_per_block
        self.compressor = (Compressor(d, k, record.ratio, a.norm_eps, policy=policy, rngs=rngs)
                           if record.stores_entries else None)
        self.indexer = (ix.Indexer(d, a.q_lora_rank, k, ixc.query_heads, ixc.head_dim, record.mode == FULL,
                                   a.norm_eps, policy=policy, rngs=rngs)
                        if record.mode in (FULL, REINDEX) else None)

    def project(self, x_BSD, positions_BS):
        """(qr [B,S,Q], q [B,S,H,K], kv [B,S,K]): the query latent, the rotated queries and the rotated
        key/value latent, before its FP8 storage (every form of the layer starts here)."""
        b, s, _ = x_BSD.shape
        inv_freq = np.asarray(self.inv_freq, np.float32)
        qr = self.q_norm(self.wq_a(x_BSD))
        q = self.wq_b(qr).reshape(b, s, self.heads, self.head_dim)
        if self.q_head_eps is not None:
            q = rms_normalize(q, self.q_head_eps).astype(q.dtype)
        q = apply_rope(q, positions_BS, inv_freq)
        kv = apply_rope(self.kv_norm(self.wkv(x_BSD)), positions_BS, inv_freq)
        return qr, q, kv

    def output(self, out_BSHK, positions_BS):
        """The layer's output [B,S,D] from the attention's [B,S,H,K]: RoPE dims rotated back at the query
        position, then the grouped wo_a and wo_b (every form of the layer ends here)."""
        b, s = out_BSHK.shape[:2]
        out = apply_rope(out_BSHK, positions_BS, np.asarray(self.inv_freq, np.float32), inverse=True)
        grouped = out.reshape(b, s, self.groups, -1)
        y = jnp.einsum("bsgi,gio->bsgo", grouped.astype(self.policy.compute_dtype),
                       self.wo_a[...].astype(self.policy.compute_dtype), precision=self.policy.precision)
        return self.wo_b(y.reshape(b, s, -1))

    def __call__(self, x_BSD, positions_BS, published: dict):
        """(attention output [B, S, D], this layer's `Handoff` or None) over the whole sequence: the step's
        math with every key in view at once (window and selection as masks). published: {layer: Handoff}
        of the layers before it."""
        rec = self.record
        qr, q, kv = self.project(x_BSD, positions_BS)
        if self.fake_quant:
            kv = quant.fake_quant(kv, quant.FP8_UE8M0_32)
        self.sow(nnx.Intermediate, "window_kv", kv)

        keys, mask = kv, window_mask(positions_BS, positions_BS, self.window)
        mine = None
        if rec.ratio:
            mine = self._publish(x_BSD, qr, positions_BS, published)
            seen = {**published, rec.index: mine} if mine is not None else published
            entries = seen[rec.kv_source].entries
            keys = jnp.concatenate([kv, entries.astype(kv.dtype)], axis=1)
            chosen = (seen[rec.index_source].selected if rec.selects  # top-k (CSA, CSA2)
                      else ix.visible_entries(positions_BS, rec.ratio, entries.shape[1]))  # all (HCA)
            mask = jnp.concatenate([mask, chosen], axis=-1)

        out = attend_step(q, keys, mask, None, None, self.attn_sink[...], self.head_dim ** -0.5)
        return self.output(out, positions_BS), mine

    def _publish(self, x_BSD, qr_BSQ, positions_BS, published: dict) -> Handoff | None:
        rec = self.record
        cinv = np.asarray(self.compressed_inv_freq, np.float32)
        entries = index_keys = None
        if rec.stores_entries:
            latent = self.compressor(x_BSD)  # [B, T, K] before RoPE
            entry_pos = ix.entry_positions(latent, rec.ratio)
            entries = apply_rope(latent, entry_pos, cinv)
            if self.fake_quant:
                entries = quant.fake_quant(entries, quant.FP4_E4M3_16)
            self.sow(nnx.Intermediate, "entries", entries)
            if self.indexer is not None and self.indexer.wk is not None:
                index_keys = self.indexer.keys(latent, entry_pos, cinv, self.fake_quant)
                self.sow(nnx.Intermediate, "index_keys", index_keys)
        if self.indexer is None:
            return Handoff(entries=entries, index_keys=index_keys) if entries is not None else None
        source = Handoff(entries=entries, index_keys=index_keys) if rec.stores_entries else published[rec.kv_source]
        num_entries = source.entries.shape[1]
        visible = ix.visible_entries(positions_BS, rec.ratio, num_entries)
        scores = self.indexer.scores(x_BSD, qr_BSQ, positions_BS, source.index_keys, visible, cinv,
                                     self.fake_quant)
        pool = None
        if self.builds_pool:
            blocks = ix.candidate_blocks(scores, (positions_BS + 1) // rec.ratio, self.pool_max_blocks,
                                         self.pool_block_size)
            self.sow(nnx.Intermediate, "pool_blocks", blocks)
            pool = ix.blocks_to_entries(blocks, self.pool_block_size, num_entries)
        if rec.candidate_source is not None:
            scores = jnp.where(published[rec.candidate_source].pool, scores, NEG_INF)
        picks = ix.top_k_indices(scores, self.top_k)
        self.sow(nnx.Intermediate, "picks", picks)
        return Handoff(entries=entries, index_keys=index_keys, picks=picks,
                       selected=ix.indices_to_mask(picks, num_entries), pool=pool)

    def step(self, x_BSD, positions_BS, valid_BS, lengths_B, ring, window_start_B, published: dict, stores: dict,
             entries_ready: bool = False):
        """The layer over the inference cache, S new tokens per row: (y [B, S, D], (ring, stores, handoff))
        (`attention_cache.attention_step`, whose docstring has the arguments)."""
        return attention_cache.attention_step(self, x_BSD, positions_BS, valid_BS, lengths_B, ring, window_start_B,
                                              published, stores, entries_ready)

    def cached_compressed(self, x_BSD, qr_BSQ, positions_BS, lengths_B, counts_B, published, stores,
                          entries_ready=False):
        """`step`'s compressed branch (`attention_cache.compressed_v41`; V4 compat has its own)."""
        return attention_cache.compressed_v41(self, x_BSD, qr_BSQ, positions_BS, lengths_B, counts_B, published,
                                              stores, entries_ready)
