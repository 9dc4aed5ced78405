"""The attention layer of every V4.1 layer (DESIGN §3.2–§3.4), one mechanism with two ways in.

qr = q_norm(wq_a x); q = rope(wq_b qr) [B,S,H,K]; kv = fp8(rope(kv_norm(wkv x))) [B,S,K], the single
shared latent used as key and value. One softmax with a per-head sink (denominator only) runs over
the window keys (t-window+1 … t) and the entries selected for the query; the output's RoPE dims are
rotated back at the query position, then projected by the grouped wo_a (block-diagonal over
o_groups) and wo_b. Full layers own a compressor (and indexer keys); Full and Reindex layers own an
indexer query; Reuse layers read what their sources hand on (`attend.Handoff`).

`step(x, …, ring, stores) -> (y, (ring, stores, handoff))` is the layer over the inference cache, S new
tokens per row, reading and writing the stored formats: the FP8 window ring holds the last `window`
tokens of the layer; a Full layer folds its compressor's unfinished group (the compressor's state)
into the new tokens, writes the completed entries (FP4 + E4M3 per 16) and indexer keys (MXFP4) into
its store and scores the queries against every visible key (the filled tiles only); a Reindex layer
scores only the keys of the candidate pool, gathered from the store, so its cost per query does not
grow with the context. Rows may hold different lengths and bring different numbers of new tokens
(`valid_BS`). The float cache (`quant: none`, and V4 compat) stores the values themselves and runs the
XLA reference paths (the Pallas kernels read the packed bytes). `__call__` is the same layer over a
whole sequence with every key in view at once (the window and the selection as masks: the
teacher-forced forward and training), through the same projections, compressor, indexer scoring,
`attend_step` and output path; a long sequence's blocks select and attend through the same kernels as the
cached step where its values are the stored formats (`training_kernel`).

V4 (compat): `attention_v4.AttentionV4`, the same interface with its own compressed branch, and the
per-head query RMSNorm V4 had (`architecture.q_head_norm`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from dsv41 import kv_store, quant
from dsv41.kernels import dispatch
from dsv41.kv_store import LayerStore, dequant_entries, dequant_keys, dequant_window, packed, ring_positions
from dsv41.nn import indexer as ix
from dsv41.nn import weights
from dsv41.nn.attend import (NEG_INF, Handoff, attend_step, band_source, blocks_length, over_query_blocks,
                             window_keys, window_mask)
from dsv41.nn.compressor import Compressor
from dsv41.nn.linear import Dense
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
        self.kernels = cfg.runtime.kernels  # Pallas kernels or the XLA path (DESIGN §8; `training_kernel`)
        # V4's per-head query RMSNorm (unweighted); V4.1 dropped it (DESIGN §2).
        self.q_head_eps = a.norm_eps if a.q_head_norm else None
        # Static tables (tuples, not arrays: they are part of the module's structure, not its state).
        self.inv_freq = tuple(float(f) for f in inv_freq[record.rope])
        self.compressed_inv_freq = tuple(float(f) for f in inv_freq["compressed"])

        self.wq_a = Dense(d, a.q_lora_rank, ("embed", "q_lora"), policy=policy, rngs=rngs, shipped=True)
        self.q_norm = RMSNorm(a.q_lora_rank, a.norm_eps, "q_lora")
        self.wq_b = Dense(a.q_lora_rank, h * k, ("q_lora", "q_heads"), policy=policy, rngs=rngs, shipped=True)
        self.wkv = Dense(d, k, ("embed", "kv"), policy=policy, rngs=rngs, shipped=True)
        self.kv_norm = RMSNorm(k, a.norm_eps, "kv")
        self.wo_a_kind = weights.kind_for(policy, weights.FP8)  # per group: the 32×32 blocks of each [in, out]
        self.wo_a, self.wo_a_scale = weights.make(rngs, (a.o_groups, h * k // a.o_groups, a.o_lora_rank),
                                                  ("o_groups", "o_in", "o_lora"), policy, self.wo_a_kind)
        self.wo_b = Dense(a.o_groups * a.o_lora_rank, d, ("o_proj", "embed"), policy=policy, rngs=rngs, shipped=True)
        self.attn_sink = nnx.Param(jnp.zeros((h,), jnp.float32), out_sharding=("heads",), eager_sharding=False)
        self.policy = policy
        # The whole-sequence form over blocks of this many queries when the sequence is longer (0: every query
        # at once): memory linear in the sequence length (`_blockwise`).
        self.query_block = int(cfg.runtime.query_block)
        self.row_loop = cfg.runtime.row_loop  # a chunk's cached step one row of each device at a time (`step`)
        self._build_compressed_branch(cfg, builds_pool, policy, rngs)

    def _build_compressed_branch(self, cfg, builds_pool: bool, policy: Policy, rngs: nnx.Rngs):
        """V4.1 (CSA2): Full layers own a compressor and indexer keys, Full/Reindex an indexer query."""
        a, record = cfg.architecture, self.record
        d, k = a.hidden_size, a.head_dim
        # The main entries' stored format (FP4 shipped, FP8 by config); the float cache ignores it.
        self.main_kv = kv_store.main_kv_format(cfg) if self.fake_quant else quant.FP4_E4M3_16
        ixc = cfg.csa2.indexer
        self.top_k = ixc.top_k
        self.score_tile = cfg.runtime.score_tile  # the cached step scores the filled tiles of its store
        self.builds_pool = builds_pool
        # Without a candidate pool, top-k over at least every entry picks every visible one (`step`).
        self.every_entry = not ixc.hierarchical.enabled
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
        # The barrier keeps the heads' [H, K] layout out of the wq_b matmul: with one query row per chip (v6e:4x8
        # decode at batch 32) libtpu otherwise reduced into that layout from a bf16 copy of the FP8 weight,
        # relaid per layer (3 × its bytes; docs/decode_bytes.md). The reshape then moves the [S, H·K] output only.
        q = jax.lax.optimization_barrier(self.wq_b(qr)).reshape(b, s, self.heads, self.head_dim)
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
        if self.wo_a_kind == weights.FP8 and self.policy.lowering.weights is None:  # the kernel, group by group
            ys = [weights.fp8_matmul(grouped[:, :, g], self.wo_a[g], self.wo_a_scale[g], self.policy)
                  for g in range(self.groups)]
            if ys[0] is not None:
                return self.wo_b(jnp.stack(ys, axis=2).reshape(b, s, -1))
        y = jnp.einsum("bsgi,gio->bsgo", grouped.astype(self.policy.compute_dtype),
                       weights.read(self.wo_a[...], None if self.wo_a_scale is None else self.wo_a_scale[...],
                                    self.wo_a_kind, ("o_groups", "o_in", "o_lora"), self.policy),
                       precision=self.policy.precision)
        return self.wo_b(y.reshape(b, s, -1))

    def __call__(self, x_BSD, positions_BS, published: dict, forced: dict | None = None, window_start=None):
        """(attention output [B, S, D], this layer's `Handoff` or None) over the whole sequence: the step's
        math with every key in view at once (window and selection as masks). published: {layer: Handoff}
        of the layers before it. forced: {"picks": [B, S, k] or None, "pool_ids": [B, S, M] or None}, an
        index source's choices to take instead of its own (selection replay, `dsv41.selections`).
        window_start [B]: window keys before it are not seen (the CED split in training, `attend.window_from`)."""
        rec = self.record
        qr, q, kv = self.project(x_BSD, positions_BS)
        if self.fake_quant:
            kv = self.window_fake_quant(kv)
        self.sow(nnx.Intermediate, "window_kv", kv)
        if 0 < self.query_block < x_BSD.shape[1]:
            return self._blockwise(x_BSD, qr, q, kv, positions_BS, published, forced, window_start)

        mine = entries = picks = None
        if rec.ratio:
            mine = self._publish(x_BSD, qr, positions_BS, published, forced)
            seen = {**published, rec.index: mine} if mine is not None else published
            entries = seen[rec.kv_source].entries.astype(kv.dtype)
            picks = seen[rec.index_source].picks if rec.selects else None
        band = band_source(kv, positions_BS, self.window, kv.shape[1], window_start)
        return self.output(self._weigh(q, *band, positions_BS, entries, picks), positions_BS), mine

    def _weigh(self, q_BSHK, keys_BTK, key_pos_BT, key_ok_BT, positions_BS, entries_BTK=None, picks_BSk=None):
        """The attention [B, S, H, K] of S queries over their window in [W keys before them | their own keys]
        (`band_source`) and the entries: the picked ones gathered (picks [B, S, k]) or, without picks, every
        visible one (HCA). The keys are laid out as the cached step lays them (`window_keys`: bands of 2W at
        multiples of W), so a query's sums run over the same keys in the same order whatever the number of
        queries beside it: a prefill of the first N tokens rounds as the forward over more does (issue 53)."""
        keys_w, mask_w = window_keys(keys_BTK, key_pos_BT, key_ok_BT, positions_BS, self.window)
        sink, scale = self.attn_sink[...], self.head_dim ** -0.5
        if picks_BSk is not None:
            sel = jax.vmap(lambda e, i: e[i])(entries_BTK, jnp.maximum(picks_BSk, 0))  # [B, S, k, K]
            return attend_step(q_BSHK, keys_w, mask_w, sel, picks_BSk >= 0, sink, scale)
        shared = None if entries_BTK is None else (
            entries_BTK, ix.visible_entries(positions_BS, self.record.ratio, entries_BTK.shape[1]))
        return attend_step(q_BSHK, keys_w, mask_w, None, None, sink, scale, shared)

    def _entries(self, x_BSD, stored: bool = False):
        """(entries [B, T, K], indexer keys [B, T, dI] or None, stored or None) a Full layer compresses from the
        whole sequence (recorded); Nones for a layer without a compressor. stored: the entries' bytes as the cache
        stores them (`Handoff.stored`), when asked, packed from the values before their fake quantisation (packing the
        fake-quantised FP4 values again is not exact: an E4M3 scale in its subnormal range can come out smaller)."""
        rec = self.record
        if not rec.stores_entries:
            return None, None, None
        cinv = np.asarray(self.compressed_inv_freq, np.float32)
        latent = self.compressor(x_BSD)  # [B, T, K] before RoPE
        entry_pos = ix.entry_positions(latent, rec.ratio)
        entries = apply_rope(latent, entry_pos, cinv)
        packed_entries = kv_store.quant_entries(entries, self.main_kv) if stored else None
        if self.fake_quant:
            entries = quant.fake_quant(entries, self.main_kv)
        self.sow(nnx.Intermediate, "entries", entries)
        index_keys = None
        if self.indexer is not None and self.indexer.wk is not None:
            index_keys = self.indexer.keys(latent, entry_pos, cinv, self.fake_quant)
            self.sow(nnx.Intermediate, "index_keys", index_keys)
        return entries, index_keys, packed_entries

    def _publish(self, x_BSD, qr_BSQ, positions_BS, published: dict, forced: dict | None = None) -> Handoff | None:
        rec = self.record
        given = (forced or {}).get("picks")
        cinv = np.asarray(self.compressed_inv_freq, np.float32)
        entries, index_keys, _ = self._entries(x_BSD)
        if self.indexer is None:
            return Handoff(entries=entries, index_keys=index_keys) if entries is not None else None
        source = Handoff(entries=entries, index_keys=index_keys) if rec.stores_entries else published[rec.kv_source]
        num_entries = source.entries.shape[1]
        visible = ix.visible_entries(positions_BS, rec.ratio, num_entries)
        if given is None:
            scores = self.indexer.scores(x_BSD, qr_BSQ, positions_BS, source.index_keys, visible, cinv,
                                         self.fake_quant)
        pool = None
        if self.builds_pool:
            pool_ids = (forced["pool_ids"] if given is not None else
                        ix.candidate_block_ids(scores, (positions_BS + 1) // rec.ratio, self.pool_max_blocks,
                                               self.pool_block_size))
            blocks = ix.block_ids_to_mask(pool_ids, -(-num_entries // self.pool_block_size))
            self.sow(nnx.Intermediate, "pool_ids", pool_ids)
            self.sow(nnx.Intermediate, "pool_blocks", blocks)
            pool = ix.blocks_to_entries(blocks, self.pool_block_size, num_entries)
        if given is not None:
            picks = given
        else:
            if rec.candidate_source is not None:
                scores = jnp.where(published[rec.candidate_source].pool, scores, NEG_INF)
            picks = ix.top_k_indices(scores, self.top_k)
        self.sow(nnx.Intermediate, "picks", picks)
        return Handoff(entries=entries, index_keys=index_keys, picks=picks,
                       selected=ix.indices_to_mask(picks, num_entries), pool=pool)

    def _blockwise(self, x_BSD, qr_BSQ, q_BSHK, kv_BSK, positions_BS, published: dict, forced: dict | None = None,
                   window_start=None):
        """`__call__` over blocks of `query_block` queries, in memory linear in the sequence length: each block
        scores the entries (`_select_blocks`) and attends its window band and its own picked entries, gathered
        (`attend_step`, as the cached step does), under `jax.checkpoint` (the backward pass recomputes a block).
        The picks are the whole-sequence form's (the same scores and top-k per query); positions must count
        0, 1, … along each row (the window is a band of the sequence)."""
        rec = self.record
        mine = entries = picks = None
        if rec.ratio:
            mine = self._publish_blocks(x_BSD, qr_BSQ, positions_BS, published, forced)
            seen = {**published, rec.index: mine} if mine is not None else published
            entries = seen[rec.kv_source].entries.astype(kv_BSK.dtype)
            picks = seen[rec.index_source].picks if rec.selects else None
        window, sink, scale = self.window, self.attn_sink[...], self.head_dim ** -0.5
        seq = self.policy.lowering.sequence  # sequence parallel: every lane reads the whole keys
        padded = blocks_length(x_BSD.shape[1], self.query_block, seq)
        keys, key_pos, key_ok = band_source(kv_BSK, positions_BS, window, padded, window_start)
        if seq is not None:
            keys, key_pos, key_ok, entries = (seq.whole(a) for a in (keys, key_pos, key_ok, entries))

        # The chunk kernel reads the cache's formats: the FP8 window and FP4 entries that `quant: qat` trains on.
        stored = seen[rec.kv_source].stored if rec.ratio else None
        impl = self.attention_kernel() if picks is not None and stored is not None else None
        if impl is not None:
            entry_bytes, entry_scales = stored

        def attend(n, q_b, pos_b, picks_b):
            span = q_b.shape[1] + window
            keys_b, kpos_b, kok_b = (jax.lax.dynamic_slice_in_dim(a, n * q_b.shape[1], span, axis=1)
                                     for a in (keys, key_pos, key_ok))
            if impl is not None:
                mask = kok_b[:, None, :] & window_mask(pos_b, kpos_b, window)
                return dispatch.sparse_attention_train(q_b, keys_b, mask, entries, entry_bytes, entry_scales, picks_b,
                                                       sink, scale, mode=impl, layout=self.policy.lowering.layout)
            return self._weigh(q_b, keys_b, kpos_b, kok_b, pos_b, entries, picks_b)

        out = over_query_blocks(attend, self.query_block, q_BSHK, positions_BS, picks, pads=(0, -1, -1), sequence=seq)
        return self.output(out, positions_BS), mine

    def _publish_blocks(self, x_BSD, qr_BSQ, positions_BS, published: dict, forced: dict | None = None
                        ) -> Handoff | None:
        """`_publish` for `_blockwise`: the same entries and indexer keys (linear in the sequence), the picks and
        the candidate pool's block ids chosen per block of queries; the Handoff holds no [S, T] masks."""
        rec = self.record
        cinv = np.asarray(self.compressed_inv_freq, np.float32)
        # The entries' bytes for the chunk kernel, where an index source will pick from them (a layer with an indexer).
        entries, index_keys, stored = self._entries(
            x_BSD, stored=self.indexer is not None and self.attention_kernel() is not None)
        if self.indexer is None:
            return Handoff(entries=entries, index_keys=index_keys, stored=stored) if entries is not None else None
        keys = index_keys if rec.stores_entries else published[rec.kv_source].index_keys
        pool = published[rec.candidate_source].pool_ids if rec.candidate_source is not None else None
        if (forced or {}).get("picks") is not None:  # selection replay: the given choices, named as chosen ones
            picks = checkpoint_name(forced["picks"], "picks")
            pool_ids = checkpoint_name(forced["pool_ids"], "pool_ids") if self.builds_pool else None
        else:
            sg = jax.lax.stop_gradient  # the picks take no gradient (the indexer trains by its KL alone)
            qI, w = self.indexer.query(sg(x_BSD), sg(qr_BSQ), positions_BS, cinv, self.fake_quant)
            # No tangent reaches the selection (its kernels have no derivative rule; nor need they one).
            picks, pool_ids = self.select_blocks(sg(qI), sg(w), positions_BS, sg(keys), pool)
        self.sow(nnx.Intermediate, "picks", picks)
        if pool_ids is not None:
            self.sow(nnx.Intermediate, "pool_ids", pool_ids)
        return Handoff(entries=entries, index_keys=index_keys, picks=picks, pool_ids=pool_ids, stored=stored)

    def select_blocks(self, qI_BSJd, w_BSJ, positions_BS, keys_BTd, pool_ids_BSM=None):
        """(picks [B, S, k], candidate-pool block ids [B, S, M] or None) of an index source over the whole
        sequence, `query_block` queries at a time: a Full layer scores the visible entries (the filled tiles),
        a Reindex layer only its candidate pool's entries, gathered a tile at a time (its scores outside the
        pool would be −inf: the same picks). One indexer head at a time (`lightning_scores`' group)."""
        rec, block, k = self.record, self.pool_block_size, self.top_k
        num = keys_BTd.shape[1]
        # A Full layer scores the entries its block's queries may see, `score_tile` at a time with a running
        # top-k (`ix.filled_top_k`, as the cached step does): no [Q, T] scores, and the later half of the
        # entries unscored for the earlier queries (causality). The keys padded to whole tiles.
        tile = self.score_tile
        seq = self.policy.lowering.sequence  # sequence parallel: every lane reads the whole keys
        if seq is not None:
            keys_BTd = seq.whole(keys_BTd)
        padded = jnp.pad(keys_BTd, [(0, 0), (0, -(-num // tile) * tile - num), (0, 0)])
        impl = self.training_kernel() if pool_ids_BSM is None else None  # a Reindex layer scores its pool on XLA
        if impl is not None:  # the kernels read the keys as the cache stores them (exact: they are MXFP4 already)
            key_bytes, key_scales = kv_store.quant_keys(keys_BTd)
            layout = self.policy.lowering.layout

        def select(n, q_b, w_b, pos_b, pool_b):
            visible = (pos_b + 1) // rec.ratio
            if pool_b is not None and self.policy.lowering.unroll_layers:  # FLOP counting: the pool at once
                entry, ok = ix.pool_entries(pool_b, block, visible)
                gathered = jax.vmap(lambda t, i: t[i])(keys_BTd, entry)  # [B, Q, P, dI]
                scores = ix.lightning_scores_per_query(q_b, gathered, w_b, ok, self.indexer.unroll, group=1)
                return ix.pool_top_k(scores, jnp.where(ok, entry, -1), k), None
            if pool_b is not None:  # the pool's keys gathered `score_tile` entries at a time ([Q, tile, dI])
                return ix.pool_chunks_top_k(q_b, w_b, keys_BTd, pool_b, block, visible, k, tile // block,
                                            self.indexer.unroll, group=1, rows=self._rows(visible.shape[0])), None
            if impl is not None:  # the prefill kernels: one pass over the visible tiles, as the cached step's
                args = (q_b, w_b, key_bytes, key_scales, pos_b, rec.ratio)
                if self.builds_pool:
                    return dispatch.scores_and_pool(*args, top_k=k, max_blocks=self.pool_max_blocks, block=block,
                                                    mode=impl, layout=layout)
                return dispatch.indexer_top_k(*args, k, mode=impl, layout=layout), None
            if self.policy.lowering.unroll_layers:  # FLOP counting: static shapes, every entry scored
                scores = ix.lightning_scores(q_b, keys_BTd, w_b, ix.visible_entries(pos_b, rec.ratio, num),
                                             self.indexer.unroll, group=1)
                pool = (ix.candidate_block_ids(scores, visible, self.pool_max_blocks, block)
                        if self.builds_pool else None)
                return ix.top_k_indices(scores, k), pool

            def tile_scores(start):  # entries start … start + tile − 1 (the padding is never visible)
                entry = start + jnp.arange(tile)
                keys = jax.lax.dynamic_slice_in_dim(padded, start, tile, axis=1)
                return ix.lightning_scores(q_b, keys, w_b, entry < visible[..., None], self.indexer.unroll, group=1)

            pool = (self.pool_max_blocks, block, visible) if self.builds_pool else None
            picks, pool_ids = ix.filled_top_k(tile_scores, visible.shape, padded.shape[1], tile, jnp.max(visible), k,
                                              pool, rows=self._rows(visible.shape[0]))
            if pool_ids is not None:  # blocks past the sequence's entries are never kept: its own block count
                pool_ids = jnp.where(pool_ids < -(-num // block), pool_ids, -1)
            return picks, pool_ids

        picks, pool = over_query_blocks(select, self.query_block, qI_BSJd, w_BSJ, positions_BS, pool_ids_BSM,
                                        pads=(0, 0, -1, -1), remat=False, sequence=seq)
        # Named, so that a rematerialised layer may keep them instead of selecting again (`train`'s remat).
        name = checkpoint_name
        return name(picks, "picks"), (None if pool is None else name(pool, "pool_ids"))

    def step(self, x_BSD, positions_BS, valid_BS, lengths_B, ring: LayerStore, window_start_B,
             published: dict, stores: dict, entries_ready: bool = False):
        """One layer over the cache. `ring`: this layer's window ring, leaves "values" [B,W,K] and "scales"
        [B,W,K/32] (`kv_store.LayerStore`), holding positions >= window_start (FP8 bytes; the float cache:
        floats and no scales); `stores` maps the layers that own a compressor (as the layer's record names
        them) to their `LayerStore` of `CompressedKV` leaves; published: {layer: Handoff} of the layers before
        it; `entries_ready`: the compressor already wrote these tokens' entries (a CED replay).
        Returns (y [B,S,D], (ring, stores, handoff)): the new ring, `stores` with this layer's store updated
        (a new dict), and what it hands on (its picks and pool ids) or None. With `runtime.row_loop: on` a chunk
        runs as a loop over the rows each device holds (`_row_groups`), the stores viewed a row at a time."""
        b, s, _ = x_BSD.shape
        groups = self._row_groups(b, s)
        rows = (x_BSD, positions_BS, valid_BS, lengths_B, window_start_B, published)
        if groups is None:
            out, ring, stores, handoff = self._attend_cached(*rows, ring, stores, entries_ready)
        else:  # each device's rows one at a time: the program holds one row's attention (docs/compile_time.md)
            n = b // groups

            def split(a):  # [B, …] -> [n, D, …]: trip i takes row i of each device's n rows
                return jnp.swapaxes(a.reshape(groups, n, *a.shape[1:]), 0, 1)

            def one(carry, xs):
                i, *row = xs
                ring_i = LayerStore(carry[0], ring.layer, i)
                stores_i = {k: LayerStore(leaves, stores[k].layer, i) for k, leaves in carry[1].items()}
                out, ring_i, stores_i, handoff = self._attend_cached(*row, ring_i, stores_i, entries_ready)
                return (ring_i.leaves, {k: v.leaves for k, v in stores_i.items()}), (out, handoff)

            start = (ring.split_rows(groups).leaves, {k: v.split_rows(groups).leaves for k, v in stores.items()})
            (ring_leaves, store_leaves), (out, handoff) = jax.lax.scan(
                one, start, (jnp.arange(n, dtype=jnp.int32), *jax.tree.map(split, rows)))
            ring = LayerStore(ring_leaves, ring.layer, 0).merge_rows()
            stores = {k: LayerStore(v, stores[k].layer, 0).merge_rows() for k, v in store_leaves.items()}
            out, handoff = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1).reshape(b, *a.shape[2:]), (out, handoff))
        for name in ("picks", "pool_ids"):  # what an index source chose (selection replay records it)
            if handoff is not None and getattr(handoff, name) is not None:
                self.sow(nnx.Intermediate, name, getattr(handoff, name))
        return out, (ring, stores, handoff)

    def _row_groups(self, b: int, s: int) -> int | None:
        """How many row groups `step` splits a chunk's B rows into, looping over the rows of each (the rows each
        device holds: one group a device); None: no loop (`runtime.row_loop` off, decode, a single row a device,
        or the rows' tokens split over a mesh axis)."""
        if s == 1 or self.row_loop != "on":
            return None
        layout = self.policy.lowering.layout
        groups = 1
        if layout is not None and layout.token_axes:
            if layout.seq_axes:
                return None
            groups = math.prod(layout.mesh.shape[a] for a in layout.token_axes)
        return groups if b % groups == 0 and b > groups else None

    def _attend_cached(self, x_BSD, positions_BS, valid_BS, lengths_B, window_start_B, published,
                       ring: LayerStore, stores: dict, entries_ready: bool):
        """`step` on its rows (all, or one of each device's in its loop): (y [B, S, D], ring, stores, handoff)."""
        rec = self.record
        b, s, _ = x_BSD.shape
        counts = valid_BS.sum(-1).astype(jnp.int32)
        new_len = lengths_B + counts
        with jax.named_scope("projections"):
            qr, q, kv = self.project(x_BSD, positions_BS)
        quantised = packed(ring.leaves["values"])
        if quantised:  # the FP8 ring
            kv_vals, kv_scales = self.encode_window(kv)
            kv = self.decode_window(kv_vals, kv_scales).astype(x_BSD.dtype)
        else:
            kv_vals, kv_scales = kv, jnp.zeros((b, s, 0), jnp.uint8)
        keep = valid_BS & (positions_BS >= new_len[:, None] - self.window)
        slot = positions_BS % self.window

        def write(ring):
            return ring.write("values", kv_vals, slot, keep).write("scales", kv_scales, slot, keep)

        # Window keys. Decode (one new token): it takes the slot of the one position that leaves its window,
        # so the ring is written first and read once as it then is (reading the old ring beside the write made
        # XLA copy the whole ring for every layer). A chunk: the ring before it, then the new tokens.
        if s == 1:
            ring = write(ring)
            win_vals, win_scales = ring.get("values"), ring.get("scales")
            key_pos = ring_positions(new_len, self.window)
            key_ok = key_pos >= jnp.maximum(window_start_B, 0)[:, None]
            keys_w = (self.decode_window(win_vals, win_scales) if quantised else win_vals).astype(kv.dtype)
        else:
            ring_vals, ring_scales = ring.get("values"), ring.get("scales")
            ring_keys = (self.decode_window(ring_vals, ring_scales) if quantised else ring_vals).astype(kv.dtype)
            ring_pos = ring_positions(lengths_B, self.window)
            win_vals = jnp.concatenate([ring_vals, kv_vals], axis=1)
            win_scales = jnp.concatenate([ring_scales, kv_scales], axis=1)
            keys_w = jnp.concatenate([ring_keys, kv], axis=1)
            key_pos = jnp.concatenate([ring_pos, positions_BS], axis=1)
            key_ok = jnp.concatenate([ring_pos >= jnp.maximum(window_start_B, 0)[:, None], valid_BS], axis=1)
            ring = write(ring)
        keys_w, mask_w = window_keys(keys_w, key_pos, key_ok, positions_BS, self.window)

        sel = sel_ok = shared = picks = handoff = None
        banded = keys_w.ndim == 4
        if rec.ratio:  # the compressed branch: the layer's own (V4.1 below, V4 `attention_v4`)
            (sel, sel_ok, shared, picks), stores, handoff = self.cached_compressed(
                x_BSD, qr, positions_BS, lengths_B, counts, published, stores, entries_ready)
            store = stores.get(rec.kv_source)
            if picks is not None and self.every_entry and self.top_k >= store.leaves["entries"].shape[-2]:
                # Top-k of at least every entry, no pool: the picks are every visible entry, which every query of
                # a row reads from the one store (no per-query gather of them all).
                entries = dequant_entries(store.get("entries"), store.get("entry_scales")).astype(kv.dtype)
                shared, picks = (entries, ix.visible_entries(positions_BS, rec.ratio, entries.shape[1])), None
            # The attention kernel reads FP4 entries; FP8 entries take the gathered reference path.
            if picks is not None and (not quantised or self.kernel_impl("attention") == "reference" or banded
                                      or self.main_kv != quant.FP4_E4M3_16):
                sel = dequant_entries(store.gather("entries", picks), store.gather("entry_scales", picks))
                sel, sel_ok = sel.astype(kv.dtype), picks >= 0
        with jax.named_scope("attend"):
            if (sel is not None or shared is not None or not quantised or self.kernel_impl("attention") == "reference"
                    or banded):
                out = attend_step(q, keys_w, mask_w, sel, sel_ok, self.attn_sink[...], self.head_dim ** -0.5, shared)
            else:  # the Pallas kernel reads the window's bytes themselves (above) and the picked entries
                out = self._attend_kernel(q, win_vals, win_scales, mask_w, picks, stores)
        with jax.named_scope("output"):
            return self.output(out, positions_BS), ring, stores, handoff

    def window_fake_quant(self, kv_BSK):
        """The window KV as the ring stores it, read back (the forward's `quant: qat`): FP8, UE8M0 per 32."""
        return quant.fake_quant(kv_BSK, quant.FP8_UE8M0_32)

    def encode_window(self, kv_BSK):
        """(value bytes [B,S,K], scale bytes [B,S,K/32]) of new window rows in the packed ring's format."""
        values, scales = quant.quantize_fp8_ue8m0_32(kv_BSK)
        return quant.to_bytes(values), quant.to_bytes(scales)

    def decode_window(self, values, scales):
        """Packed window rows (`encode_window`'s) -> float32 [..., K]."""
        return dequant_window(values, scales)

    def cached_compressed(self, x_BSD, qr_BSQ, positions_BS, lengths_B, counts_B, published, stores,
                          entries_ready=False):
        """`step`'s compressed branch (V4.1; V4 compat has its own): a Full layer writes
        its new entries and indexer keys, an index source picks. Returns ((None, None, None, picks [B,S,k]),
        stores, handoff): the entries to attend are the picks of the layer's index source, read from the
        store of its kv source."""
        stores, handoff = self._publish_cached(x_BSD, qr_BSQ, positions_BS, lengths_B, counts_B, published, stores,
                                               entries_ready)
        picks = (handoff if handoff is not None else published[self.record.index_source]).picks
        return (None, None, None, picks), stores, handoff

    def _publish_cached(self, x_BSD, qr_BSQ, positions_BS, lengths_B, counts_B, published, stores, entries_ready=False):
        """(stores with a Full layer's new entries written, the Handoff of an index source or None)."""
        rec = self.record
        if rec.stores_entries and not entries_ready:
            with jax.named_scope("compressor"):
                stores = {**stores, rec.index: self.write_entries(x_BSD, lengths_B, counts_B, stores[rec.index])}
        if self.indexer is None:
            return stores, None
        with jax.named_scope("indexer"):
            return stores, self._select_cached(x_BSD, qr_BSQ, positions_BS, published, stores[rec.kv_source])

    def write_entries(self, x_BSD, lengths_B, counts_B, store: LayerStore) -> LayerStore:
        """A Full layer's compressor over the new tokens: its store with the completed entries and indexer
        keys written."""
        rec = self.record
        cinv = np.asarray(self.compressed_inv_freq, np.float32)
        latent, entry, done, leftover = self.compressor.step(x_BSD, lengths_B, counts_B, store.get("leftover"))
        pos = rec.ratio * entry
        entries, keys = apply_rope(latent, pos, cinv), self.indexer.keys(latent, pos, cinv, fake_quant=False)
        store = store.put("leftover", leftover)
        if not packed(store.leaves["entries"]):  # the float cache: the values themselves, no scales
            return store.write("entries", entries, entry, done).write("index_keys", keys, entry, done)
        vals, scales = kv_store.quant_entries(entries, self.main_kv)
        kvals, kscales = kv_store.quant_keys(keys)
        return (store.write("entries", vals, entry, done)
                .write("entry_scales", scales, entry, done)
                .write("index_keys", kvals, entry, done)
                .write("index_scales", kscales, entry, done))

    def _select_cached(self, x_BSD, qr_BSQ, positions_BS, published, store: LayerStore) -> Handoff:
        """An index source's Handoff for the new tokens: its picks (and the candidate pool's block ids, at the
        candidate source), scored against `store`, its kv source's."""
        rec = self.record
        cinv = np.asarray(self.compressed_inv_freq, np.float32)
        b, s, _ = x_BSD.shape
        indexer = self.indexer
        visible_count = (positions_BS + 1) // rec.ratio
        num = store.leaves["index_keys"].shape[-2]
        if self.top_k >= num and not self.builds_pool and rec.candidate_source is None:
            # Top-k of at least every entry picks every visible one, whatever the scores: skip scoring them.
            return Handoff(picks=ix.visible_picks(visible_count, num, self.top_k))
        qI, w = indexer.query(x_BSD, qr_BSQ, positions_BS, cinv, self.fake_quant)
        impl = self.kernel_impl()
        # The kernels read the packed keys; the float cache takes the reference path below.
        if impl != "reference" and packed(store.leaves["index_keys"]) and (rec.candidate_source is None or s == 1):
            args = (qI, w, store.get("index_keys"), store.get("index_scales"))
            layout = self.policy.lowering.layout
            if rec.candidate_source is not None:  # Reindex decode: the pool's keys only
                return Handoff(picks=dispatch.pool_top_k(*args, published[rec.candidate_source].pool_ids,
                                                         self.pool_block_size, positions_BS, rec.ratio, self.top_k,
                                                         mode=impl, layout=layout))
            if self.builds_pool:
                picks, pool_ids = dispatch.scores_and_pool(
                    *args, positions_BS, rec.ratio, top_k=self.top_k, max_blocks=self.pool_max_blocks,
                    block=self.pool_block_size, mode=impl, layout=layout)
                return Handoff(picks=picks, pool_ids=pool_ids)
            return Handoff(picks=dispatch.indexer_top_k(*args, positions_BS, rec.ratio, self.top_k, mode=impl,
                                                        layout=layout))
        if rec.candidate_source is not None and s == 1:
            # Decode: score only the pool's keys (the Reindex promise, DESIGN §3.4).
            pool_ids = published[rec.candidate_source].pool_ids
            if self.policy.lowering.unroll_layers:  # FLOP counting: static shapes, the pool at once
                scores, entry = ix.pool_gather_scores(qI, w, store, pool_ids, self.pool_block_size, visible_count,
                                                      indexer.unroll)
                return Handoff(picks=ix.pool_top_k(scores, entry, self.top_k))
            # `score_tile` entries of the pool at a time, as `select_blocks` does: a tile's gather and scores
            # compile, not the whole pool's (the decode's largest part at V4.1-Flash's 16,384 candidates).
            return Handoff(picks=ix.pool_chunks_top_k(qI, w, store, pool_ids, self.pool_block_size, visible_count,
                                                      self.top_k, self.score_tile // self.pool_block_size,
                                                      indexer.unroll, rows=self._rows(b)))
        num, tile = store.leaves["index_keys"].shape[-2], self.score_tile
        if tile < num and num % self.pool_block_size == 0 and not self.policy.lowering.unroll_layers:
            return self._select_filled(qI, w, positions_BS, visible_count, published, store)
        keys = dequant_keys(store.get("index_keys"), store.get("index_scales"))
        scores = ix.lightning_scores(qI, keys, w, ix.visible_entries(positions_BS, rec.ratio, num), indexer.unroll)
        rows = self._rows(b)  # on a mesh, each device's rows' top-k (a plain one gathers every row's scores)
        pick = jax.lax.top_k if rows is None else rows.top_k
        pool_ids = None
        if self.builds_pool:
            pool_ids = ix.candidate_block_ids(scores, visible_count, self.pool_max_blocks, self.pool_block_size, pick)
        if rec.candidate_source is not None:
            pool = published[rec.candidate_source].pool_ids
            in_pool = ix.blocks_to_entries(ix.block_ids_to_mask(pool, -(-num // self.pool_block_size)),
                                           self.pool_block_size, num)
            scores = jnp.where(in_pool, scores, NEG_INF)
        return Handoff(picks=ix.top_k_indices(scores, self.top_k, pick), pool_ids=pool_ids)

    def _select_filled(self, qI_BSJd, w_BSJ, positions_BS, visible_count_BS, published, store) -> Handoff:
        """`_select`'s scores, pool and top-k over the store's filled tiles only (`indexer.filled_top_k`): the
        same picks, at a cost that follows the rows' lengths rather than the cache's capacity. (The FLOP
        counting lowering scores the whole capacity: static shapes, which XLA's cost analysis counts.)"""
        rec, tile = self.record, self.score_tile
        num = store.leaves["index_keys"].shape[-2]
        pool_ids = None if rec.candidate_source is None else published[rec.candidate_source].pool_ids
        if pool_ids is not None:  # ascending block ids, then −1s: searchable once the −1s sort last
            pool_sorted = jnp.where(pool_ids < 0, jnp.iinfo(jnp.int32).max, pool_ids)
            search = jax.vmap(jax.vmap(lambda p, x: jnp.searchsorted(p, x)))

        def tile_scores(start):
            keys = dequant_keys(store.tile("index_keys", start, tile), store.tile("index_scales", start, tile))
            entry = start + jnp.arange(tile)
            visible = entry < visible_count_BS[..., None]
            scores = ix.lightning_scores(qI_BSJd, keys, w_BSJ, visible, self.indexer.unroll)
            if pool_ids is None:
                return scores
            blocks = jnp.broadcast_to(start // self.pool_block_size + jnp.arange(tile // self.pool_block_size),
                                      (*pool_ids.shape[:2], tile // self.pool_block_size))
            at = jnp.minimum(search(pool_sorted, blocks), pool_ids.shape[-1] - 1)
            kept = jnp.take_along_axis(pool_sorted, at, -1) == blocks
            return jnp.where(jnp.repeat(kept, self.pool_block_size, axis=-1), scores, NEG_INF)

        pool = (self.pool_max_blocks, self.pool_block_size, visible_count_BS) if self.builds_pool else None
        picks, pool_out = ix.filled_top_k(tile_scores, positions_BS.shape, num, tile, jnp.max(visible_count_BS),
                                          self.top_k, pool, rows=self._rows(positions_BS.shape[0]))
        return Handoff(picks=picks, pool_ids=pool_out)

    def _rows(self, b: int) -> ix.RowSplit | None:
        """On a mesh (`Lowering.layout`), the split of the step's B token rows over the layout's token axes
        (None: one device, the rows' tokens split too, or B rows that do not split evenly)."""
        layout = self.policy.lowering.layout
        if layout is None or not layout.token_axes or layout.seq_axes:
            return None
        if b % math.prod(layout.mesh.shape[a] for a in layout.token_axes):
            return None
        return ix.RowSplit(layout.mesh, layout.token_axes)

    def training_kernel(self) -> str | None:
        """The kernel implementation the blockwise whole-sequence (training) forward — a sequence longer than
        `query_block` — selects with, or None for its XLA path: the Pallas kernels read the cache's formats, so they
        serve only where the forward's values are those formats (`quant: qat`) and not for FLOP counting (under
        `Lowering.sequence` each lane's blocks run them on the devices holding the lane: `over_query_blocks`). This
        is the indexer kernels'; `attention_kernel` the chunk kernel's."""
        return self._training_kernel("indexer")

    def _training_kernel(self, kind: str) -> str | None:
        impl = self.kernel_impl(kind)
        lowering = self.policy.lowering
        if impl == "reference" or not self.fake_quant or lowering.unroll_layers:
            return None
        return impl

    def attention_kernel(self) -> str | None:
        """`training_kernel` for the chunk kernel, where it can read this layer's entries (FP4; it reads no FP8
        entries)."""
        return self._training_kernel("attention") if self.main_kv == quant.FP4_E4M3_16 else None

    def kernel_impl(self, kind: str = "indexer") -> str:
        """What `runtime.kernels` selects on this backend for the kernels of `kind` (`dispatch.KINDS`): 'pallas',
        'pallas_interpret' or 'reference'."""
        return dispatch.resolve(self.kernels, dispatch.platform(self.policy.lowering.layout), kind)

    def _attend_kernel(self, q_BSHK, values_BTK, scales_BTX, mask_w, picks_BSk, stores):
        """`attend_step` through the sparse-attention kernel: the window keys as stored bytes (values and scales
        [B, T, ·]: the ring, then a chunk's new tokens; `mask_w` [B, S, T] says which each query sees) and the
        picked entries read from the layer's packed store (a window-only layer passes no picks)."""
        b, s, _, k = q_BSHK.shape
        if picks_BSk is None:
            entries, entry_scales = jnp.zeros((b, 1, k // 2), jnp.uint8), jnp.zeros((b, 1, k // 16), jnp.uint8)
            picks_BSk = jnp.full((b, s, 1), -1, jnp.int32)
        else:
            store = stores[self.record.kv_source]
            entries, entry_scales = store.get("entries"), store.get("entry_scales")  # the kernel reads words too
        return dispatch.sparse_attention_chunk(q_BSHK, values_BTK, scales_BTX, mask_w, entries, entry_scales, picks_BSk,
                                               self.attn_sink[...], self.head_dim ** -0.5,
                                               mode=self.kernel_impl("attention"),
                                               layout=self.policy.lowering.layout)
