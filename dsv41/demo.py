"""The README's main job: a long passkey prompt through the compressed cache of a trained model.

By default it runs the shipped passkey model (`configs/passkey.json` with its trained weights
`configs/passkey.safetensors`, see `dsv41.passkey`): a passkey sits at `depth` of a long filler prompt,
the prompt is prefilled in chunks with both schedules (`full`, `ced`) and the answer is decoded
greedily through the cache. It prints what was measured: whether the key came back, cache bytes per
token against the formula (the quantised caches; a float cache, `quant: none`, is measured only),
prefill time per schedule (its compile timed apart, before it; `ced` where the config can run it:
V4.1 with its decoder's only Full layer first) and decode tokens per second. Any V4.1 or V4 config
runs; one without shipped weights runs with random (seeded) parameters: its numbers are real, its text
is not.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from dsv41 import accounting, cache as cache_lib, data, schema, steps
from dsv41.config import build
from dsv41.errors import ConfigError

DIGITS = 5


def prompt_tokens(n: int, depth: float = 0.5, seed: int = 0) -> tuple[np.ndarray, bytes]:
    """A passkey prompt of n byte-level tokens (the question at its end) and the key it asks for."""
    if n < 100:
        raise ValueError(f"prompt_tokens: {n}: expected at least 100 tokens to hold the needle and the question")
    prompt, key = data.passkey_example(n + DIGITS, depth, np.random.default_rng([seed, n]), DIGITS)
    return np.frombuffer(prompt, np.uint8).astype(np.int32), key


def ced_config(cfg):
    """(cfg under the CED prefill schedule, None) or (None, why the config cannot run it)."""
    if cfg.architecture.family != schema.V41:
        return None, "CED needs V4.1's encoder and decoder stages"
    try:
        return build(cfg.to_dict(), ["runtime.prefill_schedule=ced"]), None
    except ConfigError as e:  # the config's decoder does not fit the schedule: say why, run `full` only
        return None, e.expected


def _prefill_calls(prompt, chunk):
    """The prompt as prefill calls: (tokens [1, chunk] zero-padded, length, final) per chunk."""
    starts = range(0, len(prompt), chunk)
    for s in starts:
        piece = prompt[s:s + chunk]
        tokens = np.zeros((1, chunk), np.int32)
        tokens[0, :len(piece)] = piece
        yield tokens, len(piece), s == starts[-1]


def _prefill(params, cfg, prompt, capacity, chunk, progress):
    """Prefills the prompt in chunks on a fresh cache: (logits, cache, compile_s, steady_s).

    compile_s: a warm-up on a scratch cache of the same shapes, one call of each program the prefill runs
    (its first chunk and its final one, which CED compiles apart), each traced, compiled (or loaded from
    the compile cache) and run once. steady_s: then the whole prefill, which compiles nothing.
    """
    schedule = cfg.runtime.prefill_schedule
    calls = list(_prefill_calls(prompt, chunk))
    progress(f"prefill ({schedule}) compiling")
    t = time.perf_counter()
    bound = steps.bind(params, cfg)
    scratch = cache_lib.init_cache(cfg, 1, capacity)
    for tokens, n, final in calls[:1] + calls[1:][-1:]:
        _, scratch = bound.prefill(scratch, tokens, [n], final=final)
    jax.block_until_ready(scratch)
    compile_s = time.perf_counter() - t
    del scratch

    cache = jax.block_until_ready(cache_lib.init_cache(cfg, 1, capacity))
    t = time.perf_counter()
    for k, (tokens, n, final) in enumerate(calls):
        logits, cache = bound.prefill(cache, tokens, [n], final=final)
        progress(f"prefill ({schedule}) {min((k + 1) * chunk, len(prompt))}/{len(prompt)} tokens")
    jax.block_until_ready((logits, cache))
    return logits, cache, compile_s, time.perf_counter() - t


def run(cfg_name: str, prompt_len: int, new_tokens: int, chunk: int, seed: int, out=print, progress=None,
        depth: float = 0.5):
    from dsv41.config import family, load_config
    from dsv41.convert import command_params

    progress = progress or (lambda msg: None)
    if new_tokens < 1:
        raise ValueError(f"new_tokens: {new_tokens}: expected at least 1")
    cfg = load_config(cfg_name)
    if family(cfg) not in schema.FAMILIES:
        raise ConfigError("config", cfg_name, f"expected a model config (family {' or '.join(schema.FAMILIES)}); "
                          f"{cfg_name!r} is a KV layout for the report only")
    if cfg.architecture.vocab_size < 256:
        raise ConfigError("architecture.vocab_size", cfg.architecture.vocab_size,
                          "expected at least 256: the passkey prompt is byte tokens")
    ced, no_ced = ced_config(cfg)
    params, weights = command_params(cfg, cfg_name, seed=seed)
    prompt, key = prompt_tokens(prompt_len, depth, seed)
    capacity = cache_lib.round_capacity(cfg, prompt_len + new_tokens)
    report = {"config": cfg_name, "weights": "random" if weights is None else str(weights),
              "prompt_tokens": prompt_len, "capacity": capacity, "depth": depth, "passkey": key.decode()}

    logits, cache, report["prefill_full_compile_s"], report["prefill_full_s"] = _prefill(
        params, cfg, prompt, capacity, chunk, progress)
    report["cache_bytes"] = cache_lib.nbytes(cache)
    # The accounting describes the stored formats; a float cache (quant none) is measured only.
    fixed = accounting.fixed_bytes_per_sequence(cfg)["total"] if cfg.quant == "qat" else None
    report["fixed_bytes_per_sequence"] = fixed
    report["measured_bytes_per_token"] = None if fixed is None else (report["cache_bytes"] - fixed) / capacity
    report["formula_bytes_per_token"] = None if fixed is None else accounting.kv_bytes_per_token(cfg)["total"]

    generated, times = [], []
    bound = steps.bind(params, cfg)
    for _ in range(new_tokens):
        token = int(np.argmax(np.asarray(logits)[0]))
        generated.append(token)
        t = time.perf_counter()
        logits, cache = bound.decode(cache, [token])
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - t)
    steady = times[1:] or times
    report["decode_tokens_per_s"] = len(steady) / sum(steady)
    report["generated_ids"] = generated
    report["answer"] = bytes(t for t in generated[:DIGITS] if t < 256).decode("latin-1")
    report["retrieved"] = report["answer"] == report["passkey"]

    report["prefill_ced_compile_s"] = report["prefill_ced_s"] = None
    if ced is not None:
        _, _, report["prefill_ced_compile_s"], report["prefill_ced_s"] = _prefill(
            params, ced, prompt, capacity, chunk, progress)
    source = f"random weights, seed {seed}" if weights is None else f"trained weights {weights.name}"
    out(f"dsv41 {cfg_name}: {prompt_len:,}-token passkey prompt (needle at depth {depth:g}), capacity {capacity:,} "
        f"({source})")
    verdict = "retrieved" if report["retrieved"] else "NOT retrieved"
    out(f"  passkey {report['passkey']}: greedy answer {report['answer']!r} — {verdict} through the compressed cache"
        + (" (random weights: not expected to)" if weights is None else ""))
    if fixed is None:
        out(f"  cache: {report['cache_bytes']:,} B, the float cache (quant {cfg.quant}): the formula describes "
            "the stored formats")
    else:
        out(f"  cache: {report['cache_bytes']:,} B = {report['measured_bytes_per_token']:.2f} B/token measured × "
            f"capacity + {fixed:,} B fixed per sequence; formula {report['formula_bytes_per_token']} B/token")
    compile_s = f"full {report['prefill_full_compile_s']:.1f} s"
    if ced is None:
        out(f"  prefill full: {report['prefill_full_s']:.1f} s (compile + first run of each chunk program before "
            f"it: {compile_s}); no ced: {no_ced}")
    else:
        out(f"  prefill full: {report['prefill_full_s']:.1f} s, ced: {report['prefill_ced_s']:.1f} s "
            f"(compile + first run of each chunk program before them: {compile_s}, "
            f"ced {report['prefill_ced_compile_s']:.1f} s)")
    out(f"  decode: {report['decode_tokens_per_s']:.1f} tokens/s over {new_tokens} greedy tokens "
        f"(ids {generated[:12]}{' …' if len(generated) > 12 else ''})")
    return report
