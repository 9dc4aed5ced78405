#!/usr/bin/env python3
"""Where a decode step's time goes: `bench_decode.py`'s `dsv41-v4` model (transformers' toy V4 at width
128, 6 layers, converted) prefilled to a context, then N greedy decode steps under `jax.profiler`
(`--prefill`: the prefill itself, chunk by chunk, after a warm-up on a throwaway cache).

Prints the step's wall time split into the host's part (Python, argument handling, dispatch: the time
`dsv41.decode` takes to return before the result is ready) and the device's, then the XLA operations
(fusions, custom calls, copies, loops) that take the most time per step, summed over the steps from the
profiler's trace of the CPU client's thunks. The machine's other load is printed: compare runs only
side by side.

    python scripts/profile_decode.py --context 2K --batch 8
    python scripts/profile_decode.py --context 8K --batch 1 --steps 50 --top 30
    python scripts/profile_decode.py --prefill --context 8K --batch 1 --chunk 1024
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode  # noqa: E402  (the model and prompt of the bench)


def load_average() -> float:
    return os.getloadavg()[0]


def trace_events(directory: Path) -> list[dict]:
    files = sorted(directory.rglob("*.trace.json.gz")) or sorted(directory.rglob("perfetto_trace.json.gz"))
    if not files:
        raise SystemExit(f"profile: no trace file under {directory}: expected jax.profiler's *.trace.json.gz")
    with gzip.open(files[-1], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", default="2K", help="prompt tokens before the decode steps (default 2K)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=30, help="profiled decode steps (default 30)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (default 512)")
    p.add_argument("--top", type=int, default=25, help="operations listed (default 25)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill", action="store_true",
                   help="profile the prompt's prefill chunks instead of decode steps (per chunk)")
    args = p.parse_args(argv)
    if args.batch < 1 or args.steps < 1 or args.chunk < 1:
        p.error(f"--batch {args.batch}, --steps {args.steps}, --chunk {args.chunk}: expected positive integers")
    ctx = bench_decode.parse_context(args.context)

    import jax
    import numpy as np

    import dsv41
    from dsv41.plan import layer_plan

    reference = bench_decode.hf_model(args.seed)
    cfg = dsv41.config_from_transformers(reference.config.to_dict())
    params = dsv41.params_from_transformers(reference.state_dict(), cfg)
    del reference
    step = math.lcm(*sorted({r.ratio for r in layer_plan(cfg) if r.ratio}))
    max_len = -(-(ctx + 2 * args.steps + 2) // step) * step
    tokens = bench_decode.prompt(args.seed, cfg.architecture.vocab_size, ctx, args.batch)
    chunk = min(args.chunk, ctx)
    bound = dsv41.bind(params, cfg)  # as a serving loop holds them: the parameters flattened once

    def prefill_all():
        cache = dsv41.init_cache(cfg, args.batch, max_len)
        for start in range(0, ctx, chunk):
            piece = tokens[:, start:start + chunk]
            n = piece.shape[1]
            logits, cache = bound.prefill(cache, np.pad(piece, [(0, 0), (0, chunk - n)]), lengths=[n] * args.batch)
        return jax.block_until_ready(logits), cache

    logits, cache = prefill_all()  # compiles (and is the decode steps' context)
    if args.prefill:
        units, what = -(-ctx // chunk), f"prefill chunk of {chunk}"
        t0 = time.perf_counter()
        prefill_all()
        total = host = [(time.perf_counter() - t0) / units]
        with tempfile.TemporaryDirectory() as d:
            jax.profiler.start_trace(d)
            prefill_all()
            jax.profiler.stop_trace()
            events = trace_events(Path(d))
    else:
        units, what = args.steps, "step"
        nxt = np.asarray(logits).argmax(-1)
        for _ in range(3):  # compile and warm up
            logits, cache = bound.decode(cache, nxt)
            nxt = np.asarray(logits).argmax(-1)

        host, total = [], []
        for _ in range(args.steps):  # unprofiled: the step's host part (until decode returns) and its whole time
            t0 = time.perf_counter()
            logits, cache = bound.decode(cache, nxt)
            t1 = time.perf_counter()
            nxt = np.asarray(logits).argmax(-1)
            host.append(t1 - t0)
            total.append(time.perf_counter() - t0)

        with tempfile.TemporaryDirectory() as d:
            jax.profiler.start_trace(d)
            for _ in range(args.steps):
                logits, cache = bound.decode(cache, nxt)
                nxt = np.asarray(logits).argmax(-1)
            jax.profiler.stop_trace()
            events = trace_events(Path(d))

    per_op = collections.defaultdict(float)
    count = collections.Counter()
    threads = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = e["args"]["name"]
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        per_op[e["name"]] += e["dur"] / 1e3
        count[e["name"]] += 1
    # XLA's operations (thunks) by kind: the name before its number (copy.549 -> copy); host-side Python
    # frames ($file:line) and the runtime's own events are left out.
    kinds = collections.defaultdict(float)
    kind_count = collections.Counter()
    for name, ms in per_op.items():
        if name.startswith("$") or " " in name or "::" in name or "(" in name:
            continue
        kind = name.split(".")[0]
        kinds[kind] += ms
        kind_count[kind] += count[name]
    med = float(np.median(total)) * 1e3
    kind = f"prefill chunks of {chunk}" if args.prefill else f"decode, {args.steps} steps"
    print(f"dsv41-v4 {kind}, batch {args.batch}, context {bench_decode.fmt_context(ctx)} (capacity {max_len}); "
          f"load average {load_average():.2f} on {os.cpu_count()} cores")
    if args.prefill:
        print(f"{what}: {med:.1f} ms on average ({args.batch * chunk / med * 1e3:.0f} tokens/s)")
    else:
        print(f"step: median {med:.2f} ms ({args.batch / med * 1e3:.0f} tokens/s); until decode returns "
              f"(host: Python, checks, dispatch) median {float(np.median(host)) * 1e3:.2f} ms")
    print(f"\nXLA operations by kind, ms per {what} (a loop counts its body's operations again):")
    for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {kind:<24} {ms / units:8.3f}  x{kind_count[kind] / units:.0f}")
    print(f"\nprofiled events, ms per {what} (sum over all threads; nested events counted in each):")
    width = max((len(n) for n in per_op), default=10)
    width = min(width, 90)
    for name, ms in sorted(per_op.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {name[:width]:<{width}}  {ms / units:8.3f}  x{count[name] / units:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
