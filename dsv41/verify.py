"""`dsv41 verify`: is the KV compression real, and what does it cost? One command, one report (DESIGN §15).

    dsv41 verify --quick --out verify-quick          # ~5 minutes on 2 CPU cores
    dsv41 verify --contexts 4096,8192,16384 --out verify
    dsv41 verify --base-url http://127.0.0.1:8000/v1 --model dsv41-passkey --out verify-client

It runs the trained passkey model (`configs/passkey.json` and its shipped weights; another `--config` runs
with `--weights FILE`, or random weights, whose retrieval means nothing) and writes DIR/report.md,
DIR/results.json and PNG plots:

1. Context sweep (the shipped variant): per context, steady prefill seconds (its compile timed apart),
   latency to the first token (`max_tokens` 1) and to the 128th (`max_tokens` 128), their difference and
   the decode ms per token; XLA's decode FLOPs per token (the step lowered at static shapes for the
   context) raw and precision-weighted (BF16 1, FP8 0.5, FP4 0.25: each matmul of `flop_model`'s count at
   its operands' stored format, the elementwise rest at 1; `decode_flops`), relative to 4K.
2. Memory: the cache's bytes from its pytree against `kv_bytes_per_token × capacity + fixed` (exact for
   the packed cache), its bytes per token measured as the difference of two capacities, and the process
   memory (`memory_stats()` on GPU/TPU, RSS on CPU) sampled before, during and a few seconds after each
   request, for FP4 main KV (shipped), FP8 main KV and `quant: none` (the float cache).
3. Accuracy, compressed against uncompressed on the same prompts: passkey exact match by context × depth
   for every variant (`VARIANTS`), and each variant's next-token logits on the answers of fixed prompts
   against the uncompressed model's (top-1 agreement, mean KL).
4. Doctor: the configuration mistakes that silently cost accuracy or memory (`doctor`).

`--base-url` runs the client side of the same workflow against any OpenAI-compatible endpoint instead
(`dsv41.verify_client`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from dsv41 import accounting, flop_model, passkey, verify_client, verify_report
from dsv41 import config as config_lib
from dsv41 import data as data_lib
from dsv41.config import build, load_config
from dsv41.errors import ConfigError

NEW_TOKENS = 128  # the long request's max_tokens; the short one's is 1
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
BASE_CONTEXT = 4096  # the sweep's figures are relative to this context (else to the first)
QUICK = dict(contexts=(1024, 4096), accuracy_contexts=(1024,), n=2, settle_s=1.0, full_size_contexts=())
FULL = dict(contexts=(2048, 4096, 8192), accuracy_contexts=(2048, 4096), n=4, settle_s=3.0,
            full_size_contexts=(4096, 65536, 262144, 1000000))

# The variants, as config overrides of the model as shipped (`capacity`: the cache's, for top-k ≥ every entry).
VARIANTS = {
    "shipped": ("as configured: FP4 main KV, top-k selection, candidate pool, full prefill", lambda cap: []),
    "quant-none": ("no quantisation: the float cache, no fake-quant", lambda cap: ["quant=none"]),
    "fp8-kv": ("FP8 main KV (E4M3, an E4M3 scale per 16) instead of FP4", lambda cap: ["kv_cache.global_kv_dtype=fp8"]),
    "all-entries": ("every visible entry selected (top-k = the capacity, no candidate pool)",
                    lambda cap: [f"csa2.indexer.top_k={cap}", "csa2.indexer.hierarchical.enabled=false"]),
    "no-pool": ("no candidate pool: the Reindex layers score every entry",
                lambda cap: ["csa2.indexer.hierarchical.enabled=false"]),
    "ced": ("CED prefill (encoder for every token, the decoder replays the last ones)",
            lambda cap: ["runtime.prefill_schedule=ced"]),
    "replay": ("prefix cache: global KV restored, window rings rebuilt by bounded replay (against an exact "
               "restore from the ring pool)", lambda cap: []),
}
REFERENCE = "uncompressed"  # quant none + every entry selected + no pool: what the variants are held against
MEMORY_VARIANTS = ("shipped", "fp8-kv", "quant-none")


def reference_overrides(cap: int) -> list[str]:
    return ["quant=none", *VARIANTS["all-entries"][1](cap)]


# ------------------------------------------------------------------------------------------------ doctor


def doctor(cfg, contexts=(), measured: dict | None = None) -> list[dict]:
    """The configuration mistakes that silently cost accuracy or memory, each {check, status, detail}
    (status "ok", "warn" or "error"). measured: {variant: memory row} (bytes against the formula)."""
    kv, r = cfg.kv_cache, cfg.swa_bounded_replay
    w = kv.swa_window_size
    out = []

    def add(check, ok, detail, bad="warn"):
        out.append({"check": check, "status": "ok" if ok else bad, "detail": detail})

    add("window KV is FP8", kv.swa_kv_dtype in ("fp8", "fp8_e4m3"),
        f"kv_cache.swa_kv_dtype = {kv.swa_kv_dtype!r}" + ("" if kv.swa_kv_dtype in ("fp8", "fp8_e4m3") else
                                                         ": the window ring is not stored as FP8"))
    # A replay longer than the window (a window smaller than the replay) is refused when the config loads.
    for name in ("encoder_replay_tokens", "decoder_replay_tokens"):
        n = r[name]
        add(f"{name} covers the window", n >= w,
            f"swa_bounded_replay.{name} = {n}, kv_cache.swa_window_size = {w}"
            + ("" if n >= w else f": a replayed ring holds {n} of its {w} tokens; the rest attend nothing there"))
    longest = max(contexts, default=0)
    add("context window holds the prompts", longest <= cfg.context_window,
        f"context_window = {cfg.context_window}, longest request {longest} tokens"
        + ("" if longest <= cfg.context_window else ": the maximum-context error"), bad="error")
    for name, row in (measured or {}).items():
        if row.get("formula_bytes") is None:
            add(f"{name}: cache bytes = formula", False, f"the float cache (quant none) holds "
                f"{row['bytes_per_token_measured']:g} B/token, not the configured formats' "
                f"{row['bytes_per_token_formula']:g}: compression is off")
            continue
        same = row["cache_bytes"] == row["formula_bytes"]
        add(f"{name}: cache bytes = formula", same,
            f"{row['cache_bytes']:,} B measured, {row['formula_bytes']:,} B by the formula"
            + ("" if same else ": the configured format is not what the cache stores"), bad="error")
    return out


def check_contexts(cfg, contexts, field: str) -> None:
    """Refuses contexts the config cannot hold (prompt + the long request's tokens), naming the flag."""
    for c in contexts:
        if c < data_lib.passkey_min_length(passkey.DIGITS):
            raise ConfigError(field, c, f"expected at least {data_lib.passkey_min_length(passkey.DIGITS)} "
                              "tokens (the needle, the question and the answer)")
        if c + NEW_TOKENS > cfg.context_window:
            raise ConfigError(field, c, f"expected at most {cfg.context_window - NEW_TOKENS} tokens: context_window "
                              f"is {cfg.context_window} and the long request adds {NEW_TOKENS} (the maximum-context "
                              "error; raise it with --set context_window=N, within architecture.rope.max_position)")


# ------------------------------------------------------------------------------------------------ memory sampling


def memory_now() -> int:
    """Bytes in use: the accelerator's (`memory_stats()`) where the backend reports it, else the process RSS."""
    import jax

    dev = jax.devices()[0]
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    if stats and "bytes_in_use" in stats:
        return int(stats["bytes_in_use"])
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Sampler:
    """Samples `memory_now()` every `period_s` on a thread while in its `with` block: `.peak`, `.samples`."""

    def __init__(self, period_s: float = 0.01):
        self.period_s, self.samples, self._stop = period_s, [], threading.Event()

    def __enter__(self):
        self.samples.append(memory_now())
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.period_s):
            self.samples.append(memory_now())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.samples.append(memory_now())

    @property
    def peak(self) -> int:
        return max(self.samples)


# ------------------------------------------------------------------------------------------------ measurements


def _cfg(base, overrides) -> object:
    return build(base.to_dict(), list(overrides))


def decode_flops(cfg, capacity: int, weights: str = "bf16") -> dict:
    """XLA's decode FLOPs per token (the step lowered at static shapes for this capacity, every loop unrolled:
    `compile_report.lowered_flops_per_token`) and the precision-weighted count: the matmuls of the closed
    per-layer count (`flop_model`, equal to XLA's dots) at the weights of their operands' formats, and XLA's
    elementwise work beside them (dequantisation, norms, masks, top-k) at 1."""
    from dsv41 import compile_report

    raw = compile_report.lowered_flops_per_token(cfg, batch=1, context=capacity, weights=weights)
    matmuls = flop_model.flops_per_token(cfg, context=capacity, weights=weights)
    return {"raw": raw, "matmul": matmuls["total"], "weights": weights,
            "weighted": matmuls["weighted"] + (raw - matmuls["total"])}


def full_size_flops(contexts, *, config: str = "v41_flash", overrides=(), progress=lambda msg: None) -> list[dict]:
    """Decode FLOPs per token of the full-size model at each context, raw and weighted (the weights at the
    formats they ship in), relative to the first: the AOT compile report's lowering on this CPU (`dsv41
    compile-report --sweep-context`). Each context's step is lowered twice: with plain weights for the model's
    arithmetic, and with the weights held as shipped (`held`: the program as it runs, the parameters' bytes and
    XLA's FLOPs with the dequantisation inside each matmul)."""
    import jax

    from dsv41 import compile_report

    cfg = load_config(config, list(overrides))
    rows = []
    for c in contexts:
        row = {"context": c, **decode_flops(cfg, c, weights="shipped")}
        t0 = time.perf_counter()
        lowered = compile_report.flop_counting_lowering(cfg, batch=1, context=c, weights="shipped", held=True)
        cost = lowered.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        params = lowered.args_info[0][0]
        row["held"] = {"lower_s": round(time.perf_counter() - t0, 2), "flops_per_token": float(cost["flops"]),
                       "param_bytes": sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(params))}
        rows.append(row)
        progress(f"full size: context {c}: {row['raw']:.3e} FLOPs/token; as shipped {row['held']['flops_per_token']:.3e} "
                 f"with the dequantisation, {row['held']['param_bytes'] / 1e9:.1f} GB of parameters")
    for r in rows:
        r["raw_relative"], r["weighted_relative"] = r["raw"] / rows[0]["raw"], r["weighted"] / rows[0]["weighted"]
    return rows


def request(params, cfg, prompt, *, capacity: int, chunk: int, settle_s: float) -> dict:
    """One request the way a server runs it, on a fresh cache of `capacity`: the prompt prefilled in chunks,
    then NEW_TOKENS greedy tokens (the first from the prefill's logits). A warm-up of the same programs on a
    scratch cache comes first (compile_s). Process memory is sampled before, during and settle_s after."""
    import jax

    from dsv41 import cache as cache_lib
    from dsv41 import generate, steps

    bound = steps.bind(params, cfg)
    t = time.perf_counter()
    scratch = cache_lib.init_cache(cfg, 1, capacity)
    logits, scratch = generate.prefill_chunked(params, cfg, scratch, [prompt], chunk=chunk)
    _, scratch = bound.decode(scratch, np.asarray(jax.numpy.argmax(logits, -1)))
    jax.block_until_ready(scratch)
    compile_s = time.perf_counter() - t
    del scratch, logits

    before = memory_now()
    with Sampler() as sampler:
        t0 = time.perf_counter()
        cache = cache_lib.init_cache(cfg, 1, capacity)
        logits, cache = generate.prefill_chunked(params, cfg, cache, [prompt], chunk=chunk)
        token = np.asarray(jax.numpy.argmax(logits, -1))
        t1 = time.perf_counter()
        for _ in range(NEW_TOKENS - 1):
            logits, cache = bound.decode(cache, token)
            token = np.asarray(jax.numpy.argmax(logits, -1))
        t2 = time.perf_counter()
        cache_bytes = cache_lib.nbytes(cache)
    held = int(cache_lib.host_view(cache).lengths[0])
    del cache, logits
    time.sleep(settle_s)  # frees are asynchronous: the figure after the request is taken once they are done
    after = memory_now()
    return {"compile_s": compile_s, "prefill_s": t1 - t0, "latency_1_s": t1 - t0, "latency_128_s": t2 - t0,
            "decode_ms_per_token": 1e3 * (t2 - t1) / (NEW_TOKENS - 1), "tokens_held": held,
            "cache_bytes": cache_bytes, "memory": {"before": before, "peak_during": sampler.peak, "after": after,
                                                   "source": _memory_source()}}


def _memory_source() -> str:
    import jax

    dev = jax.devices()[0]
    return f"{dev.platform} memory_stats bytes_in_use" if dev.platform != "cpu" else "process RSS (/proc/self/statm)"


def sweep(params, cfg, contexts, *, chunk: int, seed: int, settle_s: float, progress) -> list[dict]:
    """The context sweep of the shipped variant: one request per context (the needle at depth 0.5)."""
    from dsv41.cache import round_capacity

    rows = []
    for c in contexts:
        cap = round_capacity(cfg, c + NEW_TOKENS)
        prompt = passkey.examples(c, 0.5, 1, seed)[0][0]
        row = {"context": c, "prompt_tokens": len(prompt), "capacity": cap,
               **request(params, cfg, prompt, capacity=cap, chunk=chunk, settle_s=settle_s)}
        row["latency_difference_s"] = row["latency_128_s"] - row["latency_1_s"]
        row["decode_flops"] = decode_flops(cfg, cap)
        rows.append(row)
        progress(f"sweep: context {c}: prefill {row['prefill_s']:.2f} s, decode {row['decode_ms_per_token']:.2f} "
                 f"ms/token (compile {row['compile_s']:.1f} s)")
    base = next((r for r in rows if r["context"] == BASE_CONTEXT), rows[0])
    for r in rows:
        for key in ("prefill_s", "decode_ms_per_token", "latency_1_s", "latency_128_s"):
            r[f"{key}_relative"] = r[key] / base[key]
        for key in ("raw", "weighted"):
            r["decode_flops"][f"{key}_relative"] = r["decode_flops"][key] / base["decode_flops"][key]
    return rows


def memory(params, cfg, contexts, variants, *, chunk: int, seed: int, settle_s: float, sweep_rows, progress):
    """Bytes per token and measured memory per variant: the cache pytree against the formula at each context's
    capacity, bytes per token from two capacities, and a request's process memory at the longest context."""
    from dsv41 import cache as cache_lib
    from dsv41.cache import round_capacity

    out = {}
    longest = max(contexts)
    for name in variants:
        vcfg = _cfg(cfg, VARIANTS[name][1](0))
        per_token = accounting.kv_bytes_per_token(vcfg)["total"]
        fixed = accounting.fixed_bytes_per_sequence(vcfg)["total"]
        caps = [round_capacity(vcfg, c + NEW_TOKENS) for c in contexts]
        shapes = {cap: cache_lib.nbytes(cache_lib.abstract_cache(vcfg, 1, cap)) for cap in caps}
        hi = max(caps)
        measured_per_token = bytes_per_token(vcfg, hi)
        packed = vcfg.quant == "qat"
        row = {"config": VARIANTS[name][0], "bytes_per_token_formula": per_token,
               "bytes_per_token_measured": measured_per_token, "fixed_bytes_formula": fixed,
               "by_context": [{"context": c, "capacity": cap, "cache_bytes": shapes[cap],
                               "formula_bytes": _whole(per_token * cap + fixed) if packed else None}
                              for c, cap in zip(contexts, caps)]}
        row["cache_bytes"] = shapes[hi]
        row["formula_bytes"] = _whole(per_token * hi + fixed) if packed else None
        if name == "shipped" and sweep_rows:
            req = next(r for r in sweep_rows if r["context"] == longest)
        else:
            prompt = passkey.examples(longest, 0.5, 1, seed)[0][0]
            req = request(params, vcfg, prompt, capacity=round_capacity(vcfg, longest + NEW_TOKENS), chunk=chunk,
                          settle_s=settle_s)
        row["request"] = {"context": longest, "tokens_held": req["tokens_held"],
                          "kv_in_use_formula": _whole(per_token * req["tokens_held"] + fixed) if packed else None,
                          "cache_bytes": req["cache_bytes"], **req["memory"]}
        out[name] = row
        progress(f"memory: {name}: {measured_per_token:g} B/token (formula {per_token:g}), peak "
                 f"{req['memory']['peak_during'] / 2**20:.0f} MiB")
    return out


def bytes_per_token(cfg, capacity: int) -> float:
    """The cache's bytes per token as its pytree holds them: the growth of one row's leaves (shapes only, no
    memory) from `capacity` to 64 capacity steps more, per token."""
    from dsv41 import cache as cache_lib
    from dsv41.cache import round_capacity

    more = capacity + 64 * round_capacity(cfg, 1)
    size = lambda cap: cache_lib.nbytes(cache_lib.abstract_cache(cfg, 1, cap))
    return (size(more) - size(capacity)) / (more - capacity)


def _whole(x):
    return int(x) if float(x).is_integer() else float(x)


def _replay_accuracy(params, cfg, context, depth, n, seed, chunk, tmp):
    """Passkey exact match through the prefix cache: the same prompts restored twice, with the rings from the
    pool (exact) and rebuilt by bounded replay (pool dropped). Returns (exact row, replay row)."""
    from dsv41.generate import generate_batch
    from dsv41.prefix_cache import PrefixCache

    prompts, answers = passkey.examples(context, depth, n, seed)
    pc = PrefixCache(cfg, params, tmp)
    generate_batch(params, cfg, prompts, max_new_tokens=passkey.DIGITS, chunk=chunk, prefix_cache=pc)  # saves
    rows = []
    for label in ("exact", "replay"):
        if label == "replay":
            pc.pool = None  # the rings must be rebuilt: bounded replay
        before = pc.counters.replays
        t0 = time.perf_counter()
        out = generate_batch(params, cfg, prompts, max_new_tokens=passkey.DIGITS, chunk=chunk, prefix_cache=pc)
        got = [bytes(o) for o in out]
        rows.append({"context": context, "depth": depth, "n": n,
                     "accuracy": float(np.mean([g == a for g, a in zip(got, answers)])),
                     "seconds": time.perf_counter() - t0, "replays": pc.counters.replays - before,
                     "answers": [a.decode() for a in answers], "decoded": [g.decode("latin-1") for g in got]})
    return rows


def accuracy(params, cfg, contexts, depths, variants, *, n: int, seed: int, chunk: int, progress) -> dict:
    """Passkey exact match by context × depth for the reference (uncompressed) model and each variant."""
    from dsv41.cache import round_capacity

    out = {}
    names = [REFERENCE, *[v for v in variants]]
    for name in names:
        rows = []
        for c in contexts:
            cap = round_capacity(cfg, c)
            if name == "replay":
                with tempfile.TemporaryDirectory() as tmp:
                    exact = []
                    for d in depths:
                        e, r = _replay_accuracy(params, cfg, c, d, n, seed, chunk, tmp)
                        exact.append(e)
                        rows.append(r)
                out["replay-exact"] = out.get("replay-exact", []) + exact
                continue
            vcfg = _cfg(cfg, reference_overrides(cap) if name == REFERENCE else VARIANTS[name][1](cap))
            for d in depths:
                rows.append(passkey.accuracy(params, vcfg, c, d, n, seed=seed, chunk=chunk))
        out[name] = rows
        progress(f"accuracy: {name}: " + ", ".join(f"{r['context']}@{r['depth']:g} {r['accuracy']:.0%}" for r in rows))
    return out


def answer_logits(params, cfg, prompts, answers, *, chunk: int, prefix_cache=None):
    """Next-token logits [B, digits, V] at each answer digit, the answer fed back (teacher forced)."""
    from dsv41 import cache as cache_lib
    from dsv41 import steps
    from dsv41.cache import round_capacity
    from dsv41.generate import prefill_chunked

    cap = round_capacity(cfg, max(map(len, prompts)) + passkey.DIGITS)
    if prefix_cache is not None:
        logits, cache, _ = prefix_cache.prefill(prompts, cap, chunk=chunk)
    else:
        logits, cache = prefill_chunked(params, cfg, cache_lib.init_cache(cfg, len(prompts), cap), prompts,
                                        chunk=chunk)
    bound = steps.bind(params, cfg)
    out = [np.asarray(logits)]
    digits = np.array([list(a) for a in answers], np.int32)
    for j in range(passkey.DIGITS - 1):
        logits, cache = bound.decode(cache, digits[:, j])
        out.append(np.asarray(logits))
    return np.stack(out, axis=1).astype(np.float64)


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def logit_agreement(params, cfg, context: int, variants, *, n: int, seed: int, chunk: int, progress) -> dict:
    """Each variant's answer logits on n fixed prompts (depth 0.5) against the uncompressed model's: top-1
    agreement and mean KL(uncompressed ‖ variant) in nats, over every answer position; and the same against
    `quant: none` with the shipped selection (`*_quant_none`)."""
    from dsv41.cache import round_capacity
    from dsv41.prefix_cache import PrefixCache

    prompts, answers = passkey.examples(context, 0.5, n, seed)
    cap = round_capacity(cfg, context)
    ref = _log_softmax(answer_logits(params, _cfg(cfg, reference_overrides(cap)), prompts, answers, chunk=chunk))
    # Also against quant none with the shipped selection: what the stored formats alone change.
    exact = _log_softmax(answer_logits(params, _cfg(cfg, VARIANTS["quant-none"][1](cap)), prompts, answers,
                                       chunk=chunk))
    out = {}
    for name in variants:
        if name == "replay":
            with tempfile.TemporaryDirectory() as tmp:
                pc = PrefixCache(cfg, params, tmp)
                answer_logits(params, cfg, prompts, answers, chunk=chunk, prefix_cache=pc)  # saves the prefixes
                pc.pool = None
                got = answer_logits(params, cfg, prompts, answers, chunk=chunk, prefix_cache=pc)
        else:
            got = answer_logits(params, _cfg(cfg, VARIANTS[name][1](cap)), prompts, answers, chunk=chunk)
        got = _log_softmax(got)
        kl = (np.exp(ref) * (ref - got)).sum(-1)
        kl_exact = (np.exp(exact) * (exact - got)).sum(-1)
        out[name] = {"context": context, "positions": int(kl.size),
                     "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).mean()), "mean_kl": float(kl.mean()),
                     "top1_agreement_quant_none": float((exact.argmax(-1) == got.argmax(-1)).mean()),
                     "mean_kl_quant_none": float(kl_exact.mean())}
        progress(f"logits: {name}: top-1 {out[name]['top1_agreement']:.0%}, KL {out[name]['mean_kl']:.2e}")
    return out


# ------------------------------------------------------------------------------------------------ the table


def combined_table(cfg, results: dict) -> list[dict]:
    """The memory × latency × accuracy table: one row per (variant, context) measured. Bytes are the variant's
    cache pytree at the context's capacity (its shapes; bytes per token from two capacities), decode speed the
    sweep's (shipped variant), accuracy the mean over the depths."""
    from dsv41 import cache as cache_lib
    from dsv41.cache import round_capacity

    out = []
    acc, sw = results.get("accuracy") or {}, results.get("sweep") or []
    speed = {r["context"]: r["decode_ms_per_token"] for r in sw}
    contexts = sorted({*results.get("contexts", []), *results.get("accuracy_contexts", [])})
    for name in acc:
        if name == "replay-exact":
            continue
        for c in contexts:
            rows = [r for r in acc[name] if r["context"] == c]
            if not rows and not (name in (results.get("memory") or {}) or name == "shipped"):
                continue
            cap = round_capacity(cfg, c + NEW_TOKENS)
            vcfg = _cfg(cfg, reference_overrides(cap) if name == REFERENCE else VARIANTS[name][1](cap))
            size = cache_lib.nbytes(cache_lib.abstract_cache(vcfg, 1, cap))
            per_token = bytes_per_token(vcfg, cap)
            out.append({"variant": name, "context": c, "bytes_per_token": per_token, "cache_mib": size / 2**20,
                        "decode_ms_per_token": speed.get(c) if name == "shipped" else None,
                        "accuracy": float(np.mean([r["accuracy"] for r in rows])) if rows else None})
    return out


# ------------------------------------------------------------------------------------------------ the command


def run_local(cfg, params, *, weights: str, contexts, accuracy_contexts, depths, variants, n: int, seed: int,
              chunk: int, settle_s: float, full_size_contexts=(), progress=lambda msg: None) -> dict:
    """The whole workflow on this machine: results as results.json holds them."""
    import jax

    t0 = time.perf_counter()
    check_contexts(cfg, contexts, "--contexts")
    check_contexts(cfg, accuracy_contexts, "--accuracy-contexts")
    findings = doctor(cfg, [*contexts, *accuracy_contexts])
    if any(d["status"] == "error" for d in findings):
        bad = next(d for d in findings if d["status"] == "error")
        raise ConfigError(bad["check"], bad["detail"], "a configuration the workflow can measure")
    results = {"model": cfg.model, "weights": weights, "machine": f"{jax.devices()[0].platform}, "
               f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f} at the start", "settle_s": settle_s,
               "contexts": list(contexts), "accuracy_contexts": list(accuracy_contexts), "depths": list(depths),
               "n": n, "seed": seed, "variants": list(variants), "new_tokens": NEW_TOKENS, "base_context": BASE_CONTEXT,
               "variant_descriptions": {**{k: v[0] for k, v in VARIANTS.items()},
                                        REFERENCE: "quant none, every entry selected, no pool",
                                        "replay-exact": "the same prefix-cache restore with the rings from the pool"}}
    results["sweep"] = sweep(params, cfg, contexts, chunk=chunk, seed=seed, settle_s=settle_s, progress=progress)
    mem_variants = [v for v in MEMORY_VARIANTS if v in variants or v == "shipped"]
    results["memory"] = memory(params, cfg, contexts, mem_variants, chunk=chunk, seed=seed, settle_s=settle_s,
                               sweep_rows=results["sweep"], progress=progress)
    if "fp8-kv" in results["memory"]:
        fp4, fp8 = results["memory"]["shipped"], results["memory"]["fp8-kv"]
        e4 = accounting.entry_bytes(cfg)["main"]
        e8 = accounting.entry_bytes(_cfg(cfg, VARIANTS["fp8-kv"][1](0)))["main"]
        main4 = accounting.kv_bytes_per_token(cfg)["main"]
        main8 = accounting.kv_bytes_per_token(_cfg(cfg, VARIANTS["fp8-kv"][1](0)))["main"]
        index = accounting.kv_bytes_per_token(cfg)["index"]
        results["fp8_over_fp4_main_kv"] = {
            "measured": (fp8["bytes_per_token_measured"] - index) / (fp4["bytes_per_token_measured"] - index),
            "formats": float(main8 / main4), "fp8_entry_bytes": float(e8), "fp4_entry_bytes": float(e4)}
    results["accuracy"] = accuracy(params, cfg, accuracy_contexts, depths, variants, n=n, seed=seed, chunk=chunk,
                                   progress=progress)
    results["logits"] = logit_agreement(params, cfg, min(accuracy_contexts), variants, n=n, seed=seed, chunk=chunk,
                                        progress=progress)
    if full_size_contexts:
        results["full_size_flops"] = full_size_flops(full_size_contexts, progress=progress)
    results["table"] = combined_table(cfg, results)
    results["doctor"] = doctor(cfg, [*contexts, *accuracy_contexts], results["memory"])
    results["wall_s"] = time.perf_counter() - t0
    return results


def _ints(text: str, field: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(field, text, "expected comma-separated whole token counts") from None
    if not out:
        raise ConfigError(field, text, "expected at least one value")
    return out


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("verify", help="the long-context verification workflow: context sweep, memory "
                              "against the formula, accuracy with compression on and off, plots and a report",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="example: dsv41 verify --quick --out verify-quick")
    p.add_argument("--config", default=passkey.CONFIG, help="config name or path (default: passkey, the trained "
                   "model shipped with its weights)")
    config_lib.add_weight_format_argument(p)
    p.add_argument("--weights", default=None, help="a weights file of the config (default: the shipped one; a config "
                   "without shipped weights runs with random weights)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field "
                   "(e.g. context_window=65536 with architecture.rope.max_position=65536 for longer contexts)")
    p.add_argument("--contexts", default=None, help="sweep and memory contexts in tokens (default "
                   f"{','.join(map(str, FULL['contexts']))}; --quick {','.join(map(str, QUICK['contexts']))})")
    p.add_argument("--accuracy-contexts", default=None, help="contexts of the accuracy grid (default "
                   f"{','.join(map(str, FULL['accuracy_contexts']))}; --quick "
                   f"{','.join(map(str, QUICK['accuracy_contexts']))})")
    p.add_argument("--full-size-contexts", default=None, help="contexts of V4.1-Flash's decode FLOPs, lowered at full "
                   f"size on this CPU (default {','.join(map(str, FULL['full_size_contexts']))}; --quick and '' none)")
    p.add_argument("--depths", default=",".join(f"{d:g}" for d in DEPTHS), help="needle depths of the accuracy grid")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"compression settings to compare, of {list(VARIANTS)}")
    p.add_argument("--n", type=int, default=None, help=f"prompts per accuracy cell (default {FULL['n']}; --quick "
                   f"{QUICK['n']})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens per compiled call)")
    p.add_argument("--out", default="verify", help="the report's directory (default: ./verify)")
    p.add_argument("--json", action="store_true", help="also print results.json's object on stdout")
    p.add_argument("--quick", action="store_true", help="a short run: two contexts, one accuracy context, 2 prompts "
                   "a cell (under 10 minutes on 2 CPU cores)")
    c = p.add_argument_group("client mode", "run the client side against an OpenAI-compatible endpoint instead")
    c.add_argument("--base-url", help="e.g. http://127.0.0.1:8000/v1 (`dsv41 serve`)")
    c.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer key (default $OPENAI_API_KEY)")
    c.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    c.add_argument("--timeout", type=float, default=3600.0, help="seconds per request (long prefills; default 3600)")
    p.set_defaults(func=run, compiles=True)
    return p


def run(args) -> int:
    preset = QUICK if args.quick else FULL
    contexts = _ints(args.contexts, "--contexts") if args.contexts else list(preset["contexts"])
    acc_contexts = (_ints(args.accuracy_contexts, "--accuracy-contexts") if args.accuracy_contexts
                    else list(preset["accuracy_contexts"]))
    full_size = (list(preset["full_size_contexts"]) if args.full_size_contexts is None else
                 _ints(args.full_size_contexts, "--full-size-contexts") if args.full_size_contexts.strip() else [])
    depths = passkey.parse_floats(args.depths, "--depths")
    if not depths or any(not 0 <= d <= 1 for d in depths):
        raise ConfigError("--depths", args.depths, "expected fractions in [0, 1]")
    n = preset["n"] if args.n is None else args.n
    if n < 1:
        raise ConfigError("--n", n, "expected at least 1 prompt per cell")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise ConfigError("--variants", args.variants, f"expected names from {list(VARIANTS)}")
    out = Path(args.out)

    def say(msg):
        print(f"  {msg}", file=sys.stderr, flush=True)

    if args.base_url:
        t0 = time.perf_counter()
        client = verify_client.client_report(args.base_url, api_key=args.api_key, model=args.model, contexts=contexts,
                                             depths=depths, n=n, seed=args.seed, timeout_s=args.timeout,
                                             progress=lambda r: say(f"client: context {r['context']} depth "
                                                                    f"{r['depth']:g}: {r['accuracy']:.0%}"))
        results = {"model": client["model"], "weights": "served", "machine": f"client of {args.base_url}",
                   "client": client, "doctor": [], "wall_s": time.perf_counter() - t0}
    else:
        cfg = load_config(args.config, [*args.set, *config_lib.weight_format_overrides(args.weight_format)])
        if cfg.architecture.family != "v41":
            raise ConfigError("--config", args.config, "a V4.1 config (the variants and the prefix cache are V4.1's)")
        params, weights = _load(cfg, args.config, args.weights)
        results = run_local(cfg, params, weights=weights, contexts=contexts, accuracy_contexts=acc_contexts,
                            depths=depths, variants=variants, n=n, seed=args.seed, chunk=args.chunk,
                            settle_s=preset["settle_s"], full_size_contexts=full_size, progress=say)
    verify_report.write(results, out)
    say(f"wrote {out / 'report.md'}, {out / 'results.json'} and {len(results['plots'])} plots")
    if args.json:
        print(json.dumps(results, default=verify_report.json_default))
    return 0


def _load(cfg, name: str, weights):
    from dsv41.convert import command_params

    params, path = command_params(cfg, name, weights)
    if path is None:
        print(f"  no weights ship with {name!r}: random weights (seed 0), whose retrieval means nothing",
              file=sys.stderr)
        return params, "random (seed 0)"
    return params, str(weights) if weights is not None else path.name
