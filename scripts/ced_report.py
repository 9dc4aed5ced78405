"""CED prefill schedule report (DESIGN §3.5): its deviation from the exact `full` schedule and the
prefill FLOP ratio ced/full from XLA cost analysis.

  python scripts/ced_report.py            # deviation on the V4.1 port's weights + FLOPs at 8K and 32K
  python scripts/ced_report.py --json

Deviation: the port's toy V4.1 (tests/data/v41_port_caseA.npz: trained-looking weights are not
available yet, these are the oracle's) prefilled with each schedule, then 64 greedy tokens; printed:
max |Δ logits| after prefill (and relative to the logits' std) and the agreement of the greedy tokens.
FLOPs: the `small` config, prompts of 8K and 32K tokens prefilled in chunks of --chunk tokens; a
chunk's cost comes from the compiled step (capacity = the prompt), full = chunks × step,
ced = (chunks − 1) × encoder chunk + the final chunk with the decoder replay.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import dsv41
from dsv41 import cache as cache_lib
from dsv41 import model, steps, transformers_io

ROOT = Path(__file__).resolve().parents[1]


def greedy(params, cfg, prompt, new_tokens, capacity):
    c = cache_lib.init_cache(cfg, 1, capacity)
    logits, c = steps.prefill(params, cfg, c, prompt[None])
    first = np.asarray(logits)[0]
    out = []
    for _ in range(new_tokens):
        token = int(np.argmax(np.asarray(logits)[0]))
        out.append(token)
        logits, c = steps.decode(params, cfg, c, [token])
    return first, out


def deviation(new_tokens: int) -> dict:
    d = np.load(ROOT / "tests" / "data" / "v41_port_caseA.npz", allow_pickle=False)
    full = transformers_io.config_from_transformers(json.loads(str(d["config_json"][0])))
    ced = dsv41.config.build(full.to_dict(), ["runtime.prefill_schedule=ced"])
    params = transformers_io.params_from_transformers({n: d[n] for n in d["param_names"]}, full)
    prompt = d["input_ids"][0]
    capacity = 2 * ((len(prompt) + new_tokens + 1) // 2)
    lf, tf = greedy(params, full, prompt, new_tokens, capacity)
    lc, tc = greedy(params, ced, prompt, new_tokens, capacity)
    agree = [a == b for a, b in zip(tf, tc)]
    return {
        "model": "V4.1 port toy weights (tests/data/v41_port_caseA.npz)",
        "prompt_tokens": len(prompt),
        "replay_tokens": ced.swa_bounded_replay.decoder_replay_tokens,
        "window": ced.kv_cache.swa_window_size,
        "max_abs_logit_diff": float(np.abs(lf - lc).max()),
        "relative_to_logit_std": float(np.abs(lf - lc).max() / lf.std()),
        "greedy_tokens": new_tokens,
        "greedy_agreement": float(np.mean(agree)),
        "first_divergence": next((i for i, a in enumerate(agree) if not a), None),
    }


def chunk_flops(cfg, capacity: int, chunk: int, replay: int | None) -> float:
    params = model.abstract_params(cfg)
    cache = jax.eval_shape(lambda: cache_lib.init_cache(cfg, 1, capacity))
    lowered = steps.lower(params, cfg, cache, jax.ShapeDtypeStruct((1, chunk), jnp.int32),
                          jax.ShapeDtypeStruct((1,), jnp.int32), replay=replay)
    cost = lowered.compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def flop_ratio(prompt: int, chunk: int) -> dict:
    over = [f"context_window={prompt}", f"architecture.rope.max_position={max(prompt, 8192)}"]
    full = dsv41.load_config("small", overrides=over)
    ced = dsv41.load_config("small", overrides=over + ["runtime.prefill_schedule=ced"])
    chunks = prompt // chunk
    f_full = chunks * chunk_flops(full, prompt, chunk, None)
    replay = min(ced.swa_bounded_replay.decoder_replay_tokens, chunk)
    f_ced = (chunks - 1) * chunk_flops(ced, prompt, chunk, 0) + chunk_flops(ced, prompt, chunk, replay)
    return {"prompt_tokens": prompt, "chunk": chunk, "full_flops": f_full, "ced_flops": f_ced, "ratio": f_ced / f_full}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompts", default="8192,32768", help="prompt lengths for the FLOP ratio")
    p.add_argument("--chunk", type=int, default=2048)
    args = p.parse_args(argv)
    report = {"deviation": deviation(args.new_tokens),
              "flops": [flop_ratio(int(n), args.chunk) for n in args.prompts.split(",")]}
    if args.json:
        print(json.dumps(report))
        return 0
    dv = report["deviation"]
    print(f"CED vs full on {dv['model']}: prompt {dv['prompt_tokens']} tokens, replay {dv['replay_tokens']}, "
          f"window {dv['window']}")
    print(f"  logits after prefill: max |Δ| {dv['max_abs_logit_diff']:.4g} ({dv['relative_to_logit_std']:.3g} × std)")
    print(f"  {dv['greedy_tokens']} greedy tokens: agreement {100 * dv['greedy_agreement']:.1f}%, first divergence "
          f"at {dv['first_divergence']}")
    print("Prefill FLOPs (XLA cost analysis, small config):")
    for f in report["flops"]:
        print(f"  {f['prompt_tokens']:>6} tokens (chunks of {f['chunk']}): full {f['full_flops']:.4g}, "
              f"ced {f['ced_flops']:.4g}, ced/full = {f['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
