#!/usr/bin/env python3
"""Selection replay, measured: the log-probability gap between a sampler and its trainer, with and without
replay (issue 22, DESIGN §10).

The sampler is inference as a user runs it: the passkey prompts prefilled through the cache (FP4 global
entries, FP8 window rings), then `--new` tokens sampled at `--temperature`, one decode step each, every step
returning the routed experts and indexer picks it used (`Bound.prefill/decode(..., selections=True)`). The
trainer is the teacher-forced training forward (`runtime.query_block` blocks, fake-quantised stored formats)
over the same tokens, once choosing its own experts and picks and once forced to the sampler's
(`batch["selections"]` in training). Printed per form: |log p_sampler − log p_trainer| over the sampled tokens
(mean, 99th percentile, max), and how many of the trainer's own choices differ from the sampler's (picks as
sets, per token and layer; experts likewise).

    python scripts/replay_gap.py                       # passkey weights, quant qat, 4 prompts of 1,024 tokens
    python scripts/replay_gap.py --quant none --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=1024, help="prompt tokens (a passkey prompt, needle at 0.5)")
    p.add_argument("--new", type=int, default=32, help="tokens sampled after each prompt")
    p.add_argument("--rows", type=int, default=4, help="prompts in the batch")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--quant", default="qat", choices=["qat", "none"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dsv41 import model as model_lib
    from dsv41 import passkey, selections, steps
    from dsv41.cache import init_cache

    t0 = time.perf_counter()
    cfg, params = passkey.load_trained([f"quant={args.quant}"])
    prompts, _ = passkey.examples(args.context + passkey.DIGITS, 0.5, args.rows, args.seed)
    prompt = np.asarray(prompts, np.int32)  # [B, P]: every prompt of one length
    b, plen = prompt.shape

    # The sampler: prefill, then one decode step per sampled token, each returning its selections.
    bound = steps.bind(params, cfg)
    cache = init_cache(cfg, b, plen + args.new)
    logits, cache, first = bound.prefill(cache, prompt, selections=True)
    parts, sampled, sampler_lp = [first], [], []
    key = jax.random.key(args.seed)
    for _ in range(args.new):
        key, sub = jax.random.split(key)
        tok = jax.random.categorical(sub, logits / args.temperature)
        sampler_lp.append(np.asarray(jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, None], -1)[:, 0]))
        sampled.append(np.asarray(tok, np.int32))
        logits, cache, chosen = bound.decode(cache, np.asarray(tok), selections=True)
        parts.append(chosen)
    sampled = np.stack(sampled, 1)
    sampler_lp = np.stack(sampler_lp, 1)  # [B, new]
    tokens = np.concatenate([prompt, sampled], 1)[:, :-1]  # the trainer's inputs: the last token is only a target
    s = tokens.shape[1]
    replayed = selections.concat(parts)
    replayed = {kind: {layer: v[:, :s] for layer, v in layers.items()} for kind, layers in replayed.items()}
    positions = np.broadcast_to(np.arange(s), tokens.shape)
    replayed = selections.check(cfg, replayed, positions)
    sample_s = time.perf_counter() - t0

    # The trainer: the training forward over the same tokens, its own choices and the sampler's.
    graphdef = model_lib.graphdef(model_lib.config_key(cfg))
    pos = jnp.asarray(positions, jnp.int32)

    @jax.jit
    def forward(params, tokens, forced):
        logits, records = nnx.merge(graphdef, params)(tokens, pos, record=True, forced=forced)
        lp = jax.nn.log_softmax(logits[:, plen - 1:], -1)
        return jnp.take_along_axis(lp, jnp.asarray(sampled)[..., None], -1)[..., 0], records

    rows = {}
    for form, forced in (("own choices", None), ("replayed", replayed)):
        lp, records = forward(params, jnp.asarray(tokens), forced)
        gap = np.abs(np.asarray(lp) - sampler_lp)
        flat = [selections.flat(r) for r in records]
        differ = {}
        for kind in ("picks", "experts"):
            n = bad = 0
            for layer, want in replayed[kind].items():
                got = np.sort(np.asarray(flat[layer][kind]), -1)
                bad += int(np.any(got != np.sort(want, -1), -1).sum())
                n += got.shape[0] * got.shape[1]
            differ[kind] = bad / n
        rows[form] = {"mean_abs_gap": float(gap.mean()), "p99_abs_gap": float(np.quantile(gap, 0.99)),
                      "max_abs_gap": float(gap.max()), "picks_differ": differ["picks"],
                      "experts_differ": differ["experts"]}
    out = {"quant": args.quant, "rows": b, "prompt": plen, "sampled": args.new, "temperature": args.temperature,
           "sample_s": round(sample_s, 1), "forms": rows}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"passkey weights, quant {args.quant}: {b} prompts of {plen} tokens, {args.new} tokens sampled at "
          f"T={args.temperature} (sampler {sample_s:.1f} s)")
    print(f"{'trainer':>12} {'mean |Δ log p|':>15} {'p99':>10} {'max':>10} {'picks differ':>13} {'experts differ':>15}")
    for form, r in rows.items():
        print(f"{form:>12} {r['mean_abs_gap']:>15.2e} {r['p99_abs_gap']:>10.2e} {r['max_abs_gap']:>10.2e} "
              f"{r['picks_differ']:>13.2%} {r['experts_differ']:>15.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
