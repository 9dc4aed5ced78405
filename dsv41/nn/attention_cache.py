"""The V4.1 attention layer over the inference cache (DESIGN §3.2–§3.4, §6): S new tokens per row.

The same mechanism as `attention.Attention` (its `step` method), reading and writing the stored formats instead of
recomputing the whole sequence: the FP8 window ring holds the last `window` tokens of the layer; a
Full layer folds its compressor's unfinished group (the leftovers) into the new tokens, writes the
completed entries (FP4 + E4M3 per 16) and indexer keys (MXFP4) into its store and scores the
queries against every visible key; a Reindex layer scores only the keys of the candidate pool,
gathered from the store, so its cost per query does not grow with the context; the attention
gathers each query's selected entries and runs one softmax with the sink over [window | selected].
Rows may hold different lengths and bring different numbers of new tokens (`valid_BS`).
The float cache (`quant: none`, and V4 compat) stores the values themselves: nothing is quantised on
the way in, the dequantisers pass floats through, and the XLA reference paths run (the Pallas kernels
read the packed bytes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import quant
from dsv41.kernels import dispatch
from dsv41.kv_store import LayerStore, dequant_entries, dequant_keys, dequant_window, packed, ring_positions
from dsv41.nn import indexer as ix
from dsv41.nn.attend import NEG_INF, Handoff, attend_step, window_keys
from dsv41.nn.indexer import pool_gather_scores
from dsv41.nn.rope import apply_rope

HI = jax.lax.Precision.HIGHEST


def compress_step(comp, x_BSD, lengths_B, counts_B, leftover_BRC):
    """Latents of the groups completed by this call, folding in the leftover tokens.

    A group of `ratio` tokens gives one entry. An overlapped compressor (V4 CSA) also pools the
    previous group into entry i, through the first half of its channels (Ca of group i−1, Cb of group i;
    group −1 gets no weight), and V4's compressors add a learned bias per slot to the gate. The leftover
    holds the fp32 projections (wkv·x | wgate·x + bias) of the tokens from the first one the next entry
    pools up to the last one seen: ratio − 1 tokens, 2·ratio − 1 when overlapped.

    Returns (latent [B, E, K], entry index [B, E], done [B, E], new leftover [B, R, C]).
    """
    m = comp.ratio
    b, s, _ = x_BSD.shape
    if comp.wgate is None:  # ratio 1: every token is its own entry
        positions = lengths_B[:, None] + jnp.arange(s)
        return comp(x_BSD), positions, jnp.arange(s) < counts_B[:, None], leftover_BRC
    overlap = comp.overlap
    back = m if overlap else 0  # positions an entry pools before its own group
    held = leftover_BRC.shape[1]  # = back + m - 1
    x = x_BSD.astype(jnp.float32)
    kv = jnp.dot(x, comp.wkv.w[...].astype(jnp.float32), precision=HI)
    gate = jnp.dot(x, comp.wgate.w[...].astype(jnp.float32), precision=HI)
    if comp.position_bias is not None:
        slot = jnp.mod(lengths_B[:, None] + jnp.arange(s), m)
        gate = gate + comp.position_bias[...].astype(jnp.float32)[slot]
    proj = jnp.concatenate([kv, gate], axis=-1)                            # [B, S, 2·width]
    base = lengths_B // m * m - back                                       # position of leftover slot 0
    rows = jnp.arange(b)

    def fetch(pos):  # [B, ...] positions -> their projections (from this chunk or the leftover)
        r = rows.reshape(-1, *([1] * (pos.ndim - 1)))
        lead = (slice(None),) + (None,) * (pos.ndim - 1)
        from_chunk = proj[r, jnp.clip(pos - lengths_B[lead], 0, s - 1)]
        from_left = leftover_BRC[r, jnp.clip(pos - base[lead], 0, held - 1)]
        return jnp.where((pos >= lengths_B[lead])[..., None], from_chunk, from_left)

    e_max = (s + m - 1) // m
    new_len = lengths_B + counts_B
    entry = lengths_B[:, None] // m + jnp.arange(e_max)                   # [B, E]
    done = (entry + 1) * m <= new_len[:, None]
    member = m * entry[..., None] - back + jnp.arange(back + m)            # [B, E, M] positions
    kv, gate = jnp.split(fetch(member), 2, axis=-1)
    if overlap:
        first = (jnp.arange(back + m) < m)[:, None]
        k = kv.shape[-1] // 2
        kv = jnp.where(first, kv[..., :k], kv[..., k:])
        gate = jnp.where(first, gate[..., :k], gate[..., k:])
    exists = (member >= 0)[..., None]
    kv, gate = jnp.where(exists, kv, 0.0), jnp.where(exists, gate, NEG_INF)
    latent = comp.norm(jnp.sum(kv * jax.nn.softmax(gate, axis=2), axis=2).astype(x_BSD.dtype))
    pos = (new_len // m * m - back)[:, None] + jnp.arange(held)            # the new leftover's positions
    keep = ((pos >= 0) & (pos < new_len[:, None]))[..., None]
    return latent, entry, done, jnp.where(keep, fetch(pos), 0.0)


def attention_step(attn, x_BSD, positions_BS, valid_BS, lengths_B, ring: LayerStore, window_start_B,
                   published: dict, stores: dict, entries_ready: bool = False):
    """One layer over the cache. `ring`: this layer's window ring, leaves "values" [B,W,K] and "scales"
    [B,W,K/32] (`kv_store.LayerStore`), holding positions >= window_start (FP8 bytes; the float cache:
    floats and no scales); `stores` maps the layers that own a compressor (as the layer's record names
    them) to their `LayerStore` of `CompressedKV` leaves; published: {layer: Handoff} of the layers before
    it; `entries_ready`: the compressor already wrote these tokens' entries (a CED replay).
    Returns (y [B,S,D], (ring, stores, handoff)): the new ring, `stores` with this layer's store updated
    (a new dict), and what it hands on (its picks and pool ids) or None."""
    rec = attn.record
    b, s, _ = x_BSD.shape
    counts = valid_BS.sum(-1).astype(jnp.int32)
    new_len = lengths_B + counts
    qr, q, kv = attn.project(x_BSD, positions_BS)
    quantised = packed(ring.leaves["values"])
    if quantised:  # the FP8 ring (V4.1)
        kv_vals, kv_scales = quant.quantize_fp8_ue8m0_32(kv)
        kv = quant.dequantize_fp8_ue8m0_32(kv_vals, kv_scales).astype(x_BSD.dtype)
        kv_vals, kv_scales = quant.to_bytes(kv_vals), quant.to_bytes(kv_scales)
    else:
        kv_vals, kv_scales = kv, jnp.zeros((b, s, 0), jnp.uint8)
    keep = valid_BS & (positions_BS >= new_len[:, None] - attn.window)
    slot = positions_BS % attn.window

    def write(ring):
        return ring.write("values", kv_vals, slot, keep).write("scales", kv_scales, slot, keep)

    # Window keys. Decode (one new token): it takes the slot of the one position that leaves its window,
    # so the ring is written first and read once as it then is (reading the old ring beside the write made
    # XLA copy the whole ring for every layer). A chunk: the ring before it, then the new tokens.
    if s == 1:
        ring = write(ring)
        win_vals, win_scales = ring.get("values"), ring.get("scales")
        key_pos = ring_positions(new_len, attn.window)
        key_ok = key_pos >= jnp.maximum(window_start_B, 0)[:, None]
        keys_w = (dequant_window(win_vals, win_scales) if quantised else win_vals).astype(kv.dtype)
    else:
        ring_vals, ring_scales = ring.get("values"), ring.get("scales")
        ring_keys = (dequant_window(ring_vals, ring_scales) if quantised else ring_vals).astype(kv.dtype)
        ring_pos = ring_positions(lengths_B, attn.window)
        win_vals = jnp.concatenate([ring_vals, kv_vals], axis=1)
        win_scales = jnp.concatenate([ring_scales, kv_scales], axis=1)
        keys_w = jnp.concatenate([ring_keys, kv], axis=1)
        key_pos = jnp.concatenate([ring_pos, positions_BS], axis=1)
        key_ok = jnp.concatenate([ring_pos >= jnp.maximum(window_start_B, 0)[:, None], valid_BS], axis=1)
        ring = write(ring)
    keys_w, mask_w = window_keys(keys_w, key_pos, key_ok, positions_BS, attn.window)

    sel = sel_ok = shared = picks = handoff = None
    banded = keys_w.ndim == 4
    if rec.ratio:  # the compressed branch: the layer's own (V4.1 `compressed_v41`, V4 `attention_v4`)
        (sel, sel_ok, shared, picks), stores, handoff = attn.cached_compressed(
            x_BSD, qr, positions_BS, lengths_B, counts, published, stores, entries_ready)
        if picks is not None and (not quantised or kernel_impl(attn) == "reference" or banded):
            store = stores[rec.kv_source]
            sel = dequant_entries(store.gather("entries", picks), store.gather("entry_scales", picks))
            sel, sel_ok = sel.astype(kv.dtype), picks >= 0
    if sel is not None or shared is not None or not quantised or kernel_impl(attn) == "reference" or banded:
        out = attend_step(q, keys_w, mask_w, sel, sel_ok, attn.attn_sink[...], attn.head_dim ** -0.5, shared)
    else:  # the Pallas kernel reads the window's bytes themselves (above) and the picked entries
        out = _attend_kernel(attn, q, win_vals, win_scales, mask_w, picks, stores)
    return attn.output(out, positions_BS), (ring, stores, handoff)


def compressed_v41(attn, x_BSD, qr_BSQ, positions_BS, lengths_B, counts_B, published, stores,
                   entries_ready=False):
    """A V4.1 layer's compressed branch over the cache (`Attention.cached_compressed`): a Full layer writes
    its new entries and indexer keys, an index source picks. Returns ((None, None, None, picks [B,S,k]),
    stores, handoff): the entries to attend are the picks of the layer's index source, read from the
    store of its kv source."""
    stores, handoff = _publish_step(attn, x_BSD, qr_BSQ, positions_BS, lengths_B, counts_B, published, stores,
                                    entries_ready)
    picks = (handoff if handoff is not None else published[attn.record.index_source]).picks
    return (None, None, None, picks), stores, handoff


def _publish_step(attn, x_BSD, qr_BSQ, positions_BS, lengths_B, counts_B, published, stores, entries_ready=False):
    """(stores with a Full layer's new entries written, the Handoff of an index source or None)."""
    rec = attn.record
    if rec.stores_entries and not entries_ready:
        stores = {**stores, rec.index: write_entries(attn, x_BSD, lengths_B, counts_B, stores[rec.index])}
    if attn.indexer is None:
        return stores, None
    return stores, _select(attn, x_BSD, qr_BSQ, positions_BS, published, stores[rec.kv_source])


def write_entries(attn, x_BSD, lengths_B, counts_B, store: LayerStore) -> LayerStore:
    """A Full layer's compressor over the new tokens: its store with the completed entries and indexer
    keys written."""
    rec = attn.record
    cinv = np.asarray(attn.compressed_inv_freq, np.float32)
    latent, entry, done, leftover = compress_step(attn.compressor, x_BSD, lengths_B, counts_B, store.get("leftover"))
    pos = rec.ratio * entry
    entries, keys = apply_rope(latent, pos, cinv), attn.indexer.keys(latent, pos, cinv, fake_quant=False)
    store = store.put("leftover", leftover)
    if not packed(store.leaves["entries"]):  # the float cache: the values themselves, no scales
        return store.write("entries", entries, entry, done).write("index_keys", keys, entry, done)
    vals, scales = quant.quantize_fp4_e4m3_16(entries)
    kvals, kscales = quant.quantize_mxfp4(keys)
    return (store.write("entries", quant.pack_fp4(vals), entry, done)
            .write("entry_scales", quant.to_bytes(scales), entry, done)
            .write("index_keys", quant.pack_fp4(kvals), entry, done)
            .write("index_scales", quant.to_bytes(kscales), entry, done))


def _select(attn, x_BSD, qr_BSQ, positions_BS, published, store: LayerStore) -> Handoff:
    """An index source's Handoff for the new tokens: its picks (and the candidate pool's block ids, at the
    candidate source), scored against `store`, its kv source's."""
    rec = attn.record
    cinv = np.asarray(attn.compressed_inv_freq, np.float32)
    b, s, _ = x_BSD.shape
    indexer = attn.indexer
    qI = apply_rope(indexer.wq_b(qr_BSQ).reshape(b, s, indexer.heads, indexer.head_dim), positions_BS, cinv)
    if attn.fake_quant:  # as the teacher-forced indexer (`Indexer.scores`)
        qI = quant.fake_quant(qI, quant.MXFP4)
    w = indexer.weights_proj(x_BSD)
    visible_count = (positions_BS + 1) // rec.ratio
    impl = kernel_impl(attn)
    # The kernels read the packed keys; the float cache takes the reference path below.
    if impl != "reference" and packed(store.leaves["index_keys"]) and (rec.candidate_source is None or s == 1):
        args = (qI, w, store.get("index_keys"), store.get("index_scales"))
        layout = attn.policy.lowering.layout
        if rec.candidate_source is not None:  # Reindex decode: the pool's keys only
            return Handoff(picks=dispatch.pool_top_k(*args, published[rec.candidate_source].pool_ids,
                                                     attn.pool_block_size, positions_BS, rec.ratio, attn.top_k,
                                                     mode=impl, layout=layout))
        if attn.builds_pool:
            picks, pool_ids = dispatch.scores_and_pool(
                *args, positions_BS, rec.ratio, top_k=attn.top_k, max_blocks=attn.pool_max_blocks,
                block=attn.pool_block_size, mode=impl, layout=layout)
            return Handoff(picks=picks, pool_ids=pool_ids)
        return Handoff(picks=dispatch.indexer_top_k(*args, positions_BS, rec.ratio, attn.top_k, mode=impl,
                                                    layout=layout))
    if rec.candidate_source is not None and s == 1:
        # Decode: score only the pool's keys (the Reindex promise, DESIGN §3.4).
        pool_ids = published[rec.candidate_source].pool_ids
        scores, entry = pool_gather_scores(qI, w, store, pool_ids, attn.pool_block_size, visible_count,
                                           indexer.unroll)
        local = ix.top_k_indices(scores, attn.top_k)
        picks = jnp.where(local >= 0, jnp.take_along_axis(entry, jnp.maximum(local, 0), axis=-1), -1)
        picks = jnp.sort(jnp.where(picks < 0, jnp.iinfo(jnp.int32).max, picks), axis=-1)
        return Handoff(picks=jnp.where(picks == jnp.iinfo(jnp.int32).max, -1, picks))
    num, tile = store.leaves["index_keys"].shape[-2], attn.score_tile
    if tile < num and num % attn.pool_block_size == 0 and not attn.policy.lowering.unroll_layers:
        return _select_filled(attn, qI, w, positions_BS, visible_count, published, store)
    keys = dequant_keys(store.get("index_keys"), store.get("index_scales"))
    scores = ix.lightning_scores(qI, keys, w, ix.visible_entries(positions_BS, rec.ratio, num), indexer.unroll)
    pool_ids = None
    if attn.builds_pool:
        pool_ids = ix.candidate_block_ids(scores, visible_count, attn.pool_max_blocks, attn.pool_block_size)
    if rec.candidate_source is not None:
        pool = published[rec.candidate_source].pool_ids
        in_pool = ix.blocks_to_entries(ix.block_ids_to_mask(pool, -(-num // attn.pool_block_size)),
                                       attn.pool_block_size, num)
        scores = jnp.where(in_pool, scores, NEG_INF)
    return Handoff(picks=ix.top_k_indices(scores, attn.top_k), pool_ids=pool_ids)


def _select_filled(attn, qI_BSJd, w_BSJ, positions_BS, visible_count_BS, published, store) -> Handoff:
    """`_select`'s scores, pool and top-k over the store's filled tiles only (`indexer.filled_top_k`): the
    same picks, at a cost that follows the rows' lengths rather than the cache's capacity. (The FLOP
    counting lowering scores the whole capacity: static shapes, which XLA's cost analysis counts.)"""
    rec, tile = attn.record, attn.score_tile
    num = store.leaves["index_keys"].shape[-2]
    pool_ids = None if rec.candidate_source is None else published[rec.candidate_source].pool_ids
    if pool_ids is not None:  # ascending block ids, then −1s: searchable once the −1s sort last
        pool_sorted = jnp.where(pool_ids < 0, jnp.iinfo(jnp.int32).max, pool_ids)
        search = jax.vmap(jax.vmap(lambda p, x: jnp.searchsorted(p, x)))

    def tile_scores(start):
        keys = dequant_keys(store.tile("index_keys", start, tile), store.tile("index_scales", start, tile))
        entry = start + jnp.arange(tile)
        visible = entry < visible_count_BS[..., None]
        scores = ix.lightning_scores(qI_BSJd, keys, w_BSJ, visible, attn.indexer.unroll)
        if pool_ids is None:
            return scores
        blocks = jnp.broadcast_to(start // attn.pool_block_size + jnp.arange(tile // attn.pool_block_size),
                                  (*pool_ids.shape[:2], tile // attn.pool_block_size))
        at = jnp.minimum(search(pool_sorted, blocks), pool_ids.shape[-1] - 1)
        kept = jnp.take_along_axis(pool_sorted, at, -1) == blocks
        return jnp.where(jnp.repeat(kept, attn.pool_block_size, axis=-1), scores, NEG_INF)

    pool = (attn.pool_max_blocks, attn.pool_block_size, visible_count_BS) if attn.builds_pool else None
    picks, pool_out = ix.filled_top_k(tile_scores, positions_BS.shape, num, tile, jnp.max(visible_count_BS),
                                      attn.top_k, pool)
    return Handoff(picks=picks, pool_ids=pool_out)


def kernel_impl(attn) -> str:
    """What `runtime.kernels` selects on this backend: 'pallas', 'pallas_interpret' or 'reference'."""
    return dispatch.resolve(attn.kernels, dispatch.platform(attn.policy.lowering.layout))


def _attend_kernel(attn, q_BSHK, values_BTK, scales_BTX, mask_w, picks_BSk, stores):
    """`attend_step` through the sparse-attention kernel: the window keys as stored bytes (values and scales
    [B, T, ·]: the ring, then a chunk's new tokens; `mask_w` [B, S, T] says which each query sees) and the
    picked entries read from the layer's packed store (a window-only layer passes no picks)."""
    b, s, _, k = q_BSHK.shape
    if picks_BSk is None:
        entries, entry_scales = jnp.zeros((b, 1, k // 2), jnp.uint8), jnp.zeros((b, 1, k // 16), jnp.uint8)
        picks_BSk = jnp.full((b, s, 1), -1, jnp.int32)
    else:
        store = stores[attn.record.kv_source]
        entries, entry_scales = store.get("entries"), store.get("entry_scales")
    return dispatch.sparse_attention_chunk(q_BSHK, values_BTK, scales_BTX, mask_w, entries, entry_scales, picks_BSk,
                                           attn.attn_sink[...], attn.head_dim ** -0.5, mode=kernel_impl(attn),
                                           layout=attn.policy.lowering.layout)
