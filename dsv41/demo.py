"""The README's main job: a long-prompt run of a config through the compressed cache.

Builds a prompt of `prompt_tokens` byte-level tokens, prefills it with both schedules (chunked),
generates greedily, and prints what was measured: cache bytes per token against the formula, prefill
time per schedule and decode tokens per second. Parameters are random (seeded) until a trained
checkpoint ships, so the generated text is not meaningful; the numbers are.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from dsv41 import accounting, cache as cache_lib, model, steps
from dsv41.config import build

TEXT = ("The compressed cache keeps 890 bytes of global KV per token for DeepSeek-V4.1-Flash. "
        "Window rings hold the last tokens of every layer in FP8. The pass key is 7 3 5 1 9. ")


def prompt_tokens(n: int) -> np.ndarray:
    data = (TEXT * (n // len(TEXT) + 1)).encode()[:n]
    return np.frombuffer(data, np.uint8).astype(np.int32)


def _prefill(params, cfg, prompt, capacity, chunk, progress):
    cache = cache_lib.init_cache(cfg, 1, capacity)
    starts = list(range(0, len(prompt), chunk))
    t0 = time.perf_counter()
    compile_s = 0.0
    for k, s in enumerate(starts):
        piece = prompt[s:s + chunk]
        tokens = np.zeros((1, chunk), np.int32)
        tokens[0, :len(piece)] = piece
        t = time.perf_counter()
        logits, cache = steps.prefill(params, cfg, cache, tokens, [len(piece)], final=k == len(starts) - 1)
        jax.block_until_ready(cache.lengths)
        if k == 0:
            compile_s = time.perf_counter() - t
        progress(f"prefill ({cfg.runtime.prefill_schedule}) {min(s + chunk, len(prompt))}/{len(prompt)} tokens")
    total = time.perf_counter() - t0
    return logits, cache, total, compile_s


def run(cfg_name: str, prompt_len: int, new_tokens: int, chunk: int, seed: int, out=print, progress=None):
    from dsv41.config import load_config

    progress = progress or (lambda msg: None)
    cfg = load_config(cfg_name)
    ced = build(cfg.to_dict(), ["runtime.prefill_schedule=ced"])
    params = model.init_params(cfg, jax.random.key(seed))
    prompt = prompt_tokens(prompt_len)
    capacity = 2 * -(-(prompt_len + new_tokens) // 2)
    report = {"config": cfg_name, "prompt_tokens": prompt_len, "capacity": capacity}

    logits, cache, report["prefill_full_s"], report["prefill_full_first_chunk_s"] = _prefill(
        params, cfg, prompt, capacity, chunk, progress)
    fixed = accounting.fixed_bytes_per_sequence(cfg)["total"]
    report["cache_bytes"] = cache_lib.nbytes(cache)
    report["measured_bytes_per_token"] = (report["cache_bytes"] - fixed) / capacity
    report["formula_bytes_per_token"] = accounting.kv_bytes_per_token(cfg)["total"]
    report["fixed_bytes_per_sequence"] = fixed

    generated, times = [], []
    for _ in range(new_tokens):
        token = int(np.argmax(np.asarray(logits)[0]))
        generated.append(token)
        t = time.perf_counter()
        logits, cache = steps.decode(params, cfg, cache, [token])
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - t)
    steady = times[1:] or times
    report["decode_tokens_per_s"] = len(steady) / sum(steady)
    report["generated_ids"] = generated

    _, _, report["prefill_ced_s"], report["prefill_ced_first_chunk_s"] = _prefill(
        params, ced, prompt, capacity, chunk, progress)
    out(f"dsv41 {cfg_name}: {prompt_len:,}-token prompt, capacity {capacity:,} (random weights, seed {seed})")
    out(f"  cache: {report['cache_bytes']:,} B = {report['measured_bytes_per_token']:.2f} B/token measured × "
        f"capacity + {fixed:,} B fixed per sequence; formula {report['formula_bytes_per_token']} B/token")
    out(f"  prefill full: {report['prefill_full_s']:.1f} s (first chunk incl. compile "
        f"{report['prefill_full_first_chunk_s']:.1f} s); ced: {report['prefill_ced_s']:.1f} s "
        f"(first chunk {report['prefill_ced_first_chunk_s']:.1f} s)")
    out(f"  decode: {report['decode_tokens_per_s']:.1f} tokens/s over {new_tokens} greedy tokens "
        f"(ids {generated[:12]}{' …' if len(generated) > 12 else ''})")
    return report
