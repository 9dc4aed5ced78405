#!/usr/bin/env python3
"""One training step against the sequence length: the whole-sequence forward (`runtime.query_block=0`, every
query at once, memory ~S²) beside the blockwise one (`runtime.query_block`, memory ~S), each S in a fresh
process so that its peak RSS is its own.

Per (S, form): compile seconds (lowering + XLA), the time of one step after it (best of --repeats), the
process's peak RSS (compile included), the peak RSS while the compiled steps run ("step peak": Linux's
VmHWM, reset after the compile), and XLA's own estimate of the step's memory (arguments + outputs + temporaries,
`compiled.memory_analysis()`), which is printed even where the step is not run (--estimate-only forms, or
an estimate above --max-gib). Batch --batch rows of synthetic passkey data, `train.make_train_step` with the
default TrainConfig (or --set train fields). The machine's load (/proc/loadavg) is printed before each run:
compare figures of one run only.

With --mesh (e.g. context=8) the step runs sequence parallel on that many simulated CPU devices
(`train.make_train_step(..., mesh=)`); XLA's estimate is then per device, the RSS the whole process's (every
device's).

    python scripts/bench_train.py --config passkey --seqs 1024,4096,16384 --forms blockwise,dense
    python scripts/bench_train.py --seqs 65536 --forms blockwise --json
    python scripts/bench_train.py --seqs 16384 --forms blockwise --mesh context=8 --estimate-only blockwise
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time


def one(args) -> dict:
    import resource

    import jax
    import numpy as np

    import dsv41
    from dsv41 import data as data_lib
    from dsv41 import train

    block = 0 if args.form == "dense" else args.query_block
    cfg = dsv41.load_config(args.config, overrides=[*args.set, f"runtime.query_block={block}"])
    tc = train.TrainConfig().replace(dict(kv.split("=", 1) for kv in args.train))
    state = train.init_state(cfg, tc, jax.random.key(0))
    batch = {k: jax.numpy.asarray(v) for k, v in
             next(data_lib.Synthetic("passkey", args.batch, args.seq, seed=0)).items()}
    mesh = None
    if args.mesh:
        from dsv41 import sharding
        mesh = sharding.make_mesh(sharding.parse_mesh(args.mesh))
        state, batch = train.shard_state(state, cfg, tc, mesh), train.shard_batch(cfg, batch, mesh)
    step = train.make_train_step(cfg, tc, mesh=mesh)
    t0 = time.perf_counter()
    compiled = step.jitted.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    estimate = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes) / 2**30
    out = {"seq": args.seq, "form": args.form, "query_block": block, "compile_s": round(compile_s, 2),
           "xla_estimate_gib": round(estimate, 3)}
    if args.estimate_only or estimate > args.max_gib:
        return {**out, "step_s": None, "peak_rss_gib": None, "step_peak_rss_gib": None, "loss": None}
    reset = os.path.exists("/proc/self/clear_refs")
    if reset:  # Linux: the high-water mark restarts here, so step_peak excludes the compile's own memory
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)  # (donated on a mesh)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux, the whole process's
    step_peak = _vm_hwm_gib() if reset else None
    return {**out, "step_s": round(min(times), 2), "peak_rss_gib": round(rss, 3),
            "step_peak_rss_gib": None if step_peak is None else round(step_peak, 3), "loss": float(metrics["loss"])}


def _vm_hwm_gib() -> float:
    """The process's peak resident set since the last reset (/proc/self/status VmHWM), GiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError("/proc/self/status: no VmHWM line")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="passkey", help="config name or path (default passkey)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--train", action="append", default=[], metavar="FIELD=VALUE", help="override a TrainConfig field")
    p.add_argument("--seqs", default="1024,4096,16384", help="comma-separated sequence lengths")
    p.add_argument("--forms", default="blockwise,dense", help="blockwise and/or dense")
    p.add_argument("--query-block", type=int, default=512, help="queries per block of the blockwise form")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="timed steps after the compile, best kept")
    p.add_argument("--max-gib", type=float, default=20.0,
                   help="run a step only where XLA's estimate is at most this (default 20 GiB)")
    p.add_argument("--estimate-only", default="", help="forms only compiled, never run (e.g. dense)")
    p.add_argument("--mesh", default="", metavar="AXIS=N,...",
                   help="run on a mesh of simulated CPU devices, e.g. context=8 (sequence parallel)")
    p.add_argument("--json", action="store_true", help="one JSON object per line on stdout")
    p.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    p.add_argument("--form", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.seq is not None:  # the child: one (S, form)
        args.estimate_only = args.form in args.estimate_only.split(",")
        print(json.dumps(one(args)))
        return 0
    forms = args.forms.split(",")
    for form in forms:
        if form not in ("blockwise", "dense"):
            p.error(f"--forms: {form!r}: expected blockwise or dense")
    if not args.json:
        print(f"{'S':>7} {'form':>9} {'compile s':>9} {'step s':>8} {'peak RSS GiB':>12} {'step peak':>9} "
              f"{'XLA GiB':>9}  load")
    for seq in (int(s) for s in args.seqs.split(",")):
        for form in forms:
            load = open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"
            cmd = [sys.executable, __file__, "--seq", str(seq), "--form", form, "--config", args.config,
                   "--query-block", str(args.query_block), "--batch", str(args.batch), "--repeats", str(args.repeats),
                   "--max-gib", str(args.max_gib), "--estimate-only", args.estimate_only, f"--mesh={args.mesh}",
                   *[f"--set={s}" for s in args.set], *[f"--train={t}" for t in args.train]]
            env = dict(os.environ)
            if args.mesh:
                from dsv41 import sharding
                devices = math.prod(sharding.parse_mesh(args.mesh).values())
                env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
            run = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if run.returncode:
                row = {"seq": seq, "form": form, "error": run.stderr.strip().splitlines()[-1:]}
            else:
                row = json.loads(run.stdout.strip().splitlines()[-1])
            row["load"] = load
            if args.json:
                print(json.dumps(row), flush=True)
            elif "error" in row:
                print(f"{seq:>7} {form:>9}  failed: {row['error']}", flush=True)
            else:
                fmt = lambda v: "-" if v is None else v
                print(f"{seq:>7} {form:>9} {row['compile_s']:>9} {fmt(row['step_s']):>8} {fmt(row['peak_rss_gib']):>12} "
                      f"{fmt(row['step_peak_rss_gib']):>9} {row['xla_estimate_gib']:>9}  {load}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
