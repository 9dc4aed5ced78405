#!/usr/bin/env python3
"""Decode tokens per second by filled length against the cache's capacity (DESIGN §6: a row's cost follows
its length, not its slot): the same prompt prefilled into caches of several capacities, then --new decode
steps timed in each, side by side in one run, with the logits of every capacity compared to the first's.

The indexer of the cached steps scores only the filled tiles of its store (`runtime.score_tile`); the
window, the Reindex pool and the picked entries are fixed-size. Random weights; the figure is batch x new
tokens / best time of --repeats, the first decode (compile) excluded. The machine's other load
(/proc/loadavg before the run) is printed: compare figures of one run only.

    python scripts/bench_capacity.py --config small --filled 4096 --capacities 4160,65536
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

import dsv41
from dsv41 import cache as cache_lib
from dsv41 import steps


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="small", help="config name or path (default small)")
    p.add_argument("--filled", type=int, default=4096, help="prompt tokens per row (default 4096)")
    p.add_argument("--capacities", default="4160,65536", help="comma-separated cache capacities (default 4160,65536)")
    p.add_argument("--batch", type=int, default=1, help="rows (default 1)")
    p.add_argument("--new", type=int, default=32, help="timed decode steps (default 32)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (default 512)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per capacity, best kept (default 2)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    caps = [int(c) for c in args.capacities.split(",")]
    cfg = dsv41.load_config(args.config)
    params = dsv41.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.architecture.vocab_size, (args.batch, args.filled))
    nxt = rng.integers(0, cfg.architecture.vocab_size, (args.repeats + 1, args.new + 1, args.batch))
    load = os.getloadavg()[0]
    rows, first = [], None
    for cap in caps:
        cache = dsv41.init_cache(cfg, batch=args.batch, max_len=cap)
        t0 = time.perf_counter()
        for start in range(0, args.filled, args.chunk):
            logits, cache = steps.prefill(params, cfg, cache, prompt[:, start:start + args.chunk])
        jax.block_until_ready(logits)
        prefill_s = time.perf_counter() - t0
        best, out = float("inf"), None
        for r in range(args.repeats + 1):  # run 0 compiles
            c = jax.tree.map(lambda x: x.copy(), cache)
            c = cache_lib.with_mirror(c, cache.mirror.lengths, cache.mirror.recent_tokens)
            logits, c = steps.decode(params, cfg, c, nxt[r, 0])
            jax.block_until_ready(logits)
            t0 = time.perf_counter()
            for i in range(1, args.new + 1):
                logits, c = steps.decode(params, cfg, c, nxt[r, i])
            jax.block_until_ready(logits)
            if r:
                best = min(best, time.perf_counter() - t0)
                out = np.asarray(logits) if out is None else out
        first = out if first is None else first
        row = {"capacity": cap, "prefill_s": round(prefill_s, 2),
               "decode_tokens_per_s": round(args.batch * args.new / best, 1),
               "max_logit_diff_vs_first": float(np.abs(out - first).max())}
        rows.append(row)
        if not args.json:
            print(f"capacity {cap}: {args.filled} tokens prefilled in {row['prefill_s']} s (incl. compile), decode "
                  f"{row['decode_tokens_per_s']} tok/s, max |logit diff| vs capacity {caps[0]}: "
                  f"{row['max_logit_diff_vs_first']:.2e}", flush=True)
    ratio = rows[-1]["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"]
    result = {"config": cfg.model, "filled": args.filled, "batch": args.batch, "new": args.new,
              "backend": jax.default_backend(), "load_average_before": load, "rows": rows,
              "last_over_first": round(ratio, 3)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"decode at capacity {caps[-1]} / at {caps[0]}: {ratio:.3f}x "
              f"({jax.default_backend()}, 1-minute load average before the run: {load:.2f})")


if __name__ == "__main__":
    main()
