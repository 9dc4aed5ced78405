"""Prefix cache report (DESIGN §7): persisted bytes per token, time to first token, replay deviation.

  python scripts/prefix_cache_report.py                       # small config, 32K-token prompt
  python scripts/prefix_cache_report.py --tokens 4096 --json

Bytes: the store's files per cached token (headers and checksums included) against the accounting
(`dsv41.kv_bytes_per_token`, global KV only) and against a V4-style cache that also persists the window
rings per block; analytic figures for the full-size V4.1-Flash at several block sizes beside them.
Time to first token (`small` config, random weights, compile excluded by a warm-up at the same
capacity): cold (empty store), a pool hit (global KV from disk + rings from the pool) and a replay
(global KV from disk, pool empty: the last replay tokens run again).
Replay deviation: the same prompt restored with replays of 32, 64, 128 and 256 tokens (the window
is set to --window so that such replays are allowed) against the exact restore: max |Δ logits| of the
first token and the agreement of --greedy greedy tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import dsv41
from dsv41 import accounting, steps
from dsv41 import prefix_cache as pc_lib
from dsv41.cache import init_cache, round_capacity


def ring_bytes_per_block(cfg) -> int:
    """The window rings of one sequence as the pool keeps them: every layer's FP8 ring + scales + start."""
    c = jax.eval_shape(lambda: init_cache(cfg, 1, round_capacity(cfg, 1)))
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for n in ("window", "window_scales", "window_start") for x in jax.tree.leaves(getattr(c, n)))


def analytic(cfg, block: int) -> dict:
    per_token = float(accounting.kv_bytes_per_token(cfg)["total"])
    rings = ring_bytes_per_block(cfg) / block
    return {"block_tokens": block, "global_only": per_token, "v4_style": per_token + rings,
            "ratio": (per_token + rings) / per_token}


def timed(fn):
    t = time.perf_counter()
    out = fn()
    jax.block_until_ready(out[0])
    return time.perf_counter() - t, out


def greedy_tail(params, cfg, logits, cache, n):
    out = []
    for _ in range(n):
        token = int(np.argmax(np.asarray(logits)[0]))
        out.append(token)
        logits, cache = steps.decode(params, cfg, cache, [token])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="small")
    ap.add_argument("--tokens", type=int, default=32768, help="prompt length for the time to first token")
    ap.add_argument("--block", type=int, default=256, help="block_tokens of the store")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--window", type=int, default=256, help="window for the replay-deviation runs")
    ap.add_argument("--deviation-tokens", type=int, default=1024, help="prompt length of the deviation runs")
    ap.add_argument("--replays", default="32,64,128,256")
    ap.add_argument("--greedy", type=int, default=64)
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    report: dict = {"config": args.config}

    cfg = dsv41.load_config(args.config)
    params = dsv41.init_params(cfg, jax.random.key(0))
    vocab = cfg.architecture.vocab_size
    rng = np.random.default_rng(0)

    # -- bytes -------------------------------------------------------------------------------
    full = dsv41.load_config("v41_flash")
    report["bytes_full_size"] = [analytic(full, b) for b in (128, 256, 512, 1024)]
    report["bytes_config"] = analytic(cfg, args.block)

    # -- time to first token -----------------------------------------------------------------
    if not args.skip_ttft:
        n = args.tokens
        cap = round_capacity(cfg, n + args.block)
        prompt = rng.integers(0, vocab, n).tolist()
        with tempfile.TemporaryDirectory() as d:
            warm = pc_lib.PrefixCache(cfg, params, Path(d) / "warm", block_tokens=args.block)
            short = rng.integers(0, vocab, 2 * args.block + 1).tolist()
            warm.prefill([short], cap, chunk=args.chunk)       # compiles the prefill step
            pc_lib.PrefixCache(cfg, params, Path(d) / "warm", block_tokens=args.block).restore([short], cap)  # replay
            pc = pc_lib.PrefixCache(cfg, params, Path(d) / "store", block_tokens=args.block)
            t_cold, (cold_logits, _, _) = timed(lambda: pc.prefill([prompt], cap, chunk=args.chunk))
            files = list((Path(d) / "store").glob("*.kv"))
            stored = sum(f.stat().st_size for f in files)
            t_pool, (pool_logits, _, info_pool) = timed(lambda: pc.prefill([prompt], cap, chunk=args.chunk))
            fresh = pc_lib.PrefixCache(cfg, params, Path(d) / "store", block_tokens=args.block)
            t_replay, (replay_logits, _, info_replay) = timed(lambda: fresh.prefill([prompt], cap, chunk=args.chunk))
        report["bytes_measured"] = {"files": len(files), "bytes_per_token": stored / (len(files) * args.block),
                                    "accounting": float(accounting.kv_bytes_per_token(cfg)["total"])}
        report["ttft_s"] = {"tokens": n, "cold": t_cold, "pool_hit": t_pool, "replay": t_replay,
                            "restored_tokens": info_pool[0].n_cached,
                            "pool_exact": bool(np.array_equal(np.asarray(pool_logits), np.asarray(cold_logits))),
                            "replay_max_abs_dlogits": float(np.abs(np.asarray(replay_logits) -
                                                                   np.asarray(cold_logits)).max()),
                            "rings": [info_pool[0].rings, info_replay[0].rings]}

    # -- replay deviation --------------------------------------------------------------------
    wide = dsv41.config.build(cfg.to_dict(), [f"kv_cache.swa_window_size={args.window}",
                                              f"swa_bounded_replay.encoder_replay_tokens={args.window}",
                                              f"swa_bounded_replay.decoder_replay_tokens={args.window}"])
    n = args.deviation_tokens
    cap = round_capacity(wide, n + args.greedy + args.block)
    prompt = rng.integers(0, vocab, n).tolist()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        exact = pc_lib.PrefixCache(wide, params, d, block_tokens=args.block)
        logits, cache, _ = exact.prefill([prompt], cap, chunk=args.chunk)
        ref_logits = np.asarray(logits)
        ref_tokens = greedy_tail(params, wide, logits, cache, args.greedy)
        for r in (int(x) for x in args.replays.split(",")):
            pc = pc_lib.PrefixCache(wide, params, d, block_tokens=args.block, replay_tokens=(r, r))
            logits, cache, info = pc.prefill([prompt], cap, chunk=args.chunk)
            assert info[0].rings == "replay", info
            tokens = greedy_tail(params, wide, logits, cache, args.greedy)
            rows.append({"replay": r, "restored": info[0].n_cached,
                         "max_abs_dlogits": float(np.abs(np.asarray(logits) - ref_logits).max()),
                         "logit_std": float(ref_logits.std()),
                         "greedy_agreement": float(np.mean(np.array(tokens) == np.array(ref_tokens)))})
            say(f"replay {r}: {rows[-1]}")
    report["replay_deviation"] = {"window": args.window, "prompt": n, "rows": rows}

    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print("persisted bytes per token (global KV only vs V4-style with rings per block):")
    for a in report["bytes_full_size"]:
        print(f"  v41_flash block {a['block_tokens']:5d}: {a['global_only']:8.1f} vs {a['v4_style']:9.1f}"
              f"  ({a['ratio']:.1f}x)")
    a = report["bytes_config"]
    print(f"  {args.config} block {a['block_tokens']}: {a['global_only']:.1f} vs {a['v4_style']:.1f} ({a['ratio']:.1f}x)")
    if "bytes_measured" in report:
        m = report["bytes_measured"]
        print(f"  measured on disk: {m['bytes_per_token']:.2f} B/token over {m['files']} files "
              f"(accounting {m['accounting']:.1f})")
        t = report["ttft_s"]
        print(f"time to first token, {t['tokens']} tokens: cold {t['cold']:.2f} s, pool hit {t['pool_hit']:.2f} s, "
              f"replay {t['replay']:.2f} s (restored {t['restored_tokens']}; pool exact: {t['pool_exact']}; "
              f"replay max|dlogits| {t['replay_max_abs_dlogits']:.3g})")
    print(f"replay deviation (window {args.window}, prompt {n}):")
    for r in rows:
        print(f"  replay {r['replay']:4d}: max|dlogits| {r['max_abs_dlogits']:.3g} (logit std {r['logit_std']:.3g}),"
              f" greedy agreement {r['greedy_agreement']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
