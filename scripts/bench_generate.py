#!/usr/bin/env python3
"""Tokens per second of `dsv41.generate` with the host decode loop (one dispatch per token from Python)
against the on-device loop (`loop="device"`: `lax.while_loop` over decode steps, a block of tokens per
call), side by side in one run, greedy, random weights, and whether their tokens are identical.

Each (loop, batch) generates --new tokens after a --prompt-token prompt per row: one warm-up call
compiles its programs, then --repeats timed calls of the same shapes; the figure is rows x new tokens /
best time (the prompt's one prefill chunk included in the time). The machine's other load (cores busy
with other processes, from /proc/loadavg before the run) is printed: compare figures of one run only.

    python scripts/bench_generate.py --config small --batch 1,8 --new 64
    python scripts/bench_generate.py --set 'architecture.engram={"layers": [1, 4], ...}'   # an Engram model
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

import dsv41
from dsv41 import generate as gen


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="small", help="config name or path (default small)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--batch", default="1,8", help="comma-separated batch sizes (default 1,8)")
    p.add_argument("--new", type=int, default=64, help="new tokens per row (default 64)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt tokens per row (default 16)")
    p.add_argument("--block", type=int, default=64, help="tokens per device-loop call (default 64)")
    p.add_argument("--capacity", type=int, default=None,
                   help="cache capacity in tokens (generate's max_len; default prompt + new tokens)")
    p.add_argument("--repeats", type=int, default=2, help="timed calls per cell, best kept (default 2)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    cfg = dsv41.load_config(args.config, overrides=args.set)
    params = dsv41.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    load = os.getloadavg()[0]
    rows = []
    for b in batches:
        prompts = rng.integers(0, cfg.architecture.vocab_size, (b, args.prompt_tokens)).tolist()
        outs, cell = {}, {"batch": b}
        for loop in ("host", "device"):
            run = lambda: gen.generate_batch(params, cfg, prompts, max_new_tokens=args.new, chunk=args.prompt_tokens,
                                             loop=loop, block=args.block, max_len=args.capacity)
            t0 = time.perf_counter()
            outs[loop] = run()
            cell[f"{loop}_first_call_s"] = round(time.perf_counter() - t0, 2)
            best = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - t0)
            cell[f"{loop}_tokens_per_s"] = round(b * args.new / best, 1)
        cell["device_over_host"] = round(cell["device_tokens_per_s"] / cell["host_tokens_per_s"], 2)
        cell["identical_tokens"] = outs["host"] == outs["device"]
        rows.append(cell)
        if not args.json:
            print(f"batch {b}: host {cell['host_tokens_per_s']} tok/s, device {cell['device_tokens_per_s']} tok/s "
                  f"({cell['device_over_host']}x), identical greedy tokens: {cell['identical_tokens']} "
                  f"(first calls incl. compile: host {cell['host_first_call_s']} s, device "
                  f"{cell['device_first_call_s']} s)", flush=True)
    out = {"config": cfg.model, "overrides": args.set, "new_tokens": args.new, "prompt_tokens": args.prompt_tokens, "block": args.block,
           "capacity": args.capacity,
           "backend": jax.default_backend(), "load_average_before": load, "rows": rows}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"({jax.default_backend()}, 1-minute load average before the run: {load:.2f})")


if __name__ == "__main__":
    main()
