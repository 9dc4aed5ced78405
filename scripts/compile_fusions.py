"""Where a full-size step's compile time goes: XLA compile seconds and the fusions of the optimised module,
per computation (the entry and each loop body), for V4.1-Flash compiled for a TPU topology on this CPU.

    JAX_PLATFORMS=cpu python scripts/compile_fusions.py --seq 1            # decode
    JAX_PLATFORMS=cpu python scripts/compile_fusions.py --seq 256 --set runtime.score_tile=1048576

The step is the one `dsv41 compile-report` compiles (`compile_report.step_program`, every chip on
`expert`), with the persistent compilation cache off. The TPU
backend's time follows the number of fusions it compiles and their shapes (docs/compile_time.md).
Needs libtpu (the `tpu` extra)."""

from __future__ import annotations

import argparse
import collections
import os
import re
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["DSV41_COMPILE_CACHE"] = "off"

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
    args = p.parse_args(argv)
    cfg = cr.report_config(dsv41.load_config(args.config, overrides=args.set), args.weights, "reference")
    devices = cr.topology_devices(args.topology)
    mesh = sh.make_mesh({"expert": len(devices)}, devices=devices)
    fn, inputs = cr.step_program(cfg, mesh, "serve", weights=args.weights, batch=args.batch, seq=args.seq,
                                 context=args.context, engram_host=True)
    t0 = time.perf_counter()
    lowered = fn.trace(*inputs).lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    counts = fusions_per_computation(compiled.as_text())
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**30
    print(f"{args.config} {args.topology} batch {args.batch} context {args.context} seq {args.seq} {args.set}: "
          f"lower {t1 - t0:.1f} s, XLA compile {t2 - t1:.1f} s, {sum(counts.values())} fusions, "
          f"temporaries {temp:.2f} GiB per chip")
    for name, n in counts.most_common(args.top):
        print(f"  {n:5d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
