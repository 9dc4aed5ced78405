"""Where a full-size step's compile time goes: XLA compile seconds and the fusions of the optimised module,
per computation (the entry and each loop body), for V4.1-Flash compiled for a TPU topology on this CPU.

    JAX_PLATFORMS=cpu python scripts/compile_fusions.py --seq 1            # decode
    JAX_PLATFORMS=cpu python scripts/compile_fusions.py --seq 256 --set runtime.score_tile=1048576
    JAX_PLATFORMS=cpu python scripts/compile_fusions.py --seq 256 --stages   # libtpu's stages and bundle count
    JAX_PLATFORMS=cpu python scripts/compile_fusions.py --seq 256 --stages --one-chip --stacks 0 --stub moe

The step is the one `dsv41 compile-report` compiles (`compile_report.step_program`, every chip on
`expert`, the XLA path: `--kernels reference`), with the persistent compilation cache off. The TPU
backend's time follows the number of fusions it compiles and their shapes (docs/compile_time.md).

Part by part: `--one-chip` compiles the program of one chip of the topology (its rows, batch / chips, and its
share of the routed experts) without the partitioner; `--stacks i,j` runs only those of the plan's layer stacks
(`plan.layer_stacks`; the others return what they were given, so a stack that reads a layer outside it needs
that layer's stack too: the Reindex groups read layer 20); `--stub parts` replaces parts of a layer by cheap
functions of the same shapes (`moe`, `mixes`: mHC's mixing coefficients, `expand`: mHC's expand to a plain
residual add, `attention`: the whole cached attention layer, `core`: the softmax over window keys and picks,
`engram`). These patch the model's methods in this process only: a diagnostic of where compile time goes, not a
model. Needs libtpu (the `tpu` extra)."""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["DSV41_COMPILE_CACHE"] = "off"
if "--stages" in sys.argv:  # libtpu logs its compile stages at INFO; it reads these when it loads
    os.environ.update(TPU_STDERR_LOG_LEVEL="0", TPU_MIN_LOG_LEVEL="0")

import jax.numpy as jnp  # noqa: E402

import dsv41  # noqa: E402
from dsv41 import compile_report as cr, plan as plan_lib, sharding as sh  # noqa: E402
from dsv41.nn import attention, mhc, moe  # noqa: E402
from dsv41.nn import model as model_lib  # noqa: E402

FUSION = re.compile(r"= [^=]*\bfusion\(")
COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{$")


def fusions_per_computation(hlo_text: str) -> collections.Counter:
    counts, comp = collections.Counter(), None
    for line in hlo_text.splitlines():
        m = COMPUTATION.match(line)
        if m:
            comp = m.group(2)
        elif FUSION.search(line):
            counts[comp] += 1
    return counts


STAGE = re.compile(r"(\w+) stage duration: (?:(\d+)m)?([\d.]+)s|final program bundle count: ([\d,]+)")


@contextlib.contextmanager
def captured_stderr(into: list):
    """Appends what the process writes to file descriptor 2 (libtpu's C++ log included) inside the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            into.append(f.read().decode(errors="replace"))


def stages(log: str) -> list[str]:
    """libtpu's stage durations and its program's bundle count, from its log."""
    out = []
    for m in STAGE.finditer(log):
        if m.group(4):
            out.append(f"bundles {m.group(4)}")
        else:
            out.append(f"{m.group(1)} {60 * int(m.group(2) or 0) + float(m.group(3)):.1f} s")
    return out


STUBS = ("moe", "mixes", "expand", "attention", "core", "engram")


def only_stacks(chosen: list):
    """Runs only the stacks in `chosen` (`plan.Stack`s; the others return what they were given)."""
    run = model_lib.LayerStack.run

    def gated(self, layer_fn, carry, published, **kwargs):
        if self.spec not in chosen:
            return carry, published, None
        return run(self, layer_fn, carry, published, **kwargs)

    model_lib.LayerStack.run = gated


def stub(parts):
    """Replaces `parts` (of STUBS) by cheap functions of the same shapes."""
    if "moe" in parts:
        moe.MoE.__call__ = lambda self, x, *a, **k: x * 0.5
    if "mixes" in parts:
        def mixes(self, x):
            ones = (x.sum(-1) * 0 + 1).astype(jnp.float32)
            return ones, ones, jnp.broadcast_to(ones[..., None], (*ones.shape, x.shape[-2]))
        mhc.HyperConnection.mixes = mixes
    if "expand" in parts:
        mhc.expand = lambda y, x, post, comb: (x.astype(jnp.float32) + post[..., None] * y.astype(
            jnp.float32)[..., None, :]).astype(x.dtype)
    if "attention" in parts:  # step(x, positions, valid, lengths, ring, window_start, published, stores, …)
        attention.Attention.step = lambda self, x, *a, **k: (x * 0.5, (a[3], a[6], None))
    if "core" in parts:
        attention.attend_step = lambda q, *a, **k: q
    if "engram" in parts:
        model_lib.Transformer.engram_step = lambda self, at, x, ids: x


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="v41_flash")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--seq", type=int, default=1, help="new tokens per row: 1 = decode, more = a prefill chunk")
    p.add_argument("--topology", default="v5p:2x2x2")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=1_000_000)
    p.add_argument("--weight-format", default="shipped", choices=("shipped", "bf16"))
    p.add_argument("--top", type=int, default=12, help="computations listed")
    p.add_argument("--stages", action="store_true",
                   help="also print libtpu's compile stages (HLO passes, backend passes, code generation) and the "
                        "program's bundle count, from its log")
    p.add_argument("--one-chip", action="store_true",
                   help="compile one chip's program: batch / chips rows and its share of the routed experts")
    p.add_argument("--stacks", default="", help="comma-separated indices into the plan's layer stacks to run "
                                                "(default: all)")
    p.add_argument("--stub", default="", help=f"comma-separated parts to stub out: {', '.join(STUBS)}")
    p.add_argument("--hlo-out", default="", metavar="PATH", help="also write the optimised HLO text there")
    args = p.parse_args(argv)
    parts = [x for x in args.stub.split(",") if x]
    if set(parts) - set(STUBS):
        p.error(f"--stub: {sorted(set(parts) - set(STUBS))}: expected some of {', '.join(STUBS)}")
    devices = cr.topology_devices(args.topology)
    overrides, batch = list(args.set), args.batch
    if args.one_chip:
        chips = len(devices)
        experts = dsv41.load_config(args.config, overrides=args.set).architecture.moe.num_experts
        if batch % chips or experts % chips:
            p.error(f"--one-chip: batch {batch} and {experts} experts: expected multiples of the {chips} chips")
        overrides.append(f"architecture.moe.num_experts={experts // chips}")
        batch, devices = batch // chips, devices[:1]
    cfg = cr.report_config(dsv41.load_config(args.config, overrides=overrides), args.weight_format, "reference")
    stacks = plan_lib.layer_stacks(cfg)
    if args.stacks:
        chosen = [int(x) for x in args.stacks.split(",")]
        if any(not 0 <= x < len(stacks) for x in chosen):
            p.error(f"--stacks: {chosen}: expected indices in 0..{len(stacks) - 1} "
                    f"({', '.join(f'{i}: layers {st.layers[0]} x {st.groups}' for i, st in enumerate(stacks))})")
        only_stacks([stacks[x] for x in chosen])
    stub(parts)
    mesh = sh.make_mesh({"expert": len(devices)}, devices=devices)
    fn, inputs = cr.step_program(cfg, mesh, "serve", batch=batch, seq=args.seq,
                                 context=args.context, engram_host=True)
    t0 = time.perf_counter()
    lowered = fn.trace(*inputs).lower()
    log: list[str] = []
    t1 = time.perf_counter()
    with captured_stderr(log) if args.stages else contextlib.nullcontext():
        compiled = lowered.compile()
    t2 = time.perf_counter()
    counts = fusions_per_computation(compiled.as_text())
    if args.hlo_out:
        with open(args.hlo_out, "w") as f:
            f.write(compiled.as_text())
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**30
    where = f"one chip of {args.topology}" if args.one_chip else args.topology
    parts_run = f" stacks {args.stacks or 'all'} stubs {args.stub or '-'}" if args.stacks or parts else ""
    print(f"{args.config} {where} batch {batch} context {args.context} seq {args.seq} {overrides}{parts_run}: "
          f"lower {t1 - t0:.1f} s, XLA compile {t2 - t1:.1f} s, {sum(counts.values())} fusions, "
          f"temporaries {temp:.2f} GiB per chip")
    if args.stages:
        print("  libtpu: " + ", ".join(stages("".join(log)) or ["no stage lines in its log"]))
    for name, n in counts.most_common(args.top):
        print(f"  {n:5d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
