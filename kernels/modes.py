"""The kernel modes (`runtime.kernels`), the platform a step is compiled for, and the per-device wrapper
every kernel call goes through (DESIGN §8, §11). A leaf: the weight matmuls (`dsv41.nn.weights`) select
their kernels here without importing the attention and indexer kernels, whose references are model code.
The table of modes and the GPU choices are in `dispatch`.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

MODES = ("auto", "pallas", "pallas_interpret", "reference")
KERNEL_BACKENDS = ("tpu", "gpu")
KINDS = ("indexer", "attention", "quant", "weights")
GPU_AUTO = ("indexer",)  # the kinds `auto` runs as kernels on a GPU (`dispatch`'s doc)


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
        on = backend == "tpu" or (backend == "gpu" and kind in GPU_AUTO)
        return "pallas" if on else "reference"
    if mode == "pallas" and backend not in KERNEL_BACKENDS:
        raise ValueError(f"runtime.kernels='pallas' on backend {backend!r}: Pallas kernels compile for "
                         f"{list(KERNEL_BACKENDS)}; use 'pallas_interpret' or 'reference' (or 'auto')")
    if mode == "pallas" and kind == "weights" and backend != "tpu":
        raise ValueError(f"runtime.kernels='pallas' with weights held as shipped on backend {backend!r}: the FP8 and "
                         "MXFP4 weight kernels are Mosaic (TPU) kernels; use 'auto' or 'reference' (XLA dequantises "
                         "in the program) or 'pallas_interpret'")
    return mode


def per_device(fn, *args, layout=None, replicated: tuple[int, ...] = ()):
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
