"""Kernel or reference, by `runtime.kernels` and the backend JAX runs on (DESIGN §8, §11).

| mode               | what runs                                                            |
|--------------------|----------------------------------------------------------------------|
| `auto`             | the Pallas kernel on TPU (GPU: the indexer's only), the reference on CPU |
| `pallas`           | the Pallas kernel (Mosaic on TPU, Triton on GPU; CPU has no lowering) |
| `pallas_interpret` | the Pallas kernel in interpret mode, on any backend (CPU tests)      |
| `reference`        | the plain-JAX reference                                              |
Every choice gives the same numbers: the quantisation bit for bit, the attention to float rounding.

On a GPU `auto` runs only the kernels seen compiling and running on one (an H200 with jax 0.11.2, 2026-12-04,
`tests/test_kernels_device.py` and `scripts/bench_kernels.py`): the indexer's. There the sparse attention's
Triton body asked for 384 KB of shared memory at V4.1's widths (64 heads × 512, 128-key tiles; the H200 has
227 KB) and the quantisers used `lax.round`, which Pallas' Triton lowering lacks, and a [512, 256] pair matrix
(256 KB of shared memory) for the FP4 nibbles. Both are reshaped since (the attention: 16 heads a program,
32-key tiles in a loop; `sparse_attention.GPU_HEAD_BLOCK`) and lowered for CUDA on a CPU, but not yet compiled
on a GPU, so `auto` keeps the reference for them there; `pallas` runs them.
"""

from __future__ import annotations

from dsv41.kernels import candidate_pool, indexer_scores, quant_pack, sparse_attention
from dsv41.kernels.modes import KERNEL_BACKENDS, KINDS, MODES, per_device, platform, resolve  # noqa: F401 (KINDS, MODES)


def _triton_can_take(h: int, k: int, block_keys: int | None) -> bool:
    """Triton tiles are powers of two and its dots at least 16 wide (module doc of sparse_attention)."""
    def pow2(n):
        return n > 0 and n & (n - 1) == 0
    return h >= 16 and pow2(h) and pow2(k) and pow2(block_keys or sparse_attention.default_block_keys("gpu"))


def _attention_reference(impl: str, q, block_keys: int | None, layout) -> bool:
    """The reference runs when `impl` says so, or on GPU for a shape Triton cannot tile."""
    h, k = q.shape[-2:]
    return impl == "reference" or (impl == "pallas" and platform(layout) == "gpu"
                                   and not _triton_can_take(h, k, block_keys))


def sparse_decode_attention(q_BHK, window_values_BWK, window_scales_BWX, window_ok_BW, entries_BNK2,
                            entry_scales_BNX, picks_Bk, sink_H, scale: float, *, mode: str = "auto",
                            block_keys: int | None = None, layout=None):
    """`sparse_attention.sparse_decode_attention` or its reference, as `mode` says (same arguments)."""
    args = (q_BHK, window_values_BWK, window_scales_BWX, window_ok_BW, entries_BNK2, entry_scales_BNX, picks_Bk,
            sink_H, scale)
    impl = resolve(mode, platform(layout), "attention")
    if _attention_reference(impl, q_BHK, block_keys, layout):
        return sparse_attention.sparse_decode_attention_reference(*args)
    return per_device(lambda *a: sparse_attention.sparse_decode_attention(
        *a, block_keys=block_keys, interpret=impl == "pallas_interpret", backend=platform(layout)), *args, layout=layout,
        replicated=(7,))


def sparse_attention_chunk(q_BSHK, window_values_BTK, window_scales_BTX, window_ok_BST, entries_BNK2,
                           entry_scales_BNX, picks_BSk, sink_H, scale: float, *, mode: str = "auto",
                           block_keys: int | None = None, layout=None):
    """`sparse_attention.sparse_attention` (S queries a row) or its reference, as `mode` says."""
    args = (q_BSHK, window_values_BTK, window_scales_BTX, window_ok_BST, entries_BNK2, entry_scales_BNX, picks_BSk,
            sink_H, scale)
    impl = resolve(mode, platform(layout), "attention")
    if _attention_reference(impl, q_BSHK, block_keys, layout):
        return sparse_attention.sparse_attention_reference(*args)
    return per_device(lambda *a: sparse_attention.sparse_attention(
        *a, block_keys=block_keys, interpret=impl == "pallas_interpret", backend=platform(layout)), *args, layout=layout,
        replicated=(7,))


def sparse_attention_train(q_BSHK, window_BTK, window_ok_BST, entries_BNK, entry_bytes_BNK2, entry_scales_BNX,
                           picks_BSk, sink_H, scale: float, *, mode: str = "auto", block_keys: int | None = None,
                           layout=None):
    """The training forward's attention (`sparse_attention.sparse_attention_train`: the chunk kernel forward,
    the reference's gradients) or, where `mode` says so or Triton cannot tile the shape, the reference."""
    impl = resolve(mode, platform(layout), "attention")
    if _attention_reference(impl, q_BSHK, block_keys, layout):
        return sparse_attention.sparse_attention_train_reference(q_BSHK, window_BTK, window_ok_BST, entries_BNK,
                                                                 picks_BSk, sink_H, scale)

    def kernel(*args):
        return per_device(lambda *a: sparse_attention.sparse_attention(
            *a, block_keys=block_keys, interpret=impl == "pallas_interpret", backend=platform(layout)), *args,
            layout=layout, replicated=(7,))

    return sparse_attention.sparse_attention_train(q_BSHK, window_BTK, window_ok_BST, entries_BNK, entry_bytes_BNK2,
                                                   entry_scales_BNX, picks_BSk, sink_H, scale, kernel=kernel)


def quantize_pack(x, fmt: str, *, mode: str = "auto"):
    """x [..., K] -> (value bytes, scale bytes) of `fmt`, by kernel or reference as `mode` says."""
    impl = resolve(mode, kind="quant")
    if impl == "reference":
        return quant_pack.quantize_pack_reference(x, fmt)
    return quant_pack.quantize_pack(x, fmt, interpret=impl == "pallas_interpret")


def unpack_dequantize(values, scales, fmt: str, *, mode: str = "auto"):
    """(value bytes, scale bytes) of `fmt` -> float32 [..., K], by kernel or reference as `mode` says."""
    impl = resolve(mode, kind="quant")
    if impl == "reference":
        return quant_pack.unpack_dequantize_reference(values, scales, fmt)
    return quant_pack.unpack_dequantize(values, scales, fmt, interpret=impl == "pallas_interpret")


def _indexer_body(layout) -> str:
    """The indexer kernels' body: the backend's own, and the Mosaic (TPU) body in interpret mode on CPU."""
    backend = platform(layout)
    return backend if backend in KERNEL_BACKENDS else "tpu"


def indexer_top_k(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, positions_BS, ratio: int, k: int, *,
                  mode: str = "auto", layout=None):
    """An index source's top-k [B, S, k] over the packed key store (`indexer_scores.indexer_top_k`)."""
    args = (q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, positions_BS, ratio, k)
    impl = resolve(mode, platform(layout))
    if impl == "reference":
        return indexer_scores.indexer_top_k_reference(*args)
    return per_device(lambda *a: indexer_scores.indexer_top_k(*a, backend=_indexer_body(layout),
                                                              interpret=impl == "pallas_interpret"), *args,
                      layout=layout)


def scores_and_pool(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, positions_BS, ratio: int, *, top_k: int,
                    max_blocks: int, block: int, mode: str = "auto", layout=None):
    """The candidate source's (picks [B, S, top_k], pool block ids [B, S, max_blocks]) in one pass."""
    args = (q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, positions_BS, ratio)
    kw = dict(top_k=top_k, max_blocks=max_blocks, block=block)
    impl = resolve(mode, platform(layout))
    if impl == "reference":
        return candidate_pool.scores_and_pool_reference(*args, **kw)
    return per_device(lambda *a: candidate_pool.scores_and_pool(*a, **kw, backend=_indexer_body(layout),
                                                                interpret=impl == "pallas_interpret"), *args,
                      layout=layout)


def pool_top_k(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, block_ids_BSn, block: int, positions_BS, ratio: int,
               k: int, *, mode: str = "auto", layout=None):
    """A Reindex layer's picks [B, S, k], scoring only the candidate pool's keys."""
    args = (q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, block_ids_BSn, block, positions_BS, ratio, k)
    impl = resolve(mode, platform(layout))
    if impl == "reference":
        return candidate_pool.pool_top_k_reference(*args)
    return per_device(lambda *a: candidate_pool.pool_top_k(*a, backend=_indexer_body(layout),
                                                           interpret=impl == "pallas_interpret"), *args,
                      layout=layout)
