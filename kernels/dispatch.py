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

import math

import jax
from jax.sharding import PartitionSpec as P

from dsv41.kernels import candidate_pool, indexer_scores, quant_pack, sparse_attention, weight_matmul

MODES = ("auto", "pallas", "pallas_interpret", "reference")
_KERNEL_BACKENDS = ("tpu", "gpu")
KINDS = ("indexer", "attention", "quant", "weights")
_GPU_AUTO = ("indexer",)  # the kinds `auto` runs as kernels on a GPU (module doc)


def platform(layout=None) -> str:
    """The platform a step is compiled for: the devices of its layout's mesh (`moe.ExpertLayout`; an
    ahead-of-time compile for a TPU topology runs on a CPU machine), else JAX's default backend."""
    return layout.mesh.devices.flat[0].platform if layout is not None else jax.default_backend()


def resolve(mode: str, backend: str | None = None, kind: str = "indexer") -> str:
    """The implementation `mode` selects on `backend` (default: `platform()`) for a kernel of `kind` (one of
    `KINDS`): 'pallas', 'pallas_interpret' or 'reference'."""
    if mode not in MODES:
        raise ValueError(f"runtime.kernels={mode!r}: expected one of {list(MODES)}")
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {list(KINDS)}")
    backend = backend or platform()
    if mode == "auto":
        on = backend == "tpu" or (backend == "gpu" and kind in _GPU_AUTO)
        return "pallas" if on else "reference"
    if mode == "pallas" and backend not in _KERNEL_BACKENDS:
        raise ValueError(f"runtime.kernels='pallas' on backend {backend!r}: Pallas kernels compile for "
                         f"{list(_KERNEL_BACKENDS)}; use 'pallas_interpret' or 'reference' (or 'auto')")
    if mode == "pallas" and kind == "weights" and backend != "tpu":
        raise ValueError(f"runtime.kernels='pallas' with weights held as shipped on backend {backend!r}: the FP8 and "
                         "MXFP4 weight kernels are Mosaic (TPU) kernels; use 'auto' or 'reference' (XLA dequantises "
                         "in the program) or 'pallas_interpret'")
    return mode


def _per_device(fn, *args, layout=None, replicated: tuple[int, ...] = ()):
    """fn(*args), run per device over the batch rows when the step is built for a mesh.

    XLA cannot partition a Pallas kernel, so on a multi-device mesh (the layout `dsv41.sharding` builds the
    model with, `Policy.lowering.layout`) the kernel runs inside `jax.shard_map`: every argument is split over
    the layout's token axes on its leading (batch) axis, except those at the positions in `replicated` (a
    per-head sink); non-array arguments (ratios, k) are closed over. The rows are independent, so this is
    the same computation."""
    if layout is None or layout.mesh.size == 1 or not layout.token_axes:
        return fn(*args)
    axes = layout.token_axes
    rows = math.prod(layout.mesh.shape[a] for a in axes)
    if args[0].shape[0] % rows:
        raise ValueError(f"batch: {args[0].shape[0]} rows: expected a multiple of the {rows} devices of the mesh "
                         f"axes {axes} that the kernels run over")
    arrays = [i for i, a in enumerate(args) if isinstance(a, jax.Array) or hasattr(a, "shape")]

    def body(*xs):
        full = list(args)
        for i, x in zip(arrays, xs):
            full[i] = x
        return fn(*full)

    specs = tuple(P() if i in replicated else P(axes) for i in arrays)
    return jax.shard_map(body, mesh=layout.mesh, in_specs=specs, out_specs=P(axes), check_vma=False)(
        *(args[i] for i in arrays))


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
    return _per_device(lambda *a: sparse_attention.sparse_decode_attention(
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
    return _per_device(lambda *a: sparse_attention.sparse_attention(
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
        return _per_device(lambda *a: sparse_attention.sparse_attention(
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
    return backend if backend in _KERNEL_BACKENDS else "tpu"


def indexer_top_k(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, positions_BS, ratio: int, k: int, *,
                  mode: str = "auto", layout=None):
    """An index source's top-k [B, S, k] over the packed key store (`indexer_scores.indexer_top_k`)."""
    args = (q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, positions_BS, ratio, k)
    impl = resolve(mode, platform(layout))
    if impl == "reference":
        return indexer_scores.indexer_top_k_reference(*args)
    return _per_device(lambda *a: indexer_scores.indexer_top_k(*a, backend=_indexer_body(layout),
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
    return _per_device(lambda *a: candidate_pool.scores_and_pool(*a, **kw, backend=_indexer_body(layout),
                                                                 interpret=impl == "pallas_interpret"), *args,
                       layout=layout)


def pool_top_k(q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, block_ids_BSn, block: int, positions_BS, ratio: int,
               k: int, *, mode: str = "auto", layout=None):
    """A Reindex layer's picks [B, S, k], scoring only the candidate pool's keys."""
    args = (q_BSJd, w_BSJ, index_keys_BTh, index_scales_BTc, block_ids_BSn, block, positions_BS, ratio, k)
    impl = resolve(mode, platform(layout))
    if impl == "reference":
        return candidate_pool.pool_top_k_reference(*args)
    return _per_device(lambda *a: candidate_pool.pool_top_k(*a, backend=_indexer_body(layout),
                                                            interpret=impl == "pallas_interpret"), *args,
                       layout=layout)


def weight_kernels(mode: str, layout=None) -> str:
    """How the matmuls of weights held as shipped run (`weight_matmul`): 'pallas', 'pallas_interpret', or
    'reference' (the XLA path: dequantised in the program)."""
    return resolve(mode, platform(layout), "weights")


def fp8_matmul(x_ND, w_bytes_KN, s_bytes, *, out_dtype, mode: str = "auto", layout=None):
    """x [N, K] @ an FP8 weight held as shipped (E4M3 and UE8M0 bytes, `weight_matmul.fp8_matmul`) by the Pallas
    kernel per device over the token rows (the weight whole on each), or None where `mode` picks the XLA path."""
    impl = weight_kernels(mode, layout)
    if impl == "reference":
        return None
    return _per_device(lambda x, w, s: weight_matmul.fp8_matmul(x, w, s, out_dtype=out_dtype,
                                                                interpret=impl == "pallas_interpret"),
                       x_ND, w_bytes_KN, s_bytes, layout=layout, replicated=(1, 2))
