#!/usr/bin/env python3
"""What XLA:CPU's batch-invariant options (`dsv41.xla_options`: YNNPACK fusions off) cost: the
teacher-forced forward and a prefill chunk, compiled with and without them in one process, timed
interleaved (median of --reps calls each, steady state), and their last-row logits compared.

    python scripts/bench_batch_invariance.py --config small --seq 512 --batch 1

Prints one row per program: seconds without the options, with them, the ratio, and the largest
difference of the two programs' logits (under qat a rounding difference can flip an FP8 value).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import numpy as np

import dsv41
from dsv41 import cache as cache_lib
from dsv41 import model as model_lib
from dsv41 import steps, xla_options


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="small", help="a shipped config name or a config file")
    ap.add_argument("--seq", type=int, default=512, help="tokens per row")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    if jax.default_backend() != "cpu":
        raise SystemExit(f"backend {jax.default_backend()!r}: these options are XLA:CPU's")
    cfg = dsv41.load_config(args.config)
    key = model_lib.config_key(cfg)
    params = model_lib.init_params(cfg, jax.random.key(0))
    leaves, treedef = jax.tree.flatten(params)
    vocab = int(cfg.architecture.vocab_size)
    tokens = np.random.default_rng(0).integers(3, vocab, (args.batch, args.seq)).astype(np.int32)
    positions = np.broadcast_to(np.arange(args.seq, dtype=np.int32), tokens.shape)
    ids = model_lib.engram_ids(cfg, tokens)
    counts = np.full((args.batch,), args.seq, np.int32)
    options = {"off": None, "on": xla_options.compiler_options()}
    print(f"# {args.config}, batch {args.batch} x {args.seq} tokens, {args.reps} reps, "
          f"load {os.getloadavg()[0]:.2f} at start; options: {options['on']}")
    programs = {}
    for name, opts in options.items():
        programs[("forward", name)] = (
            jax.jit(model_lib.forward_body, static_argnums=(0, 1, 6), compiler_options=opts),
            lambda: (key, None, params, tokens, positions, ids))
        programs[("prefill chunk", name)] = (
            jax.jit(lambda lv, c, t, n, i: steps.step_body(key, None, jax.tree.unflatten(treedef, lv), c, t, n, i),
                    donate_argnums=1, compiler_options=opts),
            lambda: (leaves, cache_lib.init_cache(cfg, batch=args.batch, max_len=args.seq), tokens, counts, ids))
    results = {}
    for (what, name), (fn, make) in programs.items():  # warm-up (compile) in the same order as the timing
        results[(what, name)] = [jax.block_until_ready(fn(*make())), []]
    for _ in range(args.reps):
        for (what, name), (fn, make) in programs.items():
            a = make()
            t = time.perf_counter()
            jax.block_until_ready(fn(*a))
            results[(what, name)][1].append(time.perf_counter() - t)
    print("| program | YNNPACK on (s) | batch-invariant (s) | ratio | max |Δ logits| last row |")
    print("|---|---:|---:|---:|---:|")
    for what in ("forward", "prefill chunk"):
        (out_off, t_off), (out_on, t_on) = results[(what, "off")], results[(what, "on")]
        last = lambda o: np.asarray(o[:, -1] if what == "forward" else o[0])  # noqa: E731
        diff = float(np.abs(last(out_off) - last(out_on)).max())
        m_off, m_on = statistics.median(t_off), statistics.median(t_on)
        print(f"| {what} | {m_off:.3f} | {m_on:.3f} | {m_on / m_off:.2f} | {diff:.1e} |")
    print(f"# load {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
