"""Where a full-size step's compile time goes: XLA compile seconds and the fusions of the optimised module,
per computation (the entry and each loop body), for V4.1-Flash compiled for a TPU topology on this CPU.

    JAX_PLATFORMS=cpu python scripts/compile_fusions.py --seq 1            # decode
    JAX_PLATFORMS=cpu python scripts/compile_fusions.py --seq 256 --set runtime.score_tile=1048576
    JAX_PLATFORMS=cpu python scripts/compile_fusions.py --seq 256 --stages   # libtpu's stages and bundle count

The step is the one `dsv41 compile-report` compiles (`compile_report.step_program`, every chip on
`expert`), with the persistent compilation cache off. The TPU
backend's time follows the number of fusions it compiles and their shapes (docs/compile_time.md).
Needs libtpu (the `tpu` extra)."""

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

import dsv41  # noqa: E402
from dsv41 import compile_report as cr, sharding as sh  # noqa: E402

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="v41_flash")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--seq", type=int, default=1, help="new tokens per row: 1 = decode, more = a prefill chunk")
    p.add_argument("--topology", default="v5p:2x2x2")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=1_000_000)
    p.add_argument("--weights", default="fp8", choices=("fp8", "bf16"))
    p.add_argument("--top", type=int, default=12, help="computations listed")
    p.add_argument("--stages", action="store_true",
                   help="also print libtpu's compile stages (HLO passes, backend passes, code generation) and the "
                        "program's bundle count, from its log")
    args = p.parse_args(argv)
    cfg = cr.report_config(dsv41.load_config(args.config, overrides=args.set), args.weights, "reference")
    devices = cr.topology_devices(args.topology)
    mesh = sh.make_mesh({"expert": len(devices)}, devices=devices)
    fn, inputs = cr.step_program(cfg, mesh, "serve", weights=args.weights, batch=args.batch, seq=args.seq,
                                 context=args.context, engram_host=True)
    t0 = time.perf_counter()
    lowered = fn.trace(*inputs).lower()
    log: list[str] = []
    t1 = time.perf_counter()
    with captured_stderr(log) if args.stages else contextlib.nullcontext():
        compiled = lowered.compile()
    t2 = time.perf_counter()
    counts = fusions_per_computation(compiled.as_text())
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**30
    print(f"{args.config} {args.topology} batch {args.batch} context {args.context} seq {args.seq} {args.set}: "
          f"lower {t1 - t0:.1f} s, XLA compile {t2 - t1:.1f} s, {sum(counts.values())} fusions, "
          f"temporaries {temp:.2f} GiB per chip")
    if args.stages:
        print("  libtpu: " + ", ".join(stages("".join(log)) or ["no stage lines in its log"]))
    for name, n in counts.most_common(args.top):
        print(f"  {n:5d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
