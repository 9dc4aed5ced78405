#!/usr/bin/env python3
"""Decode tokens/s and prefill tokens/s of one model with its weights held as shipped (FP8 / MXFP4 with UE8M0
scales, dequantised in every matmul: `runtime.weight_format=shipped`) against the same weights in bf16, side
by side in one run (issue 55's CPU benchmark; random weights drawn in the shipped formats, the bf16 model is
them dequantised, so both compute the same model).

Per (format, batch): `steps.bind` the model, one prefill chunk of --prompt tokens a row and --steps decode
steps, all compiled in a warm-up on a throwaway cache first; the timed figures are steady state, the best of
--repeats. Decode tokens/s = rows × steps / time; prefill tokens/s = rows × prompt tokens / time. On a CPU the
dequantisation is paid inside the dot (XLA fuses the decode of the values and the scales into its operand),
so `shipped / bf16` below 1 is the cost of holding a quarter to half the bytes; on a TPU the Pallas kernels
dequantise in VMEM. The machine's other load (/proc/loadavg before the run) is printed: compare figures of
one run only.

    python scripts/bench_weights.py                      # small, batch 1 and 8
    python scripts/bench_weights.py --config tiny --batch 1 --steps 8 --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import numpy as np

from dsv41 import cache as cache_lib
from dsv41 import model, steps
from dsv41.config import load_config, weight_format_overrides
from dsv41.nn import weights


def models(name: str, extra: list[str]):
    """{format: (cfg, params)}: a model drawn in the shipped formats and the same weights in bf16."""
    cfg = load_config(name, [*extra, *weight_format_overrides("shipped")])
    bcfg = load_config(name, [*extra, *weight_format_overrides("bf16")])
    params = model.init_params(cfg, jax.random.key(0))
    abstract = model.abstract_params(bcfg)
    plain = jax.tree.map(lambda a, s: a.astype(s.dtype), weights.widened(params), abstract)
    return {"shipped": (cfg, params), "bf16": (bcfg, plain)}


def best(fn, repeats: int) -> float:
    """The shortest of `repeats` timed calls of fn()."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(cfg, params, batch: int, prompt: int, n_steps: int, repeats: int) -> dict:
    run = steps.bind(params, cfg)
    vocab = cfg.architecture.vocab_size
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (batch, prompt), dtype=np.int32)
    nxt = rng.integers(0, vocab, (n_steps, batch), dtype=np.int32)
    cap = prompt + n_steps

    def prefill():
        logits, cache = run.prefill(cache_lib.init_cache(cfg, batch, cap), tokens)
        jax.block_until_ready(logits)
        return cache

    def decode(cache):
        for t in range(n_steps):
            logits, cache = run.decode(cache, nxt[t])
        jax.block_until_ready(logits)

    t0 = time.perf_counter()
    decode(prefill())                                   # compiles both programs
    compile_s = time.perf_counter() - t0
    prefill_s = best(prefill, repeats)
    decode_s = float("inf")
    for _ in range(repeats):                            # each run on a cache of its own (the steps donate it)
        filled = prefill()
        t0 = time.perf_counter()
        decode(filled)
        decode_s = min(decode_s, time.perf_counter() - t0)
    return {"compile_s": round(compile_s, 2), "prefill_tok_s": round(batch * prompt / prefill_s, 1),
            "decode_tok_s": round(batch * n_steps / decode_s, 1)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="small", help="config name or path (default small)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--batch", default="1,8", help="comma-separated batch sizes (default 1,8)")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens a row, one prefill chunk (default 256)")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per figure, best kept (default 3)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    load = os.getloadavg()[0]
    held = models(args.config, args.set)
    rows = []
    for b in batches:
        cell = {"batch": b}
        for fmt in ("bf16", "shipped"):
            cell[fmt] = measure(*held[fmt], b, args.prompt, args.steps, args.repeats)
        for what in ("decode_tok_s", "prefill_tok_s"):
            cell[f"{what}_ratio"] = round(cell["shipped"][what] / cell["bf16"][what], 3)
        rows.append(cell)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {load:.2f} before the run"
    result = {"config": args.config, "overrides": args.set, "prompt": args.prompt, "steps": args.steps,
              "backend": jax.default_backend(), "machine": machine, "rows": rows}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.config}: prompt {args.prompt} tokens a row, {args.steps} decode steps; {jax.default_backend()}, "
          f"{machine}")
    print(f"{'batch':>5}  {'decode tok/s bf16':>17}  {'shipped':>8}  {'ratio':>6}  "
          f"{'prefill tok/s bf16':>18}  {'shipped':>8}  {'ratio':>6}")
    for r in rows:
        print(f"{r['batch']:>5}  {r['bf16']['decode_tok_s']:>17}  {r['shipped']['decode_tok_s']:>8}  "
              f"{r['decode_tok_s_ratio']:>6}  {r['bf16']['prefill_tok_s']:>18}  {r['shipped']['prefill_tok_s']:>8}  "
              f"{r['prefill_tok_s_ratio']:>6}")


if __name__ == "__main__":
    main()
