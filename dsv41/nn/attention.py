"""The attention layer of every V4.1 layer (DESIGN §3.2), full-sequence form.

qr = q_norm(wq_a x); q = rope(wq_b qr) [B,S,H,K]; kv = fp8(rope(kv_norm(wkv x))) [B,S,K], the single
shared latent used as key and value. One softmax with a per-head sink (denominator only) runs over
the window keys (t-window+1 … t) and the entries selected for the query; the output's RoPE dims are
rotated back at the query position, then projected by the grouped wo_a (block-diagonal over
o_groups) and wo_b. Full layers own a compressor (and indexer keys); Full and Reindex layers own an
indexer query; Reuse layers read what their sources published. V4 (compat): `AttentionV4` below, with
the per-head query RMSNorm V4 had (`architecture.q_head_norm`).
`window_keys` and `attend_step` are the same softmax over what the inference cache holds (the window ring
and the new tokens, each query's picked entries), as `attention_cache` and the kernels' references run it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41 import quant
from dsv41.nn import indexer as ix
from dsv41.nn.compressor import Compressor, CompressorV4
from dsv41.nn.linear import Dense, param
from dsv41.nn.norm import RMSNorm, rms_normalize
from dsv41.nn.policy import Policy
from dsv41.nn.rope import apply_rope
from dsv41.plan import CSA, FULL, REINDEX, LayerRecord

NEG_INF = -jnp.inf
HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Handoff:
    """What a layer hands the later layers that name it as a source (`LayerRecord.kv_source`,
    `index_source`, `candidate_source`): returned by its attention, passed along keyed by its layer
    number, never mutated. Fields a layer does not produce are None.

    entries [B, T, K], index_keys [B, T, dI]: a compressing layer's rotated entries and indexer keys
    (the whole-sequence form; the cached step's layers read them from the store instead).
    picks [B, S, k]: an index source's top-k entry ids (−1: none); selected [B, S, T]: the same as a mask
    (whole-sequence form). pool_ids [B, S, M]: the candidate source's pool as block ids, ascending then
    −1 (cached step); pool [B, S, T]: the pool as an entry mask (whole-sequence form)."""

    entries: jax.Array | None = None
    index_keys: jax.Array | None = None
    picks: jax.Array | None = None
    selected: jax.Array | None = None
    pool_ids: jax.Array | None = None
    pool: jax.Array | None = None


jax.tree_util.register_dataclass(Handoff, data_fields=[f.name for f in dataclasses.fields(Handoff)],
                                 meta_fields=[])


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

    def __call__(self, x_BSD, positions_BS, published: dict):
        """(attention output [B, S, D], this layer's `Handoff` or None). published: {layer: Handoff} of the
        layers before it."""
        b, s, _ = x_BSD.shape
        rec = self.record
        inv_freq = np.asarray(self.inv_freq, np.float32)
        qr = self.q_norm(self.wq_a(x_BSD))
        q = self.wq_b(qr).reshape(b, s, self.heads, self.head_dim)
        if self.q_head_eps is not None:
            q = rms_normalize(q, self.q_head_eps).astype(q.dtype)
        q = apply_rope(q, positions_BS, inv_freq)
        kv = apply_rope(self.kv_norm(self.wkv(x_BSD)), positions_BS, inv_freq)
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
        out = apply_rope(out, positions_BS, inv_freq, inverse=True)
        grouped = out.reshape(b, s, self.groups, -1)
        y = jnp.einsum("bsgi,gio->bsgo", grouped.astype(self.policy.compute_dtype),
                       self.wo_a[...].astype(self.policy.compute_dtype), precision=self.policy.precision)
        return self.wo_b(y.reshape(b, s, -1)), mine

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


class AttentionV4(Attention):
    """The V4 (compat, DESIGN §4) attention layer: every compressed layer is its own source.

    CSA layers compress with overlap at ratio 4 and attend the top-k entries their own indexer picks;
    HCA layers compress at ratio 128 and attend every visible entry. The window branch, sink, query
    head norm and output path are the shared ones.
    """

    def _build_compressed_branch(self, cfg, builds_pool: bool, policy: Policy, rngs: nnx.Rngs):
        a, record, ixc = cfg.architecture, self.record, cfg.v4.indexer
        self.top_k = ixc.top_k
        self.compressor = (CompressorV4(a.hidden_size, a.head_dim, record.ratio, record.mode == CSA, a.norm_eps,
                                        policy=policy, rngs=rngs)
                           if record.stores_entries else None)
        self.indexer = (ix.IndexerV4(a.hidden_size, a.q_lora_rank, ixc.query_heads, ixc.head_dim, record.ratio,
                                     a.norm_eps, policy=policy, rngs=rngs)
                        if record.mode == CSA else None)

    def _publish(self, x_BSD, qr_BSQ, positions_BS, published: dict) -> Handoff:
        rec = self.record
        cinv = np.asarray(self.compressed_inv_freq, np.float32)
        latent = self.compressor(x_BSD)  # [B, T, K] before RoPE
        entries = apply_rope(latent, ix.entry_positions(latent, rec.ratio), cinv)
        if self.indexer is None:
            return Handoff(entries=entries)
        index_keys = self.indexer.keys(x_BSD, cinv)
        visible = ix.visible_entries(positions_BS, rec.ratio, latent.shape[1])
        scores = self.indexer.scores(x_BSD, qr_BSQ, positions_BS, index_keys, visible, cinv)
        picks = ix.top_k_indices(scores, self.top_k)
        self.sow(nnx.Intermediate, "picks", picks)
        return Handoff(entries=entries, index_keys=index_keys, picks=picks,
                       selected=ix.indices_to_mask(picks, latent.shape[1]))


def window_mask(q_pos_BS, k_pos_BT, window: int):
    """[B, S, T] bool: key position in (q - window, q]."""
    delta = q_pos_BS[..., :, None] - k_pos_BT[..., None, :]
    return (delta >= 0) & (delta < window)


def window_keys(keys_BTK, key_pos_BT, key_ok_BT, positions_BS, window: int):
    """The window keys of S queries and their mask, from [ring (W) | new tokens (S)].

    S < 2W: every query against all W + S keys ([B, W+S, K], mask [B, S, W+S]). Longer chunks are
    banded: the queries of block n (W of them) only reach keys n·W … n·W + 2W − 1 of that list, so the
    keys come as blocks [B, n, 2W, K] with a mask [B, n·W, 2W] — the cost grows as S·W, not S²."""
    s = positions_BS.shape[1]
    if s < 2 * window:
        delta = positions_BS[:, :, None] - key_pos_BT[:, None, :]
        return keys_BTK, key_ok_BT[:, None, :] & (delta >= 0) & (delta < window)
    nb = -(-s // window)
    pad = window + nb * window - keys_BTK.shape[1]
    keys = jnp.pad(keys_BTK, [(0, 0), (0, pad), (0, 0)])
    pos = jnp.pad(key_pos_BT, [(0, 0), (0, pad)], constant_values=-1)
    ok = jnp.pad(key_ok_BT, [(0, 0), (0, pad)])

    def blocks(x):
        lo = x[:, : nb * window].reshape(x.shape[0], nb, window, *x.shape[2:])
        hi = x[:, window: window + nb * window].reshape(x.shape[0], nb, window, *x.shape[2:])
        return jnp.concatenate([lo, hi], axis=2)

    qpos = jnp.pad(positions_BS, [(0, 0), (0, nb * window - s)], constant_values=-1).reshape(-1, nb, window)
    delta = qpos[..., None] - blocks(pos)[:, :, None, :]
    mask = blocks(ok)[:, :, None, :] & (delta >= 0) & (delta < window)
    return blocks(keys), mask.reshape(mask.shape[0], nb * window, 2 * window)


def attend_step(q_BSHK, keys_w, mask_w, sel_BSkK, sel_ok_BSk, sink_H, scale: float, shared=None):
    """One softmax with the sink over the window keys (shared by the chunk, or banded blocks from
    `window_keys`), each query's own selected entries and, when given, `shared` = (keys [B, T, K],
    mask [B, S, T]) that every query of the row may see (a V4 HCA layer's entries); a row with nothing
    valid gives 0."""
    b, s, h, k = q_BSHK.shape
    banded = keys_w.ndim == 4
    if banded:
        nb, span = keys_w.shape[1], keys_w.shape[2]
        qb = jnp.pad(q_BSHK, [(0, 0), (0, nb * (span // 2) - s), (0, 0), (0, 0)]).reshape(b, nb, span // 2, h, k)
        logits = jnp.einsum("bnqhk,bntk->bhnqt", qb, keys_w, preferred_element_type=jnp.float32, precision=HI)
        logits = logits.reshape(b, h, nb * (span // 2), span)[:, :, :s] * scale
        mask_BST = mask_w[:, :s]
    else:
        logits = jnp.einsum("bshk,btk->bhst", q_BSHK, keys_w, preferred_element_type=jnp.float32, precision=HI) * scale
        mask_BST = mask_w
    parts = [jnp.where(mask_BST[:, None], logits, NEG_INF)]
    if sel_BSkK is not None:
        lc = jnp.einsum("bshk,bsjk->bhsj", q_BSHK, sel_BSkK, preferred_element_type=jnp.float32, precision=HI) * scale
        parts.append(jnp.where(sel_ok_BSk[:, None], lc, NEG_INF))
    if shared is not None:
        keys_s, mask_s = shared
        ls = jnp.einsum("bshk,btk->bhst", q_BSHK, keys_s, preferred_element_type=jnp.float32, precision=HI) * scale
        parts.append(jnp.where(mask_s[:, None], ls, NEG_INF))
    sink = jnp.broadcast_to(sink_H.astype(jnp.float32)[None, :, None, None], (*logits.shape[:-1], 1))
    combined = jnp.concatenate(parts + [sink], axis=-1)
    combined = combined - jnp.max(combined, axis=-1, keepdims=True)
    probs = jax.nn.softmax(combined, axis=-1)
    t = logits.shape[-1]
    if banded:
        p = jnp.pad(probs[..., :t], [(0, 0), (0, 0), (0, nb * (span // 2) - s), (0, 0)])
        p = p.reshape(b, h, nb, span // 2, span).astype(keys_w.dtype)
        out = jnp.einsum("bhnqt,bntk->bnqhk", p, keys_w, precision=HI).reshape(b, nb * (span // 2), h, k)[:, :s]
    else:
        out = jnp.einsum("bhst,btk->bshk", probs[..., :t].astype(keys_w.dtype), keys_w, precision=HI)
    if sel_BSkK is not None:
        k = sel_BSkK.shape[2]
        out = out + jnp.einsum("bhsj,bsjk->bshk", probs[..., t:t + k].astype(sel_BSkK.dtype), sel_BSkK, precision=HI)
        t += k
    if shared is not None:
        out = out + jnp.einsum("bhst,btk->bshk", probs[..., t:-1].astype(keys_s.dtype), keys_s, precision=HI)
    return out
