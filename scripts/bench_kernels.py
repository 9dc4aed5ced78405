#!/usr/bin/env python3
"""Time, bytes moved, achieved bandwidth and FLOP/s of each Pallas kernel against its XLA reference.

Kernels (DESIGN §8) at the full V4.1 widths of configs/v41_flash.json (64 heads x 512, window 128,
top-512 picks; indexer 32 heads x 128, a pool of 2048 blocks x 8 positions), one query per row
unless said otherwise:

| name           | kernel (kernels/)                              | a size B x ctx means                         |
|----------------|------------------------------------------------|----------------------------------------------|
| attn_decode    | sparse_attention.sparse_decode_attention       | B rows, a store of ctx FP4 entries (m = 1)   |
| attn_prefill   | sparse_attention.sparse_attention, S=--chunk   | B rows of S queries, window W + S keys       |
| quant_<fmt>    | quant_pack.quantize_pack                       | B·ctx vectors quantised in one call          |
| dequant_<fmt>  | quant_pack.unpack_dequantize                   | B·ctx vectors dequantised in one call        |
| idx_scores     | indexer_scores.indexer_scores                  | B rows, ctx MXFP4 index keys                 |
| idx_top_k      | indexer_scores.indexer_top_k (+ XLA top-512)   | as idx_scores                                |
| cand_pool      | candidate_pool.scores_and_pool (layer 20)      | as idx_scores                                |
| reindex_pool   | candidate_pool.pool_top_k (Reindex layers)     | ≤ 2048 pool blocks of 8 out of ctx keys      |
(<fmt>: fp4 = FP4 E2M1 / E4M3 per 16 at K = 512, mxfp4 = the indexer key at 128, fp8 = the window at 512.)

What is measured, per (kernel, size), for the kernel and for its plain-JAX reference:
- time: the jitted call, warm (compiled and run once first), a sample = `inner` calls dispatched back to
  back then `block_until_ready` (inner sized to ~5 ms so host dispatch overlaps), median of --reps;
- bytes: the HBM bytes the computation must read and write, from the shapes: packed FP4/FP8 bytes and
  their scales read once (the picked rows only, for the sparse attention; the whole key store once per
  query tile for the indexer, `indexer_scores_cost`; exactly the pool's keys for Reindex,
  `pool_scores_cost(backend="gpu")` — the TPU kernel fetches whole 128-entry tiles, 16x that, noted in
  the row), queries and weights, outputs written, the fp32 scores re-read by an XLA top-k. The same
  count serves the kernel and the reference: what either moves beyond it is its own overhead;
- GB/s and %HBM = bytes / time against the device's peak; TFLOP/s and %peak against dense bf16
  (flops: the matmuls, 4·H·K per query and key for the attention, `*_cost` for the indexer; none for
  the quantisers); `speedup` = reference time / kernel time; `roofline` = the time at peak bandwidth or
  peak FLOP/s, whichever is longer.
On CPU (no TPU or GPU) the Pallas kernels have no native lowering and interpret mode times nothing
useful: only the reference is timed, at small sizes (the header says so; no kernel rows).

--tpu-compile TOPOLOGY (e.g. v5p:2x2x2, v5e:2x2; needs libtpu, run with JAX_PLATFORMS=cpu): each
kernel's Mosaic body and each reference is compiled ahead of time for the slice, wrapped in
`jax.shard_map` with the batch split over its devices (a size's batch rounded up to a multiple of the
device count: at least one row per device), and the table gives per device: compile seconds,
memory_analysis (argument / output / temp bytes), cost_analysis (flops, bytes accessed), the model
bytes above and their roofline time, and a note where the compiled program copies a whole argument
(>= 1M elements) on every call (an XLA relayout around the kernel: bytes the model does not count).
`ref/kern bytes` there is XLA's bytes accessed, reference / kernel (XLA's count for a gather can
include its whole operand, so treat it as an upper bound).

A size whose arrays (inputs + outputs, from jax.eval_shape) do not fit 90% of the device memory is
skipped with a note; when timing, the reference alone is skipped when its estimated temporaries (the
dequantised fp32 keys it materialises) do not fit; a compiled program whose argument + output + temp bytes
exceed the device memory says so. A failing (kernel, size) prints its error in the row; the rest go on.

    python scripts/bench_kernels.py --quick                       # GPU/TPU: 1x4K, 64x128K; CPU: reference only
    python scripts/bench_kernels.py --sizes 1x4K,64x128K,64x1M --kernels attn_decode,idx_scores --json out.json
    JAX_PLATFORMS=cpu python scripts/bench_kernels.py --tpu-compile v5p:2x2x2 --quick   # 64x128K only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the kernels are `dsv41.kernels`, installed from kernels/
    sys.path.insert(0, str(REPO))

SIZES = "1x4K,64x4K,1x128K,64x128K,1x1M,64x1M"
QUICK_SIZES = "1x4K,64x128K"
COMPILE_QUICK_SIZES = "64x128K"  # the target size; each TPU compile takes seconds to a minute here
CPU_SIZES = "1x4K,4x4K,1x32K"
CPU_QUICK_SIZES = "1x4K,2x16K"
CPU_MEMORY = 6 * 2**30  # what the CPU runs may hold (the machine is shared)
FIT = 0.9               # of the device memory

# device_kind (lower case) contains -> (name, peak HBM GB/s, dense bf16 TFLOP/s, HBM bytes). Order matters:
# "tpu v5 lite" before "tpu v5".
DEVICE_PEAKS = [
    ("h200", ("NVIDIA H200", 4800, 989, 141e9)),
    ("h100", ("NVIDIA H100 SXM", 3350, 989, 80e9)),
    ("v5 lite", ("TPU v5e", 819, 197, 16 * 2**30)),
    ("v5e", ("TPU v5e", 819, 197, 16 * 2**30)),
    ("v6 lite", ("TPU v6e", 1640, 918, 32 * 2**30)),
    ("v6e", ("TPU v6e", 1640, 918, 32 * 2**30)),
    ("v5p", ("TPU v5p", 2765, 459, 95e9)),
    ("tpu v5", ("TPU v5p", 2765, 459, 95e9)),
]

TARGETS = ("decode sparse attention and indexer scoring >= 60% of peak HBM bandwidth at 128K context, batch 64; "
           "every kernel >= 2x its XLA reference (DESIGN §8, issue 5)")
TARGET_KERNELS = ("attn_decode", "idx_scores")
TARGET_SIZE = (64, 128 * 1024)
TARGET_HBM, TARGET_SPEEDUP = 0.60, 2.0

KERNELS = ("attn_decode", "attn_prefill", "quant_fp4", "dequant_fp4", "quant_mxfp4", "dequant_mxfp4",
           "quant_fp8", "dequant_fp8", "idx_scores", "idx_top_k", "cand_pool", "reindex_pool")


def device_peaks(kind: str):
    """(name, GB/s, TFLOP/s, memory bytes) of a device_kind, None where unknown (CPU)."""
    k = kind.lower()
    for key, peaks in DEVICE_PEAKS:
        if key in k:
            return peaks
    return None


def widths() -> dict:
    cfg = json.loads((REPO / "configs" / "v41_flash.json").read_text())
    arch, idx = cfg["architecture"], cfg["csa2"]["indexer"]
    return dict(H=arch["num_heads"], K=arch["head_dim"], W=cfg["kv_cache"]["swa_window_size"], k=idx["top_k"],
                J=idx["query_heads"], dI=idx["head_dim"], blocks=idx["hierarchical"]["max_blocks"],
                block=idx["hierarchical"]["positions_per_block"])


def parse_count(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1024, "M": 1024**2}.get(text[-1:], 1)
    return int(text[:-1] if mult > 1 else text) * mult


def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for item in text.split(","):
        b, _, t = item.strip().lower().partition("x")
        if not t:
            raise SystemExit(f"--sizes {item!r}: expected BATCHxCONTEXT, e.g. 64x128K")
        sizes.append((int(b), parse_count(t)))
    return sizes


def label(n: int) -> str:
    for unit, m in (("M", 1024**2), ("K", 1024)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


# --------------------------------------------------------------------------------------------------
# Cases: arguments (shape, dtype, how to fill), the two callables, bytes and flops.

@dataclasses.dataclass
class Arg:
    shape: tuple
    dtype: str
    fill: str               # normal | bytes | fp8 | e4m3 | ue8m0 | true | picks:N | fill:V | blocks:N
    batched: bool = True    # leading axis is the batch (split over devices); else replicated


@dataclasses.dataclass
class Case:
    kernel: str
    batch: int
    ctx: int
    args: list
    run_kernel: object      # (*args) -> outputs, the Pallas kernel for the backend
    run_reference: object   # (*args) -> outputs, the plain-JAX reference
    bytes: int
    flops: int | None
    ref_temp: int           # the reference's estimated temporaries (fit check)
    note: str = ""


def make_case(name: str, b: int, t: int, w: dict, chunk: int, backend: str) -> Case:
    from dsv41.kernels import candidate_pool as cp, indexer_scores as isc, quant_pack as qp, sparse_attention as sa

    H, K, W, k = w["H"], w["K"], w["W"], w["k"]
    J, dI, block = w["J"], w["dI"], w["block"]
    scale = K ** -0.5
    if name in ("attn_decode", "attn_prefill"):
        s = 1 if name == "attn_decode" else chunk
        tw = W if s == 1 else W + s
        store = [Arg((b, t, K // 2), "uint8", "bytes"), Arg((b, t, K // 16), "uint8", "e4m3")]
        sink = Arg((H,), "float32", "normal", batched=False)
        if s == 1:
            args = [Arg((b, H, K), "bfloat16", "normal"), Arg((b, W, K), "uint8", "fp8"),
                    Arg((b, W, K // 32), "uint8", "ue8m0"), Arg((b, W), "bool", "true"), *store,
                    Arg((b, k), "int32", f"picks:{t}"), sink]
            kern = lambda *a: sa.sparse_decode_attention(*a, scale, backend=backend)  # noqa: E731
            ref = lambda *a: sa.sparse_decode_attention_reference(*a, scale)  # noqa: E731
        else:
            args = [Arg((b, s, H, K), "bfloat16", "normal"), Arg((b, tw, K), "uint8", "fp8"),
                    Arg((b, tw, K // 32), "uint8", "ue8m0"), Arg((b, s, tw), "bool", "true"), *store,
                    Arg((b, s, k), "int32", f"picks:{t}"), sink]
            kern = lambda *a: sa.sparse_attention(*a, scale, backend=backend)  # noqa: E731
            ref = lambda *a: sa.sparse_attention_reference(*a, scale)  # noqa: E731
        q_bytes = b * s * H * K * 2
        moved = (2 * q_bytes + b * tw * (K + K // 32) + b * s * tw + b * s * k * (4 + K // 2 + K // 16) + 4 * H)
        flops = 4 * b * s * H * K * (tw + k)
        temp = 2 * b * s * k * K * 4 + 2 * b * s * H * (tw + k) * 4 + b * tw * K * 4
        note = f"S={s}" if s > 1 else ""
        return Case(name, b, t, args, kern, ref, moved, flops, temp, note)

    if name.startswith(("quant_", "dequant_")):
        fmt = {"fp4": qp.quant.FP4_E4M3_16, "mxfp4": qp.quant.MXFP4, "fp8": qp.quant.FP8_UE8M0_32}[name.split("_")[1]]
        kk = dI if fmt == qp.quant.MXFP4 else K
        blk = qp.quant.BLOCK[fmt]
        kv = kk if fmt == qp.quant.FP8_UE8M0_32 else kk // 2
        n = b * t
        moved = n * (4 * kk + kv + kk // blk)
        note = f"{fmt}, K={kk}"
        if name.startswith("quant_"):
            args = [Arg((b, t, kk), "float32", "normal")]
            kern = lambda x: qp.quantize_pack(x, fmt, backend=backend)  # noqa: E731
            ref = lambda x: qp.quantize_pack_reference(x, fmt)  # noqa: E731
        else:
            vfill = "fp8" if fmt == qp.quant.FP8_UE8M0_32 else "bytes"
            sfill = "e4m3" if fmt == qp.quant.FP4_E4M3_16 else "ue8m0"
            args = [Arg((b, t, kv), "uint8", vfill), Arg((b, t, kk // blk), "uint8", sfill)]
            kern = lambda v, sc: qp.unpack_dequantize(v, sc, fmt, backend=backend)  # noqa: E731
            ref = lambda v, sc: qp.unpack_dequantize_reference(v, sc, fmt)  # noqa: E731
        return Case(name, b, t, args, kern, ref, moved, None, 3 * n * kk * 4, note)

    # The indexer family: one decode query per row, every entry visible (m = 1, position ctx - 1).
    q = [Arg((b, 1, J, dI), "bfloat16", "normal"), Arg((b, 1, J), "float32", "normal")]
    store = [Arg((b, t, dI // 2), "uint8", "bytes"), Arg((b, t, dI // 32), "uint8", "ue8m0")]
    pos = Arg((b, 1), "int32", f"fill:{t - 1}")
    if name in ("idx_scores", "idx_top_k", "cand_pool"):
        args = [*q, *store, pos]
        temp = b * t * dI * 4 + 3 * b * t * 4
        if name == "idx_scores":
            moved, flops = isc.indexer_scores_cost(b, 1, t, J, dI)
            kern = lambda *a: isc.indexer_scores(*a, 1, backend=backend)  # noqa: E731
            ref = lambda *a: isc.indexer_scores_reference(*a, 1)  # noqa: E731
        elif name == "idx_top_k":
            moved, flops = isc.indexer_scores_cost(b, 1, t, J, dI)
            moved += b * t * 4 + b * k * 4                    # the top-k re-reads the scores
            kern = lambda *a: isc.indexer_top_k(*a, 1, k, backend=backend)  # noqa: E731
            ref = lambda *a: isc.indexer_top_k_reference(*a, 1, k)  # noqa: E731
        else:
            nb = w["blocks"]
            moved, flops = isc.indexer_scores_cost(b, 1, t, J, dI, pool_block=block)
            moved += b * t * 4 + b * -(-t // block) * 4 + b * (k + nb) * 4
            kern = lambda *a: cp.scores_and_pool(*a, 1, top_k=k, max_blocks=nb, block=block,  # noqa: E731
                                                 backend=backend)
            ref = lambda *a: cp.scores_and_pool_reference(*a, 1, top_k=k, max_blocks=nb, block=block)  # noqa: E731
        return Case(name, b, t, args, kern, ref, moved, flops, temp, "S=1")
    if name == "reindex_pool":
        n = min(w["blocks"], t // block)
        args = [*q, *store, Arg((b, 1, n), "int32", f"blocks:{t // block}"), pos]
        moved, flops = cp.pool_scores_cost(b, 1, n, block, J, dI, backend="gpu")
        moved += b * n * block * 4 + b * k * 4
        kern = lambda qq, ww, kk, ss, ids, p: cp.pool_top_k(qq, ww, kk, ss, ids, block, p, 1, k,  # noqa: E731
                                                              backend=backend)
        ref = lambda qq, ww, kk, ss, ids, p: cp.pool_top_k_reference(qq, ww, kk, ss, ids, block, p, 1, k)  # noqa: E731
        note = f"{n} blocks x {block}"
        if backend == "tpu":
            note += f"; TPU reads 128-entry tiles: {cp.pool_scores_cost(b, 1, n, block, J, dI)[0] / 1e6:.1f} MB"
        return Case(name, b, t, args, kern, ref, moved, flops, 2 * b * n * block * dI * 4, note)
    raise ValueError(f"kernel {name!r}: expected one of {list(KERNELS)}")


def arg_bytes(args, batch_mult: int = 1) -> int:
    import numpy as np
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize * (batch_mult if a.batched else 1) for a in args)


def out_bytes(fn, structs) -> int:
    import jax
    import numpy as np
    outs = jax.eval_shape(fn, *structs)
    return sum(math.prod(o.shape) * np.dtype(o.dtype).itemsize for o in jax.tree.leaves(outs))


def fill(args: list, key):
    """The arguments' arrays, made on the device in one program: valid codes (no NaN bytes), scales near 1."""
    import jax
    import jax.numpy as jnp

    def one(a: Arg, key):
        kind, _, val = a.fill.partition(":")
        if kind == "normal":
            return jax.random.normal(key, a.shape, jnp.float32).astype(a.dtype)
        if kind == "true":
            return jnp.ones(a.shape, jnp.bool_)
        if kind == "fill":
            return jnp.full(a.shape, int(val), a.dtype)
        if kind == "picks":
            return jax.random.randint(key, a.shape, 0, int(val), jnp.int32)
        if kind == "blocks":  # distinct ascending block ids, spread over the context
            n, total = a.shape[-1], int(val)
            stride = total // n
            return jnp.arange(n, dtype=jnp.int32) * stride + jax.random.randint(key, a.shape, 0, stride, jnp.int32)
        bits = jax.random.bits(key, a.shape, jnp.uint8)
        if kind == "bytes":                                  # FP4 nibbles: every code is a number
            return bits
        if kind == "fp8":                                    # E4M3: 0x7F / 0xFF are NaN
            return jnp.where((bits & 0x7F) == 0x7F, bits ^ 1, bits)
        if kind == "e4m3":                                   # 0x30..0x3F: 0.5 .. 1.875
            return jnp.uint8(0x30) | (bits & 0x0F)
        if kind == "ue8m0":                                  # 2^-7 .. 2^0
            return jnp.uint8(120) + (bits & 7)
        raise ValueError(f"fill {a.fill!r}")

    return jax.jit(lambda key: [one(a, k) for a, k in zip(args, jax.random.split(key, len(args)))])(key)


# --------------------------------------------------------------------------------------------------
# Measurements.

def err_text(e: BaseException) -> str:
    line = next((x for x in str(e).splitlines() if x.strip()), "")
    return f"{type(e).__name__}: {line[:160]}"


def time_call(fn, args, reps: int, out_size: int):
    """(median seconds per call, first call seconds (compile + run))."""
    import jax
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = time.perf_counter() - t0
    # Enough calls in flight to hide dispatch, not so many that their outputs crowd the memory.
    inner = int(max(1, min(200, 0.005 / max(one, 1e-7), 2e9 / max(out_size, 1))))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / inner)
        del out
    return statistics.median(samples), first


def measure(case: Case, reps: int, run_kernel: bool, memory: float, key) -> list[dict]:
    """Rows for the kernel and the reference, timed on the default device."""
    import jax
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in case.args]
    rows = []
    base = dict(kernel=case.kernel, batch=case.batch, ctx=case.ctx, bytes=case.bytes, flops=case.flops,
                note=case.note)
    try:
        resident = arg_bytes(case.args) + out_bytes(case.run_reference, structs)
    except Exception as e:  # noqa: BLE001 — the row reports it, the table goes on
        return [dict(base, impl="both", error=err_text(e))]
    if resident > FIT * memory:
        return [dict(base, impl="both", skipped=f"needs {resident / 2**30:.1f} GiB > {FIT:.0%} of "
                                                  f"{memory / 2**30:.0f} GiB")]
    args = []
    try:
        args = jax.block_until_ready(fill(case.args, key))
        out_size = resident - arg_bytes(case.args)
        for impl, fn in (("kernel", case.run_kernel), ("reference", case.run_reference)):
            row = dict(base, impl=impl)
            rows.append(row)
            if impl == "kernel" and not run_kernel:
                rows.pop()  # CPU: the header says why there is no kernel row
                continue
            if impl == "reference" and resident + case.ref_temp > FIT * memory:
                row["skipped"] = f"reference temporaries ~{case.ref_temp / 2**30:.1f} GiB do not fit"
                continue
            try:
                row["seconds"], row["first_call_s"] = time_call(jax.jit(fn), args, reps, out_size)
            except Exception as e:  # noqa: BLE001
                row["error"] = err_text(e)
    except Exception as e:  # noqa: BLE001
        rows.append(dict(base, impl="both", error=err_text(e)))
    finally:
        del args
    return rows


def argument_copies(hlo: str, min_elements: int = 2**20) -> list[str]:
    """Shapes of the program's own arguments that its entry computation copies whole (a relayout)."""
    entry = hlo[hlo.index("\nENTRY"):] if "\nENTRY" in hlo else ""
    entry = entry[: entry.find("\n}") + 1] if "\n}" in entry else entry
    params = set(re.findall(r"(%[\w.\-]+) = \S+ parameter\(", entry))
    out = []
    for m in re.finditer(r"= (\w+)\[([\d,]+)\]\S* copy\((%[\w.\-]+)\)", entry):
        if m.group(3) in params and math.prod(int(x) for x in m.group(2).split(",")) >= min_elements:
            out.append(f"{m.group(1)}[{m.group(2)}]")
    return out


def compile_tpu(case: Case, mesh, devices: int, memory: float, with_reference: bool) -> list[dict]:
    """Rows for the kernel and the reference compiled for the TPU slice, per device (batch split)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    base = dict(kernel=case.kernel, batch=case.batch * devices, per_device_batch=case.batch, ctx=case.ctx,
                bytes=case.bytes, flops=case.flops, note=case.note)

    def struct(a: Arg, sharded: bool):
        if not a.batched:
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P()) if sharded else None)
        shape = (a.shape[0] * devices, *a.shape[1:]) if sharded else a.shape
        return jax.ShapeDtypeStruct(shape, a.dtype, sharding=NamedSharding(mesh, P("data")) if sharded else None)

    try:
        resident = arg_bytes(case.args) + out_bytes(case.run_reference, [struct(a, False) for a in case.args])
    except Exception as e:  # noqa: BLE001
        return [dict(base, impl="both", error=err_text(e))]
    if resident > FIT * memory:
        return [dict(base, impl="both", skipped=f"needs {resident / 2**30:.1f} GiB/device > {FIT:.0%} of "
                                                  f"{memory / 2**30:.0f} GiB")]
    rows = []
    specs = tuple(P("data") if a.batched else P() for a in case.args)
    impls = [("kernel", case.run_kernel)] + ([("reference", case.run_reference)] if with_reference else [])
    for impl, fn in impls:
        row = dict(base, impl=impl)
        rows.append(row)
        try:
            sharded = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("data"), check_vma=False)
            t0 = time.perf_counter()
            compiled = jax.jit(sharded).lower(*[struct(a, True) for a in case.args]).compile()
            row["compile_s"] = time.perf_counter() - t0
            mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            row.update(argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
                       temp_bytes=mem.temp_size_in_bytes, xla_flops=cost.get("flops"),
                       xla_bytes=cost.get("bytes accessed"))
            hlo = compiled.as_text()
            if impl == "kernel":
                row["mosaic"] = "tpu_custom_call" in hlo
            # A whole argument copied on every call (a relayout XLA inserts around the kernel) moves far more
            # than the model bytes: name the big ones.
            row["argument_copies"] = argument_copies(hlo)
            total = row["argument_bytes"] + row["output_bytes"] + row["temp_bytes"]
            if total > memory:
                row["skipped"] = f"does not fit: {total / 2**30:.1f} GiB/device > {memory / 2**30:.0f} GiB"
        except Exception as e:  # noqa: BLE001
            row["error"] = err_text(e)
    return rows


# --------------------------------------------------------------------------------------------------
# Table.

def derive(rows: list[dict], peaks) -> None:
    """GB/s, TFLOP/s, fractions of peak, roofline time and the kernel's speedup, in place."""
    by_key = {(r["kernel"], r["batch"], r["ctx"], r["impl"]): r for r in rows}
    for r in rows:
        if peaks:
            _, gbs, tflops, _ = peaks
            r["roofline_s"] = max(r["bytes"] / (gbs * 1e9), (r["flops"] or 0) / (tflops * 1e12))
        if "seconds" in r:
            r["GB_per_s"] = r["bytes"] / r["seconds"] / 1e9
            r["TFLOP_per_s"] = r["flops"] / r["seconds"] / 1e12 if r["flops"] else None
            if peaks:
                r["hbm_fraction"] = r["GB_per_s"] / peaks[1]
                r["flop_fraction"] = r["TFLOP_per_s"] / peaks[2] if r["flops"] else None
    for r in rows:
        ref = by_key.get((r["kernel"], r["batch"], r["ctx"], "reference"))
        if r["impl"] != "kernel" or not ref:
            continue
        if "seconds" in r and "seconds" in ref:
            r["speedup"] = ref["seconds"] / r["seconds"]
        elif r.get("xla_bytes") and ref.get("xla_bytes"):
            r["speedup"] = ref["xla_bytes"] / r["xla_bytes"]


def fmt_num(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.1f}"


def table(rows: list[dict], compile_mode: bool) -> str:
    if compile_mode:
        head = ["kernel", "B x ctx", "B/dev", "impl", "compile s", "arg MB", "out MB", "temp MB", "XLA GFLOP",
                "XLA MB", "model MB", "roofline us", "ref/kern bytes", "note"]
    else:
        head = ["kernel", "B x ctx", "impl", "time us", "model MB", "GB/s", "%HBM", "TFLOP/s", "%peak",
                "roofline us", "speedup", "note"]
    lines = []
    for r in rows:
        size = f"{r['batch']}x{label(r['ctx'])}"
        note = "; ".join(x for x in (r.get("note"), r.get("skipped"), r.get("error")) if x)
        if compile_mode:
            extra = ["no Mosaic call in the HLO"] if r["impl"] == "kernel" and r.get("mosaic") is False else []
            extra += [f"copies argument {a} per call" for a in r.get("argument_copies", [])]
            note = "; ".join(x for x in (note, *extra) if x)
            cells = [r["kernel"], size, str(r.get("per_device_batch", "")), r["impl"],
                     fmt_num(r.get("compile_s"), ".1f"), mb(r.get("argument_bytes")), mb(r.get("output_bytes")),
                     mb(r.get("temp_bytes")), fmt_num(r["xla_flops"] / 1e9 if r.get("xla_flops") else None, ".2f"),
                     mb(r.get("xla_bytes")), mb(r["bytes"]),
                     fmt_num(r["roofline_s"] * 1e6 if "roofline_s" in r else None, ".1f"),
                     fmt_num(r.get("speedup"), ".2f"), note]
        else:
            pct = lambda x: fmt_num(x * 100 if x is not None else None, ".0f")  # noqa: E731
            us = r["seconds"] * 1e6 if "seconds" in r else None
            cells = [r["kernel"], size, r["impl"], fmt_num(us, ".1f" if us is not None and us < 1e4 else ".0f"),
                     mb(r["bytes"]), fmt_num(r.get("GB_per_s"), ".1f"), pct(r.get("hbm_fraction")),
                     fmt_num(r.get("TFLOP_per_s"), ".2f"), pct(r.get("flop_fraction")),
                     fmt_num(r["roofline_s"] * 1e6 if "roofline_s" in r else None, ".1f"),
                     fmt_num(r.get("speedup"), ".2f"), note]
        lines.append(cells)
    widths_ = [max(len(h), *(len(c[i]) for c in lines)) if lines else len(h) for i, h in enumerate(head)]
    out = [" | ".join(h.ljust(w) for h, w in zip(head, widths_)).rstrip(),
           "-+-".join("-" * w for w in widths_)]
    out += [" | ".join(c.ljust(w) for c, w in zip(cells, widths_)).rstrip() for cells in lines]
    return "\n".join(out)


def target_lines(rows: list[dict], compile_mode: bool) -> list[str]:
    out = [f"targets: {TARGETS}"]
    for name in TARGET_KERNELS:
        r = next((r for r in rows if r["kernel"] == name and r["impl"] == "kernel"
                  and (r["batch"], r["ctx"]) == TARGET_SIZE), None)
        where = f"{name} at {TARGET_SIZE[0]}x{label(TARGET_SIZE[1])}"
        if r is None or "seconds" not in r:
            why = "compile only, nothing timed" if compile_mode else (
                (r.get("skipped") or r.get("error")) if r else "size not in this run")
            roof = f" (roofline {r['roofline_s'] * 1e6:.1f} us)" if r and "roofline_s" in r else ""
            out.append(f"  {where}: not measured — {why}{roof}")
            continue
        hbm = r.get("hbm_fraction")
        sp = r.get("speedup")
        verdict = lambda ok: "met" if ok else "NOT met"  # noqa: E731
        out.append(f"  {where}: {fmt_num(hbm * 100 if hbm is not None else None, '.0f')}% of HBM "
                   f"({verdict(hbm is not None and hbm >= TARGET_HBM)}), speedup {fmt_num(sp, '.2f')}x "
                   f"({verdict(sp is not None and sp >= TARGET_SPEEDUP)})")
    timed = [r for r in rows if r["impl"] == "kernel" and r.get("speedup") is not None and "seconds" in r]
    if timed:
        slow = [f"{r['kernel']} {r['batch']}x{label(r['ctx'])} ({r['speedup']:.2f}x)" for r in timed
                if r["speedup"] < TARGET_SPEEDUP]
        out.append(f"  >= {TARGET_SPEEDUP:.0f}x the reference: {len(timed) - len(slow)}/{len(timed)} timed rows"
                   + (f"; below: {', '.join(slow)}" if slow else ""))
    return out


# --------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", help=f"BATCHxCONTEXT list (default {SIZES}; CPU {CPU_SIZES})")
    ap.add_argument("--quick", action="store_true",
                    help=f"sizes {QUICK_SIZES} (CPU: {CPU_QUICK_SIZES}; --tpu-compile: {COMPILE_QUICK_SIZES})")
    ap.add_argument("--kernels", default=",".join(KERNELS), help="comma list of " + ", ".join(KERNELS))
    ap.add_argument("--chunk", type=int, help="queries per row of attn_prefill (default 512; CPU 16)")
    ap.add_argument("--reps", type=int, help="timed samples, the median is reported (default 20; CPU 3)")
    ap.add_argument("--tpu-compile", metavar="TOPOLOGY", help="AOT-compile for a TPU slice, e.g. v5p:2x2x2")
    ap.add_argument("--no-reference", action="store_true", help="--tpu-compile: compile the kernels only")
    ap.add_argument("--memory-gib", type=float, help="device memory to fit sizes into (default: the device's)")
    ap.add_argument("--json", help="write the rows and the run's settings here")
    opts = ap.parse_args(argv)

    names = [n.strip() for n in opts.kernels.split(",") if n.strip()]
    unknown = [n for n in names if n not in KERNELS]
    if unknown:
        ap.error(f"--kernels {unknown}: expected some of {list(KERNELS)}")
    if opts.tpu_compile:
        # A libtpu held by another process (a test run beside this one) must not block the compile.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax

    w = widths()
    compile_mode = bool(opts.tpu_compile)
    if compile_mode:
        import numpy as np
        from jax.experimental import topologies
        from jax.sharding import Mesh
        topo = topologies.get_topology_desc(topology_name=opts.tpu_compile, platform="tpu")
        devs = list(topo.devices)
        mesh = Mesh(np.array(devs).reshape(-1), ("data",))
        kind, backend, accel = devs[0].device_kind, "tpu", True
    else:
        dev = jax.devices()[0]
        kind, backend = dev.device_kind, jax.default_backend()
        accel = backend in ("tpu", "gpu")
    peaks = device_peaks(kind) if (accel or compile_mode) else None
    if compile_mode:
        default = COMPILE_QUICK_SIZES if opts.quick else SIZES
    elif accel:
        default = QUICK_SIZES if opts.quick else SIZES
    else:
        default = CPU_QUICK_SIZES if opts.quick else CPU_SIZES
    sizes = parse_sizes(opts.sizes or default)
    chunk = opts.chunk or (512 if accel else 16)
    reps = opts.reps or (20 if accel else 3)
    memory = (opts.memory_gib * 2**30 if opts.memory_gib else None)
    if memory is None and not compile_mode and accel:
        stats = dev.memory_stats() or {}
        memory = stats.get("bytes_limit")
    if memory is None:
        memory = peaks[3] if peaks else CPU_MEMORY

    head = [f"bench_kernels: jax {jax.__version__}, {platform.node()}, widths {w}",
            f"device: {kind}" + (f" x{len(devs)} (AOT compile of {opts.tpu_compile}, nothing runs)"
                                  if compile_mode else f" ({backend})"),
            (f"peaks: {peaks[0]} {peaks[1]} GB/s HBM, {peaks[2]} TFLOP/s dense bf16, "
             f"{peaks[3] / 2**30:.0f} GiB" if peaks else "peaks: unknown for this device (no %HBM / %peak)"),
            f"sizes: {', '.join(f'{b}x{label(t)}' for b, t in sizes)}; attn_prefill S={chunk}; "
            f"fit: {FIT:.0%} of {memory / 2**30:.1f} GiB" + ("" if compile_mode else f"; median of {reps}")]
    if not accel and not compile_mode:
        head.append("CPU: the Pallas kernels are not timed (no native lowering; interpret mode measures nothing "
                    "useful); the XLA reference only, at small sizes. Use --tpu-compile for the TPU kernels.")
    if compile_mode:
        head.append(f"per device: batch split over {len(devs)} devices (B rounded up to a multiple); "
                    f"'ref/kern bytes' = XLA bytes accessed, reference / kernel")
    print("\n".join(head), flush=True)

    rows = []
    key = jax.random.key(0, impl="unsafe_rbg")  # compiles and runs faster than threefry
    for b, t in sizes:
        for name in names:
            per_dev = -(-b // len(devs)) if compile_mode else b
            t0 = time.perf_counter()
            try:
                case = make_case(name, per_dev, t, w, chunk, backend)
            except Exception as e:  # noqa: BLE001
                rows.append(dict(kernel=name, batch=b, ctx=t, impl="both", bytes=0, flops=None, error=err_text(e)))
                continue
            if compile_mode:
                new = compile_tpu(case, mesh, len(devs), memory, not opts.no_reference)
            else:
                new = measure(case, reps, accel, memory, key)
            rows += new
            print(f"  {name} {b}x{label(t)}: {time.perf_counter() - t0:.1f}s"
                  + "".join(f" [{r['impl']}: {r.get('error') or r.get('skipped')}]" for r in new
                            if r.get("error") or r.get("skipped")), file=sys.stderr, flush=True)
    derive(rows, peaks)
    print(table(rows, compile_mode))
    for line in target_lines(rows, compile_mode):
        print(line)
    if opts.json:
        Path(opts.json).write_text(json.dumps(dict(device_kind=kind, backend=backend, peaks=peaks,
                                                   topology=opts.tpu_compile, widths=w, chunk=chunk, reps=reps,
                                                   memory_bytes=memory, targets=TARGETS, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
