"""Passkey retrieval through the compressed cache (DESIGN §10): the trained demo model and its accuracy table.

`configs/passkey.json` is a small V4.1-plan model (window-only, Full, Reuse and Reindex layers; FP4
global cache) trained on CPU in six stages of passkey rows of 96 to 1,024 tokens (the README's "The
passkey model" gives them as `dsv41 train --task passkey` commands and the accuracy table). Its float32
weights ship beside the config as `configs/passkey.safetensors` (parameters and the MoE balance
biases, `convert.save_params`). Retrieval is measured the way a user runs the model: the prompt is
prefilled through the cache in chunks and the answer is decoded greedily (`generate_batch`), so every
digit comes back through the stored FP4 entries and FP8 window rings, never through a dense forward.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from dsv41 import config as config_lib
from dsv41 import data as data_lib
from dsv41.errors import ConfigError

CONFIG = "passkey"
DIGITS = 5


def weights_path():
    """The shipped trained weights of `configs/passkey.json`."""
    from dsv41.config import shipped_weights

    return shipped_weights(CONFIG)


def load_trained(overrides=(), path=None):
    """(cfg, params) of the shipped passkey model (`path`: another weights file of the same config)."""
    from dsv41.config import load_config

    from dsv41.convert import load_held

    cfg = load_config(CONFIG, overrides)
    return cfg, load_held(path or weights_path(), cfg)


def examples(context: int, depth: float, n: int, seed: int = 0) -> tuple[list[list[int]], list[bytes]]:
    """n passkey prompts of `context` tokens in all (prompt + the 5 answer digits) with the needle at
    `depth` of the filler, and their answers. Example i comes from (seed, context, i): the same for
    every depth, so the depths differ only in where the needle sits."""
    if not 0 <= depth <= 1:
        raise ConfigError("depth", depth, "expected a fraction in [0, 1]")
    if context < data_lib.passkey_min_length(DIGITS):
        raise ConfigError("context", context, f"expected at least {data_lib.passkey_min_length(DIGITS)} tokens "
                          "(the needle, the question and the answer)")
    prompts, answers = [], []
    for i in range(n):
        rng = np.random.default_rng([seed, context, i])
        prompt, answer = data_lib.passkey_example(context, depth, rng, DIGITS)
        prompts.append(list(prompt))
        answers.append(answer)
    return prompts, answers


def accuracy(params, cfg, context: int, depth: float, n: int, *, seed: int = 0, chunk: int = 512) -> dict:
    """Exact-match rate of greedy answers over n prompts (one batch), with the answers as decoded."""
    from dsv41.generate import generate_batch

    prompts, answers = examples(context, depth, n, seed)
    t0 = time.perf_counter()
    out = generate_batch(params, cfg, prompts, max_new_tokens=DIGITS, chunk=chunk)
    got = [bytes(o) for o in out]
    hits = [g == a for g, a in zip(got, answers)]
    return {"context": context, "depth": depth, "n": n, "accuracy": float(np.mean(hits)),
            "seconds": time.perf_counter() - t0, "answers": [a.decode() for a in answers],
            "decoded": [g.decode("latin-1") for g in got]}


def table(params, cfg, contexts, depths, n: int, *, seed: int = 0, chunk: int = 512, progress=None) -> list[dict]:
    rows = []
    for c in contexts:
        for d in depths:
            rows.append(accuracy(params, cfg, c, d, n, seed=seed, chunk=chunk))
            if progress is not None:
                progress(rows[-1])
    return rows


def format_table(rows: list[dict], title: str) -> str:
    contexts = sorted({r["context"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    cell = {(r["context"], r["depth"]): r for r in rows}
    lines = [title, "context  " + "  ".join(f"depth {d:<4g}" for d in depths) + "  mean"]
    for c in contexts:
        accs = [cell[c, d]["accuracy"] for d in depths if (c, d) in cell]
        lines.append(f"{c:<7}  " + "  ".join(f"{cell[c, d]['accuracy']:>10.1%}" if (c, d) in cell else " " * 10
                                            for d in depths) + f"  {np.mean(accs):.1%}")
    return "\n".join(lines)


def parse_floats(text: str, name: str) -> list[float]:
    """Comma-separated numbers of the command-line flag `name` (a ConfigError naming it otherwise)."""
    try:
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(name, text, "expected comma-separated numbers") from None


def add_parser(subparsers):
    p = subparsers.add_parser(
        "passkey", help="passkey retrieval accuracy of the trained demo model, by context and depth",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  dsv41 passkey --contexts 2048,4096,8192 --depths 0,0.25,0.5,0.75,1 --n 8\n"
               "  dsv41 passkey --weights w.safetensors --contexts 2048 --n 2   # weights of dsv41 train --export")
    p.add_argument("--contexts", default="2048,4096,8192", help="tokens per prompt, answer included")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths, fractions of the filler")
    p.add_argument("--n", type=int, default=8, help="prompts per cell (one batch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    p.add_argument("--weights", default=None, help="a weights file of configs/passkey.json (default: the shipped one)")
    config_lib.add_weight_format_argument(p)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. quant=none (no fake-quant, float cache)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    except ValueError:
        raise ConfigError("--contexts", args.contexts, "expected comma-separated whole token counts") from None
    depths = parse_floats(args.depths, "--depths")
    if args.n < 1:
        raise ConfigError("--n", args.n, "expected at least 1 prompt per cell")
    if args.weights is not None:
        from dsv41.convert import weights_file

        weights_file("--weights", args.weights)
    cfg, params = load_trained([*args.set, *config_lib.weight_format_overrides(args.weight_format)], args.weights)
    def say(r):  # progress on stderr in both modes (every long job shows it); --json keeps stdout one object
        print(f"  context {r['context']}, depth {r['depth']:g}: {r['accuracy']:.1%} ({r['seconds']:.1f} s; "
              f"e.g. {r['answers'][0]} -> {r['decoded'][0]!r})", file=sys.stderr, flush=True)

    rows = table(params, cfg, contexts, depths, args.n, seed=args.seed, chunk=args.chunk, progress=say)
    if args.json:
        print(json.dumps({"quant": cfg.quant, "rows": rows}))
    else:
        print(format_table(rows, f"{cfg.model}, quant {cfg.quant}: exact-match passkey accuracy ({args.n} prompts per cell)"))
    return 0
