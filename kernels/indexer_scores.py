"""Lightning-indexer scoring over the packed MXFP4 key store, and its top-k (DESIGN §3.4, §3.8, §8).

    I[b, s, t] = Σ_j w[b, s, j]·J^-½ · relu(q[b, s, j] · k[b, t]) · dI^-½,   −inf unless t < (p + 1) // ratio

with k read from the cache's bytes (`CompressedKV.index_keys` uint8 [B, T, dI/2], `index_scales` uint8
[B, T, dI/32]); `indexer_scores_reference` is the plain-JAX path of `Attention._select_cached`.

How the kernels read the store:
- Byte i of a key holds elements 2i (low nibble) and 2i+1 (high nibble), both under UE8M0 scale i // 16.
  The query is split the same way in XLA (q[..., 0::2], q[..., 1::2]), so q·k = q_even·lo + q_odd·hi and
  no kernel ever interleaves nibbles (a lane shuffle on TPU).
- A key tile is dequantised once and meets all J heads of tS queries in one matmul; on TPU, keys on
  lanes (`store_view`), [tS·J, dI/2] × [dI/2, tT], then the head sum Σ_j w_j·relu(·) is a second,
  block-diagonal matmul [8, tS·J] × [tS·J, tT] that lands the scores lane-dense as [queries, keys].
- Dequantised keys are E2M1 × 2^k, exactly representable in bfloat16: with a bf16 query (the fake-quant
  FP4 query of the model) the MXU's one bf16 pass with fp32 accumulation rounds nothing; an fp32 query
  runs at HIGHEST precision. Only the accumulation order differs from the reference (fp32, ~1e-7).
- Optionally (`pool_block`) the same kernel writes the max of each `pool_block` entries, the candidate
  pool's block score (candidate_pool.py), from the scores it has just masked.

Top-k runs in XLA after the kernel (`top_k_indices`, so the contract — ascending, −1 padded, ties to
the lower index — is the reference's by construction). An exact top-512 out of up to 1M entries needs a
selection across all key tiles; Pallas TPU has no sort, and a bitonic merge in vregs plus a second pass
would save only the fp32 score round trip: 8 B per entry against the 68 B per entry the kernel reads.

TPU (Mosaic): `PrefetchScalarGridSpec` carries per (row, query tile) the number of key tiles holding a
visible entry; the key index maps clamp to the last of them, so a cache filled to 10% of its capacity
fetches 10% of the store (a repeated block index issues no DMA) and the rest writes −inf unread.
GPU: the Triton backend, chosen through `pallas.triton.CompilerParams`. jax 0.10's Mosaic GPU lowers no
plain `dot_general` (matmuls go through `plgpu.wgmma` from swizzled shared memory) and has no scalar
prefetch; Triton lowers this body as written, including the gather loads candidate_pool.py needs. The
GPU body skips compute (and so its lazy loads) for tiles with nothing visible, and sums heads per query
with a lane reduction rather than the TPU's padded matmul (Triton cannot slice a register tensor).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pl_triton

from dsv41 import kv_store
from dsv41.nn import indexer as ix

NEG_INF = float("-inf")
BACKENDS = ("tpu", "gpu")
# The UE8M0 scale covers 32 elements = 16 packed bytes.
BYTES_PER_SCALE = 16
_TILE_T = {"tpu": 1024, "gpu": 128}


# ------------------------------------------------------------------ shared pieces of the kernel bodies


def e2m1_value(code):
    """int32 E2M1 codes (0..15, sign in bit 3) -> float32 values; both zeros decode to +0, as the port's."""
    exponent, mantissa = (code >> 1) & 3, code & 1
    twice = jnp.where(exponent == 0, mantissa, (2 + mantissa) << jnp.maximum(exponent - 1, 0))
    return jnp.where(code >= 8, -twice, twice).astype(jnp.float32) * 0.5


def scale_per_byte(scale_slice, shape: tuple[int, int], axis: int):
    """float32 `shape`: the UE8M0 scale of each packed byte, whose dI/2 bytes run along `axis`.

    `scale_slice(c)` gives scale row/column c as int32 (size 1 along `axis`). A where-chain over the
    dI/32 scales: neither Mosaic nor Triton repeats an array along an axis."""
    half = shape[axis]
    index = lax.broadcasted_iota(jnp.int32, shape, axis)
    exponent = jnp.broadcast_to(scale_slice(half // BYTES_PER_SCALE - 1), shape)
    for c in range(half // BYTES_PER_SCALE - 2, -1, -1):
        exponent = jnp.where(index < BYTES_PER_SCALE * (c + 1), scale_slice(c), exponent)
    # 2^(byte - 127) from the exponent bits: byte 0 gives +0, as quant._pow2 does.
    return lax.bitcast_convert_type(exponent << 23, jnp.float32)


def dequant_tile(packed, scale):
    """uint8 packed keys and their per-byte scales (f32, same shape) -> (even, odd elements) f32."""
    x = packed.astype(jnp.int32)
    return e2m1_value(x & 0xF) * scale, e2m1_value(x >> 4) * scale


def dot_nt(a, b, precision):
    """a [M, K] · b [N, K]ᵀ -> fp32 [M, N]."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def dot_nn(a, b, precision):
    """a [M, K] · b [K, N] -> fp32 [M, N]."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def head_logits(k_even, k_odd, qe, qo, keys_on_lanes: bool):
    """relu(q · k) of split queries [Q·J, dI/2] and dequantised key halves: [dI/2, N] with keys on
    lanes (TPU) -> [Q·J, N]; [N, dI/2] (GPU) -> [N, Q·J]."""
    if qe.dtype == jnp.bfloat16:  # E2M1 × 2^k is exact in bf16: one MXU pass, nothing rounded
        k_even, k_odd, precision = k_even.astype(qe.dtype), k_odd.astype(qe.dtype), lax.Precision.DEFAULT
    else:
        precision = lax.Precision.HIGHEST
    if keys_on_lanes:
        logits = dot_nn(qe, k_even, precision) + dot_nn(qo, k_odd, precision)
    else:
        logits = dot_nt(k_even, qe, precision) + dot_nt(k_odd, qo, precision)
    return jnp.maximum(logits, 0.0)


def split_query(q_BSJd):
    """q [B, S, J, dI] -> (q_even, q_odd) [B, S, J, dI/2], matching the nibble order of the store."""
    if q_BSJd.dtype not in (jnp.bfloat16, jnp.float32):
        q_BSJd = q_BSJd.astype(jnp.float32)
    return q_BSJd[..., 0::2], q_BSJd[..., 1::2]


def head_weights(w_BSJ, head_dim: int):
    """fp32 w·J^-½·dI^-½ [B, S, J]: the weights and both scales of the score."""
    heads = w_BSJ.shape[-1]
    return w_BSJ.astype(jnp.float32) * heads ** -0.5 * head_dim ** -0.5


def block_diagonal(w_BSJ, tile_s: int, rows: int):
    """[B, S/tile_s, rows, tile_s·J]: row i of tile n holds query n·tile_s + i's weights in its own J
    columns (zeros elsewhere, and in rows >= tile_s), so one matmul sums heads for a whole query tile."""
    b, s, j = w_BSJ.shape
    n = s // tile_s
    eye = jnp.eye(rows, tile_s, dtype=w_BSJ.dtype)                       # [rows, tile_s]
    w = w_BSJ.reshape(b, n, 1, tile_s, j) * eye[None, None, :, :, None]
    return w.reshape(b, n, rows, tile_s * j)


def check_store(q_BSJd, w_BSJ, keys_BTh, scales_BTc):
    """Raises unless the query, weights and packed key store agree in shape and dtype."""
    if q_BSJd.ndim != 4:
        raise ValueError(f"q_BSJd.shape={q_BSJd.shape}: expected [B, S, J, dI]")
    b, s, j, d = q_BSJd.shape
    if d % 32:
        raise ValueError(f"q_BSJd.shape[-1]={d}: expected a multiple of the MXFP4 block 32")
    if w_BSJ.shape != (b, s, j):
        raise ValueError(f"w_BSJ.shape={w_BSJ.shape}: expected {(b, s, j)} for q of shape {q_BSJd.shape}")
    if keys_BTh.dtype != jnp.uint8 or keys_BTh.ndim != 3 or keys_BTh.shape[0] != b or keys_BTh.shape[2] != d // 2:
        raise ValueError(f"index_keys: {keys_BTh.dtype}{list(keys_BTh.shape)}, expected uint8[{b}, T, {d // 2}]")
    want = (b, keys_BTh.shape[1], d // 32)
    if scales_BTc.dtype != jnp.uint8 or scales_BTc.shape != want:
        raise ValueError(f"index_scales: {scales_BTc.dtype}{list(scales_BTc.shape)}, expected uint8{list(want)}")


def store_view(keys_BTh, scales_BTc):
    """The store as the TPU kernels read it: keys [B, dI/2, T], scales [B, dI/32, T].

    XLA TPU lays a uint8 [B, T, 64] (or [B, T, 4]) array out with T minor (layout {1,2,0}: a minor
    dimension under 128 lanes would be mostly padding), so this transpose is a free bitcast, while a
    kernel reading [T, dI/2] tiles makes XLA relayout the whole store on every call (seen in the
    compiled HLO as a copy of the parameter). tests/test_kernels_indexer_tpu_aot.py checks for it."""
    return jnp.swapaxes(keys_BTh, 1, 2), jnp.swapaxes(scales_BTc, 1, 2)


def check_backend(backend: str):
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")


# ------------------------------------------------------------------ kernels


def _tpu_kernel(needed_ref, keys_ref, scales_ref, qe_ref, qo_ref, wbd_ref, vis_ref, *out_refs,
                n_s: int, tile_s: int, pool_block: int | None):
    """One (row b, query tile, key tile): scores [tile_s, tT] and, with a pool, block maxima."""
    b, si, ti = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    half, tile_t = keys_ref.shape
    out_ref = out_refs[0]

    @pl.when(ti < needed_ref[b * n_s + si])
    def _score():
        scale = scale_per_byte(lambda c: scales_ref[pl.ds(c, 1), :].astype(jnp.int32), (half, tile_t), 0)
        k_even, k_odd = dequant_tile(keys_ref[...], scale)                     # [dI/2, tT]
        relu = head_logits(k_even, k_odd, qe_ref[...], qo_ref[...], True)         # [tS·J, tT]
        scores = dot_nn(wbd_ref[...], relu, lax.Precision.HIGHEST)              # [8·, tT]
        t = ti * tile_t + lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        scores = jnp.where(t < vis_ref[...], scores, NEG_INF)
        out_ref[...] = scores[:tile_s]
        if pool_block:
            # Blocks along keys: move keys to sublanes, where splitting by 8 is free, and back.
            rows = scores.shape[0]
            maxima = scores.T.reshape(tile_t // pool_block, pool_block, rows).max(axis=1)
            out_refs[1][...] = maxima.T[:tile_s]

    @pl.when(ti >= needed_ref[b * n_s + si])
    def _nothing_visible():
        for ref in out_refs:
            ref[...] = jnp.full(ref.shape, NEG_INF, ref.dtype)


def _gpu_kernel(keys_ref, scales_ref, qe_ref, qo_ref, wbd_ref, vis_ref, *out_refs,
                tile_s: int, pool_block: int | None):
    """The Triton body: as `_tpu_kernel`, the visible-tile test and the head sums done per query."""
    ti = pl.program_id(2)
    tile_t, half = keys_ref.shape
    needed = jnp.max(vis_ref[...]) > ti * tile_t

    @pl.when(needed)
    def _score():
        scale = scale_per_byte(lambda c: scales_ref[:, c][:, None].astype(jnp.int32), (tile_t, half), 1)
        k_even, k_odd = dequant_tile(keys_ref[...], scale)                     # [tT, dI/2]
        relu = head_logits(k_even, k_odd, qe_ref[...], qo_ref[...], False)        # [tT, tS·J]
        t = ti * tile_t + lax.broadcasted_iota(jnp.int32, (tile_t,), 0)
        for i in range(tile_s):
            scores = jnp.sum(relu * wbd_ref[i, :][None, :], axis=1)
            scores = jnp.where(t < vis_ref[i, 0], scores, NEG_INF)
            out_refs[0][i, :] = scores
            if pool_block:
                out_refs[1][i, :] = scores.reshape(tile_t // pool_block, pool_block).max(axis=1)

    @pl.when(jnp.logical_not(needed))
    def _nothing_visible():
        for ref in out_refs:
            ref[...] = jnp.full(ref.shape, NEG_INF, ref.dtype)


def _tiles(backend: str, s: int, t: int, tile_s, tile_t, pool_block):
    tile_s = tile_s or (1 if s == 1 else 8)
    tile_t = tile_t or _TILE_T[backend]
    tile_t = min(tile_t, max(32, pl.next_power_of_2(t)))
    if pool_block and tile_t % pool_block:
        raise ValueError(f"tile_t={tile_t}: expected a multiple of pool_block={pool_block}")
    return tile_s, tile_t


def indexer_scores(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, positions_BS, ratio: int, *,
                   pool_block: int | None = None, backend: str = "tpu", interpret: bool = False,
                   tile_s: int | None = None, tile_t: int | None = None):
    """Index scores I [B, S, T] fp32 (−inf where not visible) over the packed key store.

    q [B, S, J, dI] (bf16 or fp32), w [B, S, J], index_keys uint8 [B, T, dI/2], index_scales uint8
    [B, T, dI/32], positions int32 [B, S]: entry t is visible to position p iff t < (p + 1) // ratio.
    With `pool_block` also returns the block maxima [B, S, ceil(T / pool_block)] of those scores.
    `backend` picks the kernel body ("tpu": Mosaic, "gpu": Triton); `interpret` runs it on any device.
    """
    check_backend(backend)
    check_store(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc)
    b, s, j, d = q_BSJd.shape
    t, half = index_keys_BTh.shape[1], d // 2
    tile_s, tile_t = _tiles(backend, s, t, tile_s, tile_t, pool_block)
    n_s, n_t = -(-s // tile_s), -(-t // tile_t)
    rows = -(-tile_s // 8) * 8
    pad_s = n_s * tile_s - s

    visible = (positions_BS.astype(jnp.int32) + 1) // ratio                     # [B, S]
    visible = jnp.pad(visible, [(0, 0), (0, pad_s)])
    vis_col = jnp.pad(visible.reshape(b, n_s, tile_s), [(0, 0), (0, 0), (0, rows - tile_s)])[..., None]
    needed = -(-jnp.max(visible.reshape(b, n_s, tile_s), axis=-1) // tile_t)    # key tiles to read
    qe, qo = (jnp.pad(x, [(0, 0), (0, pad_s), (0, 0), (0, 0)]).reshape(b, n_s * tile_s * j, half)
              for x in split_query(q_BSJd))
    wbd = block_diagonal(jnp.pad(head_weights(w_BSJ, d), [(0, 0), (0, pad_s), (0, 0)]), tile_s, rows)

    out_shape = [jax.ShapeDtypeStruct((b, n_s * tile_s, t), jnp.float32)]
    if pool_block:
        out_shape.append(jax.ShapeDtypeStruct((b, n_s * tile_s, n_t * tile_t // pool_block), jnp.float32))
    grid = (b, n_s, n_t)

    if backend == "tpu":
        def key_map(bi, si, ti, needed_ref):
            # Tiles past the last visible one repeat its block index: Pallas skips the copy.
            return bi, 0, jnp.minimum(ti, jnp.maximum(needed_ref[bi * n_s + si] - 1, 0))

        def query_map(bi, si, ti, needed_ref):
            return bi, si, 0

        def tile_map(bi, si, ti, needed_ref):
            return bi, si, 0, 0

        def out_map(bi, si, ti, needed_ref):
            return bi, si, ti

        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=grid,
            in_specs=[pl.BlockSpec((None, half, tile_t), key_map),
                      pl.BlockSpec((None, d // 32, tile_t), key_map),
                      pl.BlockSpec((None, tile_s * j, half), query_map),
                      pl.BlockSpec((None, tile_s * j, half), query_map),
                      pl.BlockSpec((None, None, rows, tile_s * j), tile_map),
                      pl.BlockSpec((None, None, rows, 1), tile_map)],
            out_specs=[pl.BlockSpec((None, tile_s, tile_t), out_map)]
            + ([pl.BlockSpec((None, tile_s, tile_t // pool_block), out_map)] if pool_block else []))
        kernel = functools.partial(_tpu_kernel, n_s=n_s, tile_s=tile_s, pool_block=pool_block)
        outs = pl.pallas_call(
            kernel, grid_spec=grid_spec, out_shape=out_shape, interpret=interpret,
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
            cost_estimate=_cost_estimate(b, n_s * tile_s, t, j, d, n_s), name="indexer_scores",
        )(needed.reshape(-1).astype(jnp.int32), *store_view(index_keys_BTh, index_scales_BTc), qe, qo, wbd, vis_col)
    else:
        kernel = functools.partial(_gpu_kernel, tile_s=tile_s, pool_block=pool_block)
        outs = pl.pallas_call(
            kernel, grid=grid, out_shape=out_shape, interpret=interpret,
            in_specs=[pl.BlockSpec((None, tile_t, half), lambda bi, si, ti: (bi, ti, 0)),
                      pl.BlockSpec((None, tile_t, d // 32), lambda bi, si, ti: (bi, ti, 0)),
                      pl.BlockSpec((None, tile_s * j, half), lambda bi, si, ti: (bi, si, 0)),
                      pl.BlockSpec((None, tile_s * j, half), lambda bi, si, ti: (bi, si, 0)),
                      pl.BlockSpec((None, None, rows, tile_s * j), lambda bi, si, ti: (bi, si, 0, 0)),
                      pl.BlockSpec((None, None, rows, 1), lambda bi, si, ti: (bi, si, 0, 0))],
            out_specs=[pl.BlockSpec((None, tile_s, tile_t), lambda bi, si, ti: (bi, si, ti))]
            + ([pl.BlockSpec((None, tile_s, tile_t // pool_block), lambda bi, si, ti: (bi, si, ti))]
               if pool_block else []),
            compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2), name="indexer_scores",
        )(index_keys_BTh, index_scales_BTc, qe, qo, wbd, vis_col)
    scores = outs[0][:, :s]
    if not pool_block:
        return scores
    return scores, outs[1][:, :s, : -(-t // pool_block)]


def indexer_top_k(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, positions_BS, ratio: int, k: int, **kw):
    """The top-k entries per query [B, S, k] int32, ascending, −1 where fewer than k are visible.

    The kernel's scores, then XLA's top-k (see the module docstring); `kw` as `indexer_scores`."""
    return ix.top_k_indices(indexer_scores(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, positions_BS,
                                           ratio, **kw), k)


# ------------------------------------------------------------------ reference and cost


def indexer_scores_reference(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, positions_BS, ratio: int):
    """The plain-JAX path of `Attention._select_cached`: dequantise the whole store, `lightning_scores`."""
    check_store(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc)
    keys = kv_store.dequant_keys(index_keys_BTh, index_scales_BTc)
    visible = ix.visible_entries(positions_BS, ratio, index_keys_BTh.shape[1])
    return ix.lightning_scores(q_BSJd, keys, w_BSJ, visible)


def indexer_top_k_reference(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, positions_BS, ratio: int, k: int):
    return ix.top_k_indices(indexer_scores_reference(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc,
                                                     positions_BS, ratio), k)


def indexer_scores_cost(batch: int, queries: int, entries: int, heads: int, head_dim: int,
                        pool_block: int | None = None, tile_s: int | None = None) -> tuple[int, int]:
    """(HBM bytes moved, flops) of one `indexer_scores` call with every entry visible.

    Bytes: the packed store (dI/2 + dI/32 bytes per entry) once per query tile, the queries and
    weights, the fp32 scores (and block maxima) written. Flops: the J·dI multiply-adds per
    (query, entry) plus the head sum."""
    tile_s = tile_s or (1 if queries == 1 else 8)
    n_s = -(-queries // tile_s)
    key_bytes = entries * (head_dim // 2 + head_dim // 32)
    out = queries * entries * 4 + (queries * -(-entries // pool_block) * 4 if pool_block else 0)
    q_bytes = queries * heads * (head_dim * 4 + 4)
    flops = 2 * queries * entries * heads * (head_dim + 1)
    return batch * (n_s * key_bytes + q_bytes + out), batch * flops


def _cost_estimate(b, s, t, j, d, n_s):
    bytes_moved, flops = indexer_scores_cost(b, s, t, j, d, tile_s=s // n_s)
    return pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=bytes_moved)
