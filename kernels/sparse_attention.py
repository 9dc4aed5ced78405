"""Sparse attention over the stored cache formats (DESIGN §3.2, §3.8, §8): [window ring | picked entries | sink].

Per query (one per row at decode, S per row in a prefill chunk) with H heads sharing one KV latent (MQA, key
== value): one softmax over the valid FP8 window keys, the valid FP4 entries the indexer picked and the
per-head sink (denominator only); a query with nothing valid gives 0, as `attend.attend_step`.

Kernel (one body for interpret mode, Mosaic TPU and Triton GPU; grid = one program per query and head block,
all heads in one block except on a GPU):
- each KV tile (`block_keys` keys) is dequantised ONCE from its bytes in VMEM/registers and shared by the
  block's heads as one [H, K] x [K, tile] matmul; decode reads every byte of the tile once per head block (it
  is memory-bound);
- online softmax over the tiles (flash-decoding), started from the sink: m = sink, l = 1, acc = 0, so the
  sink is a key with a zero value and no row can divide by zero;
- the FP4 entries are never re-interleaved inside the kernel: the low nibbles are the even channels and the
  high nibbles the odd ones, so the logits are q_even·lo + q_odd·hi and the output gathers p·lo and p·hi
  into two half accumulators that the wrapper interleaves (a [B, S, H, K] op, tiny next to the cache).
- the tiles are unrolled statically on TPU (window W/tile + picks k/tile, e.g. 1 + 4 at full size) and a
  `fori_loop` on a GPU: no scratch, no sequential grid axis, which Triton does not have.
Where the picked rows are gathered, and why: Mosaic (libtpu 0.0.42) refuses a DMA of one row of an 8-bit
array (8-bit arrays are tiled 32 rows deep and a DMA's offset and size along that dimension must be
multiples of 32), so neither scalar-prefetched index maps nor manual async copies can fetch a single picked
entry; reading the 32-row tile around each pick would move 32x the bytes. The picked rows ([B, S, k, K/2 +
K/16] bytes, 147 KB per query at full size) are therefore gathered by XLA and streamed into the kernel with
the window by ordinary BlockSpecs; the kernel never sees the store itself.
GPU: the Triton backend, not Mosaic GPU: Mosaic GPU in jax 0.10/0.11 wants warpgroup-shaped (WGMMA) tiles
of 64 rows and has no general lowering for the per-element integer bit operations and lane-splitting
reshapes the dequantisation needs, while Triton lowers them (checked by lowering for 'cuda' on CPU in
tests/test_kernels_attention.py). The Triton backend is deprecated in jax >= 0.11; it still ships there.
Triton needs power-of-two tile sizes and H >= 16 (its dot tiles); the dispatcher falls back to the
reference for shapes it cannot take.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from dsv41 import quant
from dsv41.kernels import quant_pack as qp
from dsv41.kv_store import dequant_entries, dequant_window, from_words, gather_rows, ring_positions
from dsv41.nn.attend import attend_step

HI = lax.Precision.HIGHEST
# Heads per program on a GPU: 16 is Triton's smallest dot tile; all 64 of V4.1-Flash's heads in one program asked
# 384 KiB of shared memory on an H200 (227 KiB there; docs/gpu.md).
GPU_HEAD_BLOCK = 16


def default_block_keys(backend: str) -> int:
    """Keys a tile: 128 (a TPU's lane width), 32 on a GPU (a [32, K] bf16 key tile is 32 KiB of shared memory at
    V4.1's K = 512, where 128 keys were 128 KiB)."""
    return 32 if backend == "gpu" else 128


def ring_valid(lengths_B, window_start_B, window: int):
    """[B, W] bool: ring slots a decode query at position lengths-1 sees (its token already written).

    Slot p % W holds position p; a slot is valid once written (p >= 0) and at or after the row's window start.
    """
    pos = ring_positions(lengths_B, window)
    return (pos >= 0) & (pos >= jnp.maximum(window_start_B, 0)[:, None])


# ----------------------------------------------------------------------------------------------------
# Kernel.

def _dot_t(a, b, precision):
    """a [M, C] · b [N, C]ᵀ -> float32 [M, N]."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision)


def _dot(a, b, precision):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32, precision=precision)


def _attention_kernel(win_ok_ref, sel_ok_ref, q_ref, q_even_ref, q_odd_ref, win_vals_ref, win_scales_ref,
                      sel_vals_ref, sel_scales_ref, sink_ref, out_ref, out_even_ref, out_odd_ref, *,
                      tile: int, scale: float, precision, tile_loop: bool):
    q = q_ref[...]
    q_even, q_odd = q_even_ref[...], q_odd_ref[...]
    dt = q.dtype
    h, k = q.shape
    m = sink_ref[...].astype(jnp.float32)                            # [H, 1]: the sink opens the softmax
    l = jnp.ones((h, 1), jnp.float32)
    acc = jnp.zeros((h, k), jnp.float32)
    acc_even = acc_odd = jnp.zeros((h, k // 2), jnp.float32)

    def update(m, l, logits, ok):
        logits = jnp.where(ok != 0, logits * scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1, keepdims=True))
        alpha, p = jnp.exp(m - m_new), jnp.exp(logits - m_new)
        return m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True), alpha, p.astype(dt)

    def window_tile(i, carry):                                         # FP8 E4M3 keys, UE8M0 per 32
        m, l, acc, acc_even, acc_odd = carry
        rows = pl.ds(i * tile, tile)
        keys = qp.dequantize_fp8_tile(win_vals_ref[rows, :].astype(jnp.int32),
                                      win_scales_ref[rows, :].astype(jnp.int32)).astype(dt)
        m, l, alpha, p = update(m, l, _dot_t(q, keys, precision), win_ok_ref[:, rows])
        return m, l, alpha * acc + _dot(p, keys, precision), alpha * acc_even, alpha * acc_odd

    def picked_tile(i, carry):                                         # FP4 E2M1 entries, E4M3 per 16
        m, l, acc, acc_even, acc_odd = carry
        rows = pl.ds(i * tile, tile)
        b = sel_vals_ref[rows, :].astype(jnp.int32)                  # [tile, K/2]: byte j = channels 2j, 2j+1
        s = qp.decode_e4m3(sel_scales_ref[rows, :].astype(jnp.int32))  # [tile, K/16]
        # Byte j's two channels lie in block 2j // 16 = j // 8.
        s = jnp.broadcast_to(s[:, :, None], (tile, s.shape[1], 8)).reshape(tile, k // 2)
        lo, hi = (qp.decode_e2m1(b & 15) * s).astype(dt), (qp.decode_e2m1(b >> 4) * s).astype(dt)
        logits = _dot_t(q_even, lo, precision) + _dot_t(q_odd, hi, precision)
        m, l, alpha, p = update(m, l, logits, sel_ok_ref[:, rows])
        return m, l, alpha * acc, alpha * acc_even + _dot(p, lo, precision), alpha * acc_odd + _dot(p, hi, precision)

    carry = (m, l, acc, acc_even, acc_odd)
    for body, n in ((window_tile, win_vals_ref.shape[0] // tile), (picked_tile, sel_vals_ref.shape[0] // tile)):
        if tile_loop:
            carry = lax.fori_loop(0, n, body, carry)
        else:
            for i in range(n):
                carry = body(i, carry)
    m, l, acc, acc_even, acc_odd = carry
    out_ref[...] = acc / l
    out_even_ref[...] = acc_even / l
    out_odd_ref[...] = acc_odd / l


def _pad_axis(x, axis: int, size: int, value=0):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _compiler_params(backend: str):
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
    if backend == "gpu":
        from jax.experimental.pallas import triton as pltr
        return pltr.CompilerParams(num_warps=4, num_stages=1)
    return None


def sparse_attention(q_BSHK, window_values_BTK, window_scales_BTX, window_ok_BST, entries_BNK2, entry_scales_BNX,
                     picks_BSk, sink_H, scale: float, *, block_keys: int | None = None, interpret: bool = False,
                     backend: str | None = None, head_block: int | None = None, tile_loop: bool | None = None):
    """Prefill/training chunk: S queries per row, each with its own window mask and picks.

    q [B, S, H, K] (float32 or bfloat16); window value bytes uint8 [B, Tw, K] (FP8 E4M3) and scale bytes
    uint8 [B, Tw, K/32] (UE8M0) — the keys a chunk's queries may see (ring and new tokens), window_ok
    bool [B, S, Tw]; the layer's packed entries uint8 [B, N, K/2] (or, as the cache keeps them, the same bytes
    as uint16 words [B, N, K/4], `kv_store.to_words`) and E4M3 scale bytes uint8 [B, N, K/16];
    picks int32 [B, S, k] into N (−1: skip); sink [H]. Returns [B, S, H, K] in q's dtype. The window tile is
    dequantised per query here (the decode case, S = 1, is the one that must not re-read it).
    block_keys: keys a tile (default `default_block_keys(backend)`); head_block: heads per program (default: all
    of them; on a GPU `GPU_HEAD_BLOCK`, whose [heads, K] accumulators fit a program's registers); tile_loop: the
    key tiles in a `fori_loop` instead of unrolled (default: on a GPU, where Triton took minutes over unrolled
    tiles). None of them changes what is computed.
    """
    b, s, h, k = q_BSHK.shape
    t_win, n_sel = window_values_BTK.shape[1], picks_BSk.shape[-1]
    want = {"window_values": (b, t_win, k), "window_scales": (b, t_win, k // 32), "window_ok": (b, s, t_win),
            "entry_scales": (b, entries_BNK2.shape[1], k // 16), "picks": (b, s, n_sel), "sink": (h,)}
    got = {"window_values": window_values_BTK.shape, "window_scales": window_scales_BTX.shape,
           "window_ok": window_ok_BST.shape, "entry_scales": entry_scales_BNX.shape, "picks": picks_BSk.shape,
           "sink": sink_H.shape}
    for name, shape in want.items():
        if tuple(got[name]) != shape:
            raise ValueError(f"{name}.shape={tuple(got[name])}: expected {shape} for q of shape {q_BSHK.shape}")
    per = 2 if entries_BNK2.dtype == jnp.uint16 else 1  # bytes per stored element
    if entries_BNK2.shape != (b, entries_BNK2.shape[1], k // 2 // per):
        raise ValueError(f"entries.shape={entries_BNK2.shape}: expected (B, N, K/2) = ({b}, N, {k // 2}) bytes"
                         f" (uint16 words: K/4 = {k // 4})")
    backend = backend or jax.default_backend()
    block_keys = default_block_keys(backend) if block_keys is None else block_keys
    if block_keys <= 0 or block_keys % 32:
        raise ValueError(f"block_keys={block_keys}: expected a positive multiple of 32 (8-bit tiles are 32 rows)")
    if head_block is None:
        head_block = GPU_HEAD_BLOCK if backend == "gpu" and h % GPU_HEAD_BLOCK == 0 else h
    if head_block <= 0 or h % head_block:
        raise ValueError(f"head_block={head_block}: expected a positive divisor of the {h} heads")
    tile_loop = backend == "gpu" if tile_loop is None else tile_loop
    hb = head_block
    tile = block_keys
    t_pad, k_pad = -(-t_win // tile) * tile, -(-n_sel // tile) * tile
    rows = b * s

    # The picked rows, gathered by XLA (module doc: Mosaic cannot DMA one 8-bit row).
    sel_vals = from_words(gather_rows(entries_BNK2, picks_BSk)).reshape(rows, n_sel, k // 2)
    sel_scales = gather_rows(entry_scales_BNX, picks_BSk).reshape(rows, n_sel, k // 16)
    sel_ok = (picks_BSk >= 0).astype(jnp.int32).reshape(rows, 1, n_sel)
    win_ok = window_ok_BST.astype(jnp.int32).reshape(rows, 1, t_win)
    q = q_BSHK.reshape(rows, h, k)
    operands = dict(
        win_ok=_pad_axis(win_ok, 2, t_pad), sel_ok=_pad_axis(sel_ok, 2, k_pad), q=q, q_even=q[..., 0::2],
        q_odd=q[..., 1::2], win_vals=_pad_axis(window_values_BTK, 1, t_pad),
        win_scales=_pad_axis(window_scales_BTX, 1, t_pad), sel_vals=_pad_axis(sel_vals, 1, k_pad),
        sel_scales=_pad_axis(sel_scales, 1, k_pad), sink=sink_H.astype(jnp.float32).reshape(h, 1))

    # Grid: (query, head block); every head block of a query reads the same key tiles.
    def per_query(*tail):
        return pl.BlockSpec((None, *tail), lambda r, j: (r,) + (0,) * len(tail))

    def per_heads(width):
        return pl.BlockSpec((None, hb, width), lambda r, j: (r, j, 0))

    def per_row(*tail):  # the window is the row's, shared by its S queries
        return pl.BlockSpec((None, *tail), lambda r, j: (r // s,) + (0,) * len(tail))

    in_specs = [per_query(1, t_pad), per_query(1, k_pad), per_heads(k), per_heads(k // 2), per_heads(k // 2),
                per_row(t_pad, k), per_row(t_pad, k // 32), per_query(k_pad, k // 2), per_query(k_pad, k // 16),
                pl.BlockSpec((hb, 1), lambda r, j: (j, 0))]
    precision = HI if q.dtype == jnp.float32 else None
    out, out_even, out_odd = pl.pallas_call(
        functools.partial(_attention_kernel, tile=tile, scale=float(scale), precision=precision,
                          tile_loop=tile_loop),
        out_shape=(jax.ShapeDtypeStruct((rows, h, k), jnp.float32),
                   jax.ShapeDtypeStruct((rows, h, k // 2), jnp.float32),
                   jax.ShapeDtypeStruct((rows, h, k // 2), jnp.float32)),
        grid=(rows, h // hb),
        in_specs=in_specs,
        out_specs=(per_heads(k), per_heads(k // 2), per_heads(k // 2)),
        compiler_params=None if interpret else _compiler_params(backend),
        interpret=interpret,
        # Two [H, K] x [K, keys] matmuls per query; the bytes are the tiles, q and the outputs.
        cost_estimate=pl.CostEstimate(
            flops=4 * rows * h * k * (t_pad + k_pad), transcendentals=rows * h * (t_pad + k_pad),
            bytes_accessed=b * t_pad * (k + k // 32) + rows * (k_pad * (k // 2 + k // 16) + 4 * h * k * 4)),
        name="sparse_attention",
    )(*operands.values())
    out = out + jnp.stack([out_even, out_odd], axis=-1).reshape(rows, h, k)
    return out.reshape(b, s, h, k).astype(q_BSHK.dtype)


def sparse_decode_attention(q_BHK, window_values_BWK, window_scales_BWX, window_ok_BW, entries_BNK2,
                            entry_scales_BNX, picks_Bk, sink_H, scale: float, **kwargs):
    """Decode: one query per row. q [B, H, K]; the ring uint8 [B, W, K] + [B, W, K/32] with its valid slots
    [B, W] (`ring_valid`); entries uint8 [B, N, K/2] + [B, N, K/16]; picks int32 [B, k]; sink [H].
    Returns [B, H, K] in q's dtype. Keyword arguments as `sparse_attention`."""
    out = sparse_attention(q_BHK[:, None], window_values_BWK, window_scales_BWX, window_ok_BW[:, None],
                           entries_BNK2, entry_scales_BNX, picks_Bk[:, None], sink_H, scale, **kwargs)
    return out[:, 0]


# ----------------------------------------------------------------------------------------------------
# Plain-JAX references: dequantise the stores, then `attend.attend_step`.

def sparse_attention_reference(q_BSHK, window_values_BTK, window_scales_BTX, window_ok_BST, entries_BNK2,
                               entry_scales_BNX, picks_BSk, sink_H, scale: float):
    """What `sparse_attention` computes, from `kv_store` and `attend_step` (same arguments, same result)."""
    keys_w = dequant_window(window_values_BTK, window_scales_BTX).astype(q_BSHK.dtype)
    sel = dequant_entries(gather_rows(entries_BNK2, picks_BSk), gather_rows(entry_scales_BNX, picks_BSk))
    out = attend_step(q_BSHK, keys_w, window_ok_BST, sel.astype(q_BSHK.dtype), picks_BSk >= 0, sink_H, scale)
    return out.astype(q_BSHK.dtype)


def sparse_attention_train(q_BSHK, window_BTK, window_ok_BST, entries_BNK, entry_bytes_BNK2, entry_scales_BNX,
                           picks_BSk, sink_H, scale: float, *, kernel):
    """The whole-sequence (training) forward's attention through the chunk kernel, with gradients.

    window [B, Tw, K] and entries [B, N, K] are floats that hold the cache's values (`quant: qat`: FP8 UE8M0-32
    window keys, FP4 E4M3-16 entries; `entry_bytes`/`entry_scales` are those entries as stored,
    `kv_store.quant_entries`); window_ok [B, S, Tw], picks [B, S, k] (−1: skip), sink [H]. The forward packs the
    window keys (exact: they are FP8 values already) and runs `kernel` (`sparse_attention` or its per-device
    dispatch, same arguments); the backward is the reference's (`attend_step` over the floats, as the XLA path
    differentiates it): the kernel has no backward of its own. Returns [B, S, H, K] in q's dtype."""

    def reference(q, window, entries, sink, window_ok, picks):
        return sparse_attention_train_reference(q, window, window_ok, entries, picks, sink, scale)

    # Every array is an argument (a custom_vjp must not close over traced values); the integer and boolean ones
    # take no cotangent.
    @jax.custom_vjp
    def attend(q, window, entries, sink, window_ok, picks, entry_bytes, entry_scales):
        values, scales = quant.quantize_fp8_ue8m0_32(window)
        return kernel(q, quant.to_bytes(values), quant.to_bytes(scales), window_ok, entry_bytes, entry_scales, picks,
                      sink, scale)

    def forward(*args):
        return attend(*args), args[:6]

    def backward(saved, cotangent):
        return (*jax.vjp(lambda *floats: reference(*floats, *saved[4:]), *saved[:4])[1](cotangent),
                None, None, None, None)

    attend.defvjp(forward, backward)
    return attend(q_BSHK, window_BTK, entries_BNK, sink_H, window_ok_BST, picks_BSk, entry_bytes_BNK2,
                  entry_scales_BNX)


def sparse_attention_train_reference(q_BSHK, window_BTK, window_ok_BST, entries_BNK, picks_BSk, sink_H, scale: float):
    """What `sparse_attention_train` computes, over the floats: the picked entries gathered, `attend_step`."""
    sel = gather_rows(entries_BNK, picks_BSk).astype(q_BSHK.dtype)
    return attend_step(q_BSHK, window_BTK.astype(q_BSHK.dtype), window_ok_BST, sel, picks_BSk >= 0, sink_H,
                       scale).astype(q_BSHK.dtype)


def sparse_decode_attention_reference(q_BHK, window_values_BWK, window_scales_BWX, window_ok_BW, entries_BNK2,
                                      entry_scales_BNX, picks_Bk, sink_H, scale: float):
    """What `sparse_decode_attention` computes, from `kv_store` and `attend_step`."""
    return sparse_attention_reference(q_BHK[:, None], window_values_BWK, window_scales_BWX, window_ok_BW[:, None],
                                      entries_BNK2, entry_scales_BNX, picks_Bk[:, None], sink_H, scale)[:, 0]

