"""The hierarchical candidate pool as Pallas kernels (DESIGN §3.4, §8): built while scoring, scored gathered.

Candidate source (layer 20, m = 1): block score = max of I over `block` consecutive entries, the block of
the newest visible entry always kept, the best `max_blocks` blocks, ascending, −1 padded
(`indexer.candidate_block_ids`). `scores_and_pool` gets the block maxima from the scoring kernel itself
(indexer_scores.py, `pool_block`): the [B, S, T] scores are read once, by the top-k, and the pool's
selection runs in XLA over T / block maxima (a top-2048 over 131072 block scores at 1M context).

Reindex layers (24/28/32/36): `pool_scores` scores only the pool's keys, gathered from the packed store
by block id (`indexer.pool_gather_scores` semantics: [B, S, n·block] scores, −inf where the
block is −1 or the entry is not yet visible, with their entry ids), so a Reindex query costs n·block
keys whatever the context. `pool_top_k` is then the reference's top-k inside the pool mapped back to
entry ids (ascending, −1 padded), in XLA like the scoring kernel's top-k.

TPU (Mosaic): block ids are scalar-prefetched into SMEM and drive manual async copies, double-buffered
across chunks of `chunk` pool blocks (the next chunk's copies are in flight while this one is scored).
The store is read in XLA's layout for it, T minor (indexer_scores.store_view), where a DMA must cover
whole 128-entry lane tiles: each pool block brings the 128-entry tile holding it (8 KiB of keys for
512 B used at block 8; 17 MiB per query at 2048 blocks against 71 MiB for the whole 1M-entry store),
the kernel scores the tile and XLA keeps the block's `block` lanes. A store whose length is not a multiple of
128 (1,000,000 decoder entries in a 1M-token cache) brings its last, partial tile from a padded copy of that
tile alone (its padding is never visible). A cache layout that keeps a pool
block contiguous (e.g. [B, T/block, block·dI/2]) would cut that 16×; the layout is cache.py's to choose.
GPU (Triton, for the reasons in indexer_scores.py): gather loads of exactly the pool's rows, with the
per-byte scales gathered by index (no where-chain), scores written compact.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pl_triton

from dsv41.kernels import indexer_scores as isc
from dsv41.kv_store import LayerStore
from dsv41.nn import indexer as ix

NEG_INF = float("-inf")
LANES = 128  # a TPU lane tile: the unit of a DMA along the T-minor store


# ------------------------------------------------------------------ candidate source: pool while scoring


def pool_from_block_max(block_max_BSN, visible_BS, max_blocks: int, block: int):
    """[B, S, max_blocks] pool ids from block maxima [B, S, ceil(T / block)] and visible counts [B, S].

    `candidate_block_ids` on blocks of one: its newest-block pin reads (count − 1) // 1, so it is given
    the number of blocks holding a visible entry, ceil(count / block)."""
    return ix.candidate_block_ids(block_max_BSN, -(-visible_BS // block), max_blocks, 1)


def scores_and_pool(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, positions_BS, ratio: int, *,
                    top_k: int, max_blocks: int, block: int, **kw):
    """(picks [B, S, top_k], pool ids [B, S, max_blocks]) of the candidate source, one pass over the store.

    `kw`: backend, interpret, tile sizes, as `indexer_scores`."""
    scores, block_max = isc.indexer_scores(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, positions_BS,
                                           ratio, pool_block=block, **kw)
    visible = (positions_BS + 1) // ratio
    return ix.top_k_indices(scores, top_k), pool_from_block_max(block_max, visible, max_blocks, block)


def scores_and_pool_reference(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, positions_BS, ratio: int, *,
                              top_k: int, max_blocks: int, block: int):
    """`Attention._select_cached` at the candidate source: full scores, `candidate_block_ids`, `top_k_indices`."""
    scores = isc.indexer_scores_reference(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, positions_BS, ratio)
    pool = ix.candidate_block_ids(scores, (positions_BS + 1) // ratio, max_blocks, block)
    return ix.top_k_indices(scores, top_k), pool


# ------------------------------------------------------------------ Reindex: scores over the gathered pool


def _tpu_pool_kernel(tiles_ref, keys_hbm, scales_hbm, *refs, n_s: int, n_pad: int, chunk: int, whole: int,
                     tail: bool):
    """One (row b, query s, chunk c): scores [chunk, 128] of the store tiles holding the chunk's blocks. Tiles
    0 … whole − 1 are read from the store; with `tail` (a store whose length is not a multiple of 128) tile
    `whole` from the two tail inputs after the store's, that partial tile padded to 128 entries."""
    tail_keys_hbm, tail_scales_hbm = refs[:2] if tail else (None, None)
    qe_ref, qo_ref, w_ref, out_ref, kbuf, sbuf, sems = refs[2:] if tail else refs
    b, s, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    base = (b * n_s + s) * n_pad
    half = kbuf.shape[2]

    def copies(index, slot, g):
        """(tile, its copies from the store or None, its copies from the padded tail or None)."""
        tile = tiles_ref[base + index * chunk + g]
        stored = padded = None
        if whole:  # the store's own tiles (absent when it is shorter than one tile)
            lanes = pl.ds(pl.multiple_of(jnp.clip(tile, 0, whole - 1) * LANES, LANES), LANES)
            stored = (pltpu.make_async_copy(keys_hbm.at[b, :, lanes], kbuf.at[slot, g], sems.at[0, slot]),
                      pltpu.make_async_copy(scales_hbm.at[b, :, lanes], sbuf.at[slot, g], sems.at[1, slot]))
        if tail_keys_hbm is not None:
            padded = (pltpu.make_async_copy(tail_keys_hbm.at[b], kbuf.at[slot, g], sems.at[0, slot]),
                      pltpu.make_async_copy(tail_scales_hbm.at[b], sbuf.at[slot, g], sems.at[1, slot]))
        return tile, stored, padded

    def each_copy(tile, stored, padded, act):
        """act(copy) for the copies tile needs: none for a −1 block (its lanes are masked in XLA)."""
        if stored is not None:
            @pl.when((tile >= 0) & (tile < whole))
            def _():
                for cp in stored:
                    act(cp)
        if padded is not None:
            @pl.when(tile == whole)
            def _():
                for cp in padded:
                    act(cp)

    def start(index, slot):
        def one(g, carry):
            each_copy(*copies(index, slot, g), lambda cp: cp.start())
            return carry
        lax.fori_loop(0, chunk, one, 0)

    @pl.when(c == 0)
    def _first():
        start(0, 0)

    @pl.when(c + 1 < pl.num_programs(2))
    def _next():
        start(c + 1, (c + 1) % 2)

    slot = c % 2

    def score(g, carry):
        each_copy(*copies(c, slot, g), lambda cp: cp.wait())
        scale = isc.scale_per_byte(lambda i: sbuf[slot, g, pl.ds(i, 1), :].astype(jnp.int32),
                                   (half, LANES), 0)
        k_even, k_odd = isc.dequant_tile(kbuf[slot, g], scale)                 # [dI/2, 128]
        relu = isc.head_logits(k_even, k_odd, qe_ref[...], qo_ref[...], True)     # [J, 128]
        out_ref[pl.ds(g, 1), :] = isc.dot_nn(w_ref[...], relu, lax.Precision.HIGHEST)[0:1]
        return carry
    lax.fori_loop(0, chunk, score, 0)


def _gpu_pool_kernel(ids_ref, keys_ref, scales_ref, qe_ref, qo_ref, w_ref, out_ref, *, block: int):
    """One (row b, query s, chunk): gather the chunk's blocks' rows and score them, [chunk·block]."""
    b = pl.program_id(0)
    ids = ids_ref[...]                                                        # [chunk]
    half = keys_ref.shape[-1]
    rows = (jnp.maximum(ids, 0)[:, None] * block + lax.broadcasted_iota(jnp.int32, (1, block), 1))
    rows = rows.reshape(-1)                                                    # [chunk·block]
    byte_scale = lax.broadcasted_iota(jnp.int32, (1, half), 1) // isc.BYTES_PER_SCALE
    packed = keys_ref[b, rows[:, None], lax.broadcasted_iota(jnp.int32, (1, half), 1)]
    exponent = scales_ref[b, rows[:, None], byte_scale].astype(jnp.int32)
    scale = lax.bitcast_convert_type(exponent << 23, jnp.float32)
    k_even, k_odd = isc.dequant_tile(packed, scale)                           # [chunk·block, dI/2]
    relu = isc.head_logits(k_even, k_odd, qe_ref[...], qo_ref[...], False)       # [chunk·block, J]
    out_ref[...] = jnp.sum(relu * w_ref[0, :][None, :], axis=1)


def pool_scores(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, block_ids_BSn, block: int, positions_BS,
                ratio: int, *, backend: str = "tpu", interpret: bool = False, chunk: int | None = None):
    """Reindex scores over the pool's keys only: (scores [B, S, n·block] fp32, entry ids [B, S, n·block]).

    block_ids int32 [B, S, n] (−1 = none), the rest as `indexer_scores`. Scores are −inf and ids −1
    where the block is −1 or the entry is not visible to the query."""
    isc.check_backend(backend)
    isc.check_store(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc)
    b, s, j, d = q_BSJd.shape
    t, half = index_keys_BTh.shape[1], d // 2
    if block_ids_BSn.ndim != 3 or block_ids_BSn.shape[:2] != (b, s):
        raise ValueError(f"block_ids_BSn.shape={block_ids_BSn.shape}: expected [{b}, {s}, n]")
    if backend == "tpu" and LANES % block:
        raise ValueError(f"block={block}: expected a divisor of {LANES} (a pool block within one lane tile)")
    n = block_ids_BSn.shape[-1]
    chunk = chunk or (8 if backend == "tpu" else 16)
    n_chunks = -(-n // chunk)
    n_pad = n_chunks * chunk
    ids = jnp.pad(block_ids_BSn.astype(jnp.int32), [(0, 0), (0, 0), (0, n_pad - n)], constant_values=-1)
    qe, qo = isc.split_query(q_BSJd)                                            # [B, S, J, dI/2]
    w = jnp.pad(isc.head_weights(w_BSJ, d)[:, :, None, :], [(0, 0), (0, 0), (0, 7), (0, 0)])  # [B, S, 8, J]
    visible = (positions_BS.astype(jnp.int32) + 1) // ratio
    entry, ok = ix.pool_entries(block_ids_BSn, block, visible)

    if backend == "tpu":
        per_tile = LANES // block
        tiles = jnp.where(ids >= 0, ids // per_tile, -1)
        keys_view, scales_view = isc.store_view(index_keys_BTh, index_scales_BTc)
        # A DMA covers whole 128-entry tiles: the last tile of a store whose length is not a multiple of 128
        # (a 1M-token cache) comes padded from a copy of that tile alone (its padding is never visible).
        whole, rest = divmod(t, LANES)
        tails = [jnp.pad(v[:, :, whole * LANES:], [(0, 0), (0, 0), (0, LANES - rest)])
                 for v in (keys_view, scales_view)] if rest else []
        any_spec = pl.BlockSpec(memory_space=pl.ANY)
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(b, s, n_chunks),
            in_specs=[any_spec, any_spec, *[any_spec for _ in tails],
                      pl.BlockSpec((None, None, j, half), lambda bi, si, ci, tl: (bi, si, 0, 0)),
                      pl.BlockSpec((None, None, j, half), lambda bi, si, ci, tl: (bi, si, 0, 0)),
                      pl.BlockSpec((None, None, 8, j), lambda bi, si, ci, tl: (bi, si, 0, 0))],
            out_specs=pl.BlockSpec((None, None, chunk, LANES), lambda bi, si, ci, tl: (bi, si, ci, 0)),
            scratch_shapes=[pltpu.VMEM((2, chunk, half, LANES), jnp.uint8),
                            pltpu.VMEM((2, chunk, d // 32, LANES), jnp.uint8),
                            pltpu.SemaphoreType.DMA((2, 2))])
        kernel = functools.partial(_tpu_pool_kernel, n_s=s, n_pad=n_pad, chunk=chunk, whole=whole,
                                   tail=bool(rest))
        bytes_moved, flops = pool_scores_cost(b, s, n, block, j, d, backend="tpu")
        out = pl.pallas_call(
            kernel, grid_spec=grid_spec, interpret=interpret,
            out_shape=jax.ShapeDtypeStruct((b, s, n_pad, LANES), jnp.float32),
            # The chunk axis carries the double buffer from step to step: it must run in order.
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
            cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=bytes_moved),
        )(tiles.reshape(-1), keys_view, scales_view, *tails, qe, qo, w)
        # Keep each block's own `block` lanes of its tile.
        lane = (jnp.maximum(ids[..., :n], 0) % per_tile * block)[..., None] + jnp.arange(block)
        raw = jnp.take_along_axis(out[:, :, :n], lane, axis=-1).reshape(b, s, n * block)
    else:
        kernel = functools.partial(_gpu_pool_kernel, block=block)
        raw = pl.pallas_call(
            kernel, grid=(b, s, n_chunks), interpret=interpret,
            out_shape=jax.ShapeDtypeStruct((b, s, n_pad * block), jnp.float32),
            in_specs=[pl.BlockSpec((None, None, chunk), lambda bi, si, ci: (bi, si, ci)),
                      pl.BlockSpec((b, t, half), lambda bi, si, ci: (0, 0, 0)),
                      pl.BlockSpec((b, t, d // 32), lambda bi, si, ci: (0, 0, 0)),
                      pl.BlockSpec((None, None, j, half), lambda bi, si, ci: (bi, si, 0, 0)),
                      pl.BlockSpec((None, None, j, half), lambda bi, si, ci: (bi, si, 0, 0)),
                      pl.BlockSpec((None, None, 8, j), lambda bi, si, ci: (bi, si, 0, 0))],
            out_specs=pl.BlockSpec((None, None, chunk * block), lambda bi, si, ci: (bi, si, ci)),
            compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
        )(ids, index_keys_BTh, index_scales_BTc, qe, qo, w)[:, :, : n * block]
    return jnp.where(ok, raw, NEG_INF), jnp.where(ok, entry, -1)


def pool_picks(scores_BSP, entry_BSP, k: int):
    """Top-k inside the pool mapped back to entry ids [B, S, k], ascending, −1 padded (as `_select`)."""
    local = ix.top_k_indices(scores_BSP, k)
    picks = jnp.where(local >= 0, jnp.take_along_axis(entry_BSP, jnp.maximum(local, 0), axis=-1), -1)
    picks = jnp.sort(jnp.where(picks < 0, jnp.iinfo(jnp.int32).max, picks), axis=-1)
    return jnp.where(picks == jnp.iinfo(jnp.int32).max, -1, picks)


def pool_top_k(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, block_ids_BSn, block: int, positions_BS,
               ratio: int, k: int, **kw):
    """A Reindex layer's picks [B, S, k]: `pool_scores`, then top-k in XLA. `kw` as `pool_scores`."""
    return pool_picks(*pool_scores(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, block_ids_BSn, block,
                                   positions_BS, ratio, **kw), k)


def pool_scores_reference(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, block_ids_BSn, block: int,
                          positions_BS, ratio: int):
    """`indexer.pool_gather_scores`, with −1 ids where an entry is unusable."""
    # pool_gather_scores reads only the index store of its Full layer.
    store = LayerStore({"index_keys": index_keys_BTh, "index_scales": index_scales_BTc}, None)
    visible = (positions_BS + 1) // ratio
    return ix.pool_gather_scores(q_BSJd, w_BSJ, store, block_ids_BSn, block, visible)


def pool_top_k_reference(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, block_ids_BSn, block: int,
                         positions_BS, ratio: int, k: int):
    return pool_picks(*pool_scores_reference(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, block_ids_BSn,
                                             block, positions_BS, ratio), k)


def pool_scores_cost(batch: int, queries: int, n_blocks: int, block: int, heads: int, head_dim: int,
                     backend: str = "tpu") -> tuple[int, int]:
    """(HBM bytes moved, flops) of one `pool_scores` call with every pool block present.

    TPU fetches and scores the whole 128-entry tile of each block (module docstring) and writes its
    128 scores; GPU reads and scores exactly n·block keys."""
    per_block = LANES if backend == "tpu" else block
    keys = n_blocks * per_block * (head_dim // 2 + head_dim // 32)
    rest = heads * (head_dim * 4 + 4) + n_blocks * 4 + n_blocks * per_block * 4
    flops = 2 * n_blocks * per_block * heads * (head_dim + 1)
    return batch * queries * (keys + rest), batch * queries * flops
