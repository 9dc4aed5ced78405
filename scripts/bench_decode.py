#!/usr/bin/env python3
"""Prefill seconds, decode tokens/s and peak memory of dsv41's cached inference path against
transformers' `DeepseekV4ForCausalLM`, at several context lengths, in one table.

What is compared (random weights, batch 1 unless --batch, fp32, CPU):

* `hf-v4`        transformers `DeepseekV4ForCausalLM` with a toy **V4** config: hidden 128, 6 layers
                 (2 window-only, then CSA ratio 4 / HCA ratio 32 alternating), 8 heads x 64, indexer
                 8 x 32 top-32, 8 experts top-2 (3 hash-routed layers, as V4-Flash), window 128.
                 Prefill: one forward over the prompt with `use_cache=True`; decode: greedy steps
                 feeding the returned cache.
* `dsv41-v4`     dsv41 (`dsv41.prefill` / `dsv41.decode`, V4 compat) running **the same model**: the
                 config converted by `dsv41.config_from_transformers` and the weights of the very
                 transformers model `hf-v4` builds (same seed, loaded by `dsv41.params_from_transformers`),
                 on the same prompt. The table counts how many greedy tokens the two produce alike.
* `dsv41-toy`    dsv41 with the closest **V4.1** config: overrides
                 of `configs/tiny.json` to hidden 128, 8 heads x 64, 6 layers (encoder: 2 window-only +
                 Full/Reuse at ratio 2; decoder: Full/Reindex at ratio 1), indexer 8 x 32 top-32 in a
                 pool of 128 blocks x 8, 8 experts top-2, window 128, context raised to 128K.
                 (The cached path supports V4.1 only, so V4 itself cannot be run there.)
* `dsv41-tiny`   dsv41 with `configs/tiny.json` as shipped (12 layers, hidden 64, 32 indexer heads,
                 window 16), only its context window / RoPE range raised to 128K.
* `dsv41-toy-ced` (not in the default set) `dsv41-toy` with `runtime.prefill_schedule=ced`: the prompt
                 runs through the encoder and the decoder source's KV projections, the whole decoder only
                 for its last `decoder_replay_tokens` (128); decode is the same as `dsv41-toy`.

Each (implementation, context) runs in a fresh subprocess, so peak memory (the RSS high-water mark of
that process) is its own and an OOM or timeout leaves the rest of the table intact; a process that
goes over --mem-limit-gb is killed and reported as OOM (it also volunteers to the kernel's OOM killer
first). What a killed measurement had measured is kept: a prefill cut off by the timeout is reported
as a lower bound (">N"), and dsv41's chunk progress gives an estimate of the whole prefill. dsv41
prefills in fixed chunks (--chunk, the last one padded); its programs are compiled in a warm-up on a
throwaway cache (`compile s`: trace + lowering + XLA compile) and the timed prefill / decode are steady
state. The cache capacity is the context plus the decode steps, rounded up to the compression ratios.

The timings are only as good as the machine is quiet: the `other load` column is the average number
of cores other processes kept busy during each measurement. torch's intra-op threads suffer badly
when the machine is oversubscribed (decode 10x slower and more with 2 threads on 2 cores while
another core's worth of work runs); `--torch-threads 1` shows the difference.

    python scripts/bench_decode.py                 # 1K 4K 8K 16K 64K
    python scripts/bench_decode.py --quick         # 1K 4K
    python scripts/bench_decode.py --contexts 2K,8K --timeout 600 --json out.json
    python scripts/bench_decode.py --impls hf-v4,dsv41-toy,dsv41-toy-ced,dsv41-tiny
    python scripts/bench_decode.py --dsv41-src /tmp/export   # a `git archive HEAD` export (stable code)
    python scripts/bench_decode.py --from-json out.json      # print a saved run's table again
    python scripts/bench_decode.py --impls hf-v4,dsv41-v4 --contexts 8K --device-loop   # + the on-device loop
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONTEXTS = "1K,4K,8K,16K,64K"
QUICK_CONTEXTS = "1K,4K"
IMPLS = ("hf-v4", "dsv41-v4", "dsv41-toy", "dsv41-tiny", "dsv41-toy-ced")
DEFAULT_IMPLS = ("hf-v4", "dsv41-v4", "dsv41-toy", "dsv41-tiny")
MATCHED = ("dsv41-v4", "dsv41-toy", "dsv41-toy-ced")  # the dsv41 rows compared with hf-v4
MAX_POSITION = 131072  # RoPE range / context window of every config here (covers 64K + decode)

# --------------------------------------------------------------------------------------------------
# Configs

# The toy V4 of transformers (see the module docstring).
HF_V4 = dict(
    vocab_size=256, hidden_size=128, num_hidden_layers=6, num_attention_heads=8, head_dim=64,
    partial_rotary_factor=16 / 64, q_lora_rank=64, o_groups=2, o_lora_rank=32,
    moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    layer_types=["sliding_attention"] * 2 + ["compressed_sparse_attention", "heavily_compressed_attention"] * 2,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
    index_n_heads=8, index_head_dim=32, index_topk=32, sliding_window=128,
    max_position_embeddings=MAX_POSITION,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": MAX_POSITION // 4,
                     "beta_fast": 32, "beta_slow": 1},
)

_CONTEXT = [f"context_window={MAX_POSITION}", f"architecture.rope.max_position={MAX_POSITION}"]

# The matched V4.1 toy: overrides of configs/tiny.json.
DSV41_TOY = _CONTEXT + [
    "architecture.hidden_size=128", "architecture.num_heads=8", "architecture.head_dim=64",
    "architecture.rope_head_dim=16", "architecture.q_lora_rank=64", "architecture.o_groups=2",
    "architecture.o_lora_rank=32", "architecture.moe.num_experts=8", "architecture.moe.top_k=2",
    "architecture.moe.intermediate_size=64", f"architecture.rope.yarn_original_max_position={MAX_POSITION // 4}",
    "kv_cache.swa_window_size=128", "swa_bounded_replay.encoder_replay_tokens=128",
    "swa_bounded_replay.decoder_replay_tokens=128",
    "csa2.encoder.layers=4", 'csa2.encoder.groups=[{"size": 2, "modes": ["full", "reuse"]}]',
    "csa2.decoder.layers=2", 'csa2.decoder.groups=[{"size": 2, "modes": ["full", "reindex"]}]',
    "csa2.indexer.query_heads=8", "csa2.indexer.head_dim=32", "csa2.indexer.top_k=32",
    "csa2.indexer.hierarchical.max_blocks=128", "csa2.indexer.hierarchical.positions_per_block=8",
    "csa2.indexer.hierarchical.candidate_pool_size=1024",
]
DSV41_TINY = list(_CONTEXT)
# The CED prefill schedule (DESIGN §3.5, runtime.prefill_schedule): encoder + the decoder source's KV for every
# token, the rest of the decoder only for the last decoder_replay_tokens of the prompt.
DSV41_TOY_CED = DSV41_TOY + ["runtime.prefill_schedule=ced"]
OVERRIDES = {"dsv41-toy": DSV41_TOY, "dsv41-tiny": DSV41_TINY, "dsv41-toy-ced": DSV41_TOY_CED}
GREEDY_COMPARED = 16  # greedy tokens of dsv41-v4 and hf-v4 compared (the first from the prefill)

DESCRIPTIONS = {
    "hf-v4": "transformers DeepseekV4ForCausalLM, toy V4: hidden 128, 6 layers (2 window, CSA/4 + HCA/32 x2), "
             "8x64 heads, indexer 8x32 top-32, 8 experts top-2, window 128",
    "dsv41-v4": "dsv41 prefill/decode (V4 compat) of the same model: hf-v4's config and weights, same prompt",
    "dsv41-toy": "dsv41 prefill/decode, V4.1 at the matched toy size: hidden 128, 6 layers (2 window, enc Full+Reuse "
                 "/2, dec Full+Reindex /1), 8x64 heads, indexer 8x32 top-32 (pool 128x8), 8 experts top-2, window 128",
    "dsv41-tiny": "dsv41 prefill/decode, configs/tiny.json (12 layers, hidden 64, 4x64 heads, indexer 32x32 top-8, "
                  "pool 4x8, window 16), context raised to 128K",
    "dsv41-toy-ced": "dsv41-toy with runtime.prefill_schedule=ced (prefill: encoder + decoder source KV for every "
                     "token, the whole decoder for the last 128 only)",
}


def parse_context(text: str) -> int:
    text = text.strip().upper()
    return int(float(text[:-1]) * 1024) if text.endswith("K") else int(text)


def fmt_context(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


# --------------------------------------------------------------------------------------------------
# Workers (one measurement each, in its own process). Each prints what it has measured so far as
# "PARTIAL {json}" lines (kept by the driver when the process is killed) and "RESULT {json}" at the end.


def partial(out: dict, **values) -> None:
    out.update(values)
    print("PARTIAL " + json.dumps(values), flush=True)


def rss_gb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # KiB on Linux


def hf_model(seed: int):
    """The toy transformers V4 of `hf-v4` (and, converted, of `dsv41-v4`): deterministic given the seed."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**HF_V4)
    model = DeepseekV4ForCausalLM(cfg).eval()
    with torch.no_grad():  # the hash routes are zeros at init (all tokens to the same experts): spread them
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                n = cfg.n_routed_experts
                b.copy_(torch.stack([torch.randperm(n)[: b.shape[1]] for _ in range(b.shape[0])]))
    return model


def prompt(seed: int, vocab: int, ctx: int, batch: int = 1):
    """[batch, ctx] random prompt ids; row 0 is the batch-1 prompt whatever the batch."""
    import numpy as np

    rng = np.random.default_rng(seed + 1)
    first = rng.integers(0, vocab, (1, ctx), dtype=np.int32)
    return np.concatenate([first, rng.integers(0, vocab, (batch - 1, ctx), dtype=np.int32)])


def worker_hf(ctx: int, steps: int, seed: int, threads: int | None, batch: int = 1) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    model = hf_model(seed)
    tokens = torch.from_numpy(prompt(seed, model.config.vocab_size, ctx, batch)).long()
    out = {}
    partial(out, rss_after_init_gb=rss_gb(), threads=torch.get_num_threads(), prefill_start_epoch=time.time())
    with torch.no_grad():
        t0 = time.perf_counter()
        res = model(tokens, use_cache=True, logits_to_keep=1)
        partial(out, prefill_s=time.perf_counter() - t0, rss_after_prefill_gb=rss_gb())
        cache = res.past_key_values
        nxt = res.logits[:, -1].argmax(-1)
        greedy = [int(nxt[0])]
        times = []
        for _ in range(steps + 1):  # the first step is a warm-up, as for dsv41
            t0 = time.perf_counter()
            res = model(nxt[:, None], past_key_values=cache, use_cache=True)
            nxt = res.logits[:, -1].argmax(-1)
            times.append(time.perf_counter() - t0)
            cache = res.past_key_values
            greedy.append(int(nxt[0]))
    out["greedy"] = greedy[:GREEDY_COMPARED]
    out["decode_tok_s"] = batch * steps / sum(times[1:])
    out["decode_median_tok_s"] = batch / sorted(times[1:])[len(times[1:]) // 2]
    out["first_decode_s"] = times[0]
    return out


def worker_dsv41(impl: str, ctx: int, steps: int, seed: int, chunk: int, batch: int = 1,
                 device_loop: bool = False) -> dict:
    import jax
    import numpy as np

    import dsv41
    from dsv41.plan import layer_plan

    compile_events = {"/jax/core/compile/jaxpr_trace_duration": 0.0,
                      "/jax/core/compile/jaxpr_to_mlir_module_duration": 0.0,
                      "/jax/core/compile/backend_compile_duration": 0.0}

    def on_duration(event, secs, **_):
        if event in compile_events:
            compile_events[event] += secs

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    if impl == "dsv41-v4":  # the transformers model itself, converted
        reference = hf_model(seed)
        cfg = dsv41.config_from_transformers(reference.config.to_dict())
        params = dsv41.params_from_transformers(reference.state_dict(), cfg)
        del reference
    else:
        cfg = dsv41.load_config(Path(dsv41.__file__).resolve().parent.parent / "configs" / "tiny.json",
                                overrides=OVERRIDES[impl])
        params = dsv41.init_params(cfg, jax.random.key(seed))
    ced = cfg.runtime.get("prefill_schedule", "full") == "ced"
    final = {"final": True} if ced else {}  # older checkouts have no `final` argument
    ratios = sorted({r.ratio for r in layer_plan(cfg) if r.ratio}) or [1]
    step = math.lcm(*ratios)
    max_len = -(-(ctx + steps + 1) // step) * step
    tokens = prompt(seed, cfg.architecture.vocab_size, ctx, batch)
    chunk = min(chunk, ctx)
    out = {}
    partial(out, rss_after_init_gb=rss_gb(), chunk=chunk, max_len=max_len, devices=[str(d) for d in jax.devices()])

    # Warm-up (compile): one chunk and one decode step on a throwaway cache of the same shapes.
    for k in compile_events:
        compile_events[k] = 0.0
    t0 = time.perf_counter()
    cache = dsv41.init_cache(cfg, batch, max_len)
    if ced and ctx > chunk:  # the CED schedule compiles a separate program for the non-final chunks
        _, cache = dsv41.prefill(params, cfg, cache, tokens[:, :chunk], final=False)
    logits, cache = dsv41.prefill(params, cfg, cache, tokens[:, :chunk], **final)
    logits, cache = dsv41.decode(params, cfg, cache, np.asarray(logits).argmax(-1))
    jax.block_until_ready((logits, cache))
    partial(out, warmup_s=time.perf_counter() - t0,  # compile + one chunk + one decode step
            compile_s=sum(compile_events.values()),
            compile_breakdown_s={k.rsplit("/", 1)[1]: v for k, v in compile_events.items()})
    if device_loop:  # compiles the on-device loop's block for these shapes (its own figure)
        from dsv41 import generate as gen
        before = sum(compile_events.values())
        gen.generate_from(params, cfg, cache, logits, max_new_tokens=1, loop="device", block=steps + 1)  # same program
        partial(out, compile_device_loop_s=sum(compile_events.values()) - before)
    del cache, logits

    # The steps bound once to the parameters and config, as a serving loop holds them (checkouts from
    # before `dsv41.bind` run the free functions, which flatten the parameters every call).
    bound = dsv41.bind(params, cfg) if hasattr(dsv41, "bind") else None
    prefill = bound.prefill if bound else lambda *a, **k: dsv41.prefill(params, cfg, *a, **k)
    decode = bound.decode if bound else lambda *a, **k: dsv41.decode(params, cfg, *a, **k)
    partial(out, bound_steps=bound is not None)

    def prefill_prompt(cache, on_chunk=None):
        """The prompt through an empty cache in chunks of the compiled shape [batch, chunk] (the last one
        padded): (logits, cache); on_chunk(cache, tokens so far) after each chunk."""
        for start in range(0, ctx, chunk):
            piece = tokens[:, start:start + chunk]
            n = piece.shape[1]
            if n < chunk:
                piece = np.pad(piece, [(0, 0), (0, chunk - n)])
            logits, cache = prefill(cache, piece, lengths=[n] * batch,
                                    **({"final": start + chunk >= ctx} if ced else {}))
            if on_chunk is not None:
                on_chunk(cache, start + n)
        return jax.block_until_ready((logits, cache))

    def progress(cache, done):
        jax.block_until_ready(cache.lengths)
        partial(out, prefilled_tokens=done, prefill_elapsed_s=time.perf_counter() - t0)

    cache = jax.block_until_ready(dsv41.init_cache(cfg, batch, max_len))
    partial(out, prefill_start_epoch=time.time())
    t0 = time.perf_counter()
    logits, cache = prefill_prompt(cache, progress)
    partial(out, prefill_s=time.perf_counter() - t0, rss_after_prefill_gb=rss_gb(),
            compile_s_after_warmup=sum(compile_events.values()) - out["compile_s"])  # 0: no recompilation
    nxt = np.asarray(logits).argmax(-1)
    greedy = [int(nxt[0])]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits, cache = decode(cache, nxt)
        nxt = np.asarray(logits).argmax(-1)  # greedy: the host needs each token before the next step
        times.append(time.perf_counter() - t0)
        greedy.append(int(nxt[0]))
    out["greedy"] = greedy[:GREEDY_COMPARED]
    out["decode_tok_s"] = batch * steps / sum(times)
    out["decode_median_tok_s"] = batch / float(np.median(times))
    assert int(np.asarray(cache.lengths)[0]) == ctx + steps
    if device_loop:
        # The same prompt prefilled again (the host loop consumed the first cache), then the steps + 1 greedy
        # tokens of the host loop drawn by `generate_from(loop="device")`: one lax.while_loop of steps + 1
        # decode steps (the last runs with no live row) and the host reads the block once.
        del cache, logits
        logits, cache = prefill_prompt(jax.block_until_ready(dsv41.init_cache(cfg, batch, max_len)))
        from dsv41 import generate as gen
        t0 = time.perf_counter()
        drawn = gen.generate_from(params, cfg, cache, logits, max_new_tokens=steps + 1, loop="device",
                                  block=steps + 1)
        elapsed = time.perf_counter() - t0
        out["decode_device_tok_s"] = batch * (steps + 1) / elapsed
        out["greedy_device_same"] = drawn[0][:GREEDY_COMPARED] == out["greedy"]
        out["compile_s_after_device_loop"] = sum(compile_events.values()) - out["compile_s"] - out[
            "compile_device_loop_s"]  # 0: the timed loop compiled nothing
    return out


def worker_main(args) -> None:
    try:  # if the machine runs out of memory, let the kernel kill this measurement rather than a neighbour
        Path("/proc/self/oom_score_adj").write_text("1000")
    except OSError:
        pass
    if args.impl == "hf-v4":
        out = worker_hf(args.ctx, args.decode_steps, args.seed, args.torch_threads, args.batch)
    else:
        out = worker_dsv41(args.impl, args.ctx, args.decode_steps, args.seed, args.chunk, args.batch,
                           args.device_loop)
    out["peak_self_gb"] = peak_rss_gb()
    print("RESULT " + json.dumps(out), flush=True)


# --------------------------------------------------------------------------------------------------
# Driver


def busy_seconds() -> float:
    """CPU seconds all processes of the machine have spent busy since boot (/proc/stat)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def run_one(impl: str, ctx: int, args) -> dict:
    """Runs one measurement in a subprocess; watches its RSS (kills it above --mem-limit-gb)."""
    import psutil

    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--impl", impl, "--ctx", str(ctx),
           "--decode-steps", str(args.decode_steps), "--seed", str(args.seed), "--chunk", str(args.chunk),
           "--batch", str(args.batch)] + (["--device-loop"] if args.device_loop else [])
    if args.torch_threads:
        cmd += ["--torch-threads", str(args.torch_threads)]
    env = dict(os.environ, PYTHONPATH=str(args.dsv41_src) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryFile("w+") as log:
        busy0, t0 = busy_seconds(), time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
        ps = psutil.Process(proc.pid)
        status, polled = None, 0.0
        while True:
            pid, code, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(code)
                break
            try:
                polled = max(polled, ps.memory_info().rss / 2**30)
            except psutil.Error:
                pass
            elapsed = time.perf_counter() - t0
            if status is None and elapsed > args.timeout:
                status = "timeout"
            elif status is None and polled > args.mem_limit_gb:
                status = "OOM"
            if status is not None:
                proc.send_signal(signal.SIGKILL)
            time.sleep(0.1)
        wall, end_epoch = time.perf_counter() - t0, time.time()
        busy = busy_seconds() - busy0
        log.seek(0)
        text = log.read()
    peak = max(polled, usage.ru_maxrss * 1024 / 2**30)
    own_cpu = usage.ru_utime + usage.ru_stime
    # Other processes' average busy cores while this one ran: the machine is not always ours alone.
    row = {"impl": impl, "context": ctx, "wall_s": wall, "peak_gb": peak, "cpu_s": own_cpu,
           "other_load": max(0.0, (busy - own_cpu) / wall)}
    for line in text.splitlines():
        if line.startswith("PARTIAL "):
            row.update(json.loads(line[len("PARTIAL "):]))
    if "prefill_s" not in row and "prefill_start_epoch" in row:  # killed during the prefill
        row["prefill_lower_bound_s"] = end_epoch - row["prefill_start_epoch"]
    result = [line for line in text.splitlines() if line.startswith("RESULT ")]
    if status is None and proc.returncode == 0 and result:
        row.update(json.loads(result[-1][len("RESULT "):]))
        row["status"] = "ok"
        return row
    if status is None:
        oom = proc.returncode == -signal.SIGKILL or any(
            s in text for s in ("MemoryError", "RESOURCE_EXHAUSTED", "Out of memory", "can't allocate memory",
                                "DefaultCPUAllocator"))
        status = "OOM" if oom else "error"
        row["error"] = text[-2000:]
    row["status"] = status
    return row


def prefill_of(row: dict | None) -> tuple[float | None, str]:
    """(seconds, "exact" | "lower"): the prefill time, or a lower bound when the process was killed in it."""
    if row is None or row["status"] == "skipped":
        return None, ""
    if "prefill_s" in row:
        return row["prefill_s"], "exact"
    if "prefill_lower_bound_s" in row:
        return row["prefill_lower_bound_s"], "lower"
    return None, ""


def prefill_cell(row: dict | None) -> str:
    v, kind = prefill_of(row)
    if v is None or (kind == "lower" and row["status"] == "OOM"):
        return "-" if row is None else row["status"]
    return f"{v:.2f}" if kind == "exact" else f">{v:.0f}"


def decode_cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if "decode_tok_s" not in row:
        return row["status"]
    device = f" / {row['decode_device_tok_s']:.0f}" if "decode_device_tok_s" in row else ""
    return f"{row['decode_tok_s']:.1f}{device}"


def fmt_ratio(v: float) -> str:
    return f"{v:.2f}x" if v < 100 else f"{v:.0f}x"


def prefill_speedup(d: dict | None, h: dict | None) -> str:
    """transformers' prefill time over dsv41's (bounds where a prefill was cut off)."""
    (vd, kd), (vh, kh) = prefill_of(d), prefill_of(h)
    if vd is None or vh is None:
        return "-"
    if kd == kh == "exact":
        return fmt_ratio(vh / vd)
    if kd == "exact" and h["status"] == "OOM":  # it never finishes: no bound worth printing
        return "(OOM)"
    if kh == "exact" and d["status"] == "OOM":
        return "(OOM)"
    if kd == "exact":  # transformers took longer than vh
        return ">" + fmt_ratio(vh / vd)
    if kh == "exact":
        return "<" + fmt_ratio(vh / vd)
    return "?"


def decode_speedup(d: dict | None, h: dict | None) -> str:
    if d is None or h is None:
        return "-"
    if "decode_tok_s" in d and "decode_tok_s" in h:
        device = f" / {fmt_ratio(d['decode_device_tok_s'] / h['decode_tok_s'])}" if "decode_device_tok_s" in d else ""
        return fmt_ratio(d["decode_tok_s"] / h["decode_tok_s"]) + device
    return "(" + (h["status"] if "decode_tok_s" not in h else d["status"]) + ")"


def hardware() -> dict:
    import psutil

    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": model, "cpu_count": os.cpu_count(), "ram_gb": psutil.virtual_memory().total / 2**30,
            "python": platform.python_version()}
    try:
        import jax
        import torch
        import transformers

        info.update(jax=jax.__version__, jax_devices=[str(d) for d in jax.devices()], torch=torch.__version__,
                    torch_threads=torch.get_num_threads(), transformers=transformers.__version__)
    except Exception as e:  # noqa: BLE001 - the table is still worth printing
        info["versions_error"] = repr(e)
    return info


def source_info(src: Path) -> dict:
    info = {"dsv41_src": str(src)}
    try:
        info["dsv41_commit"] = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--", "dsv41", "configs"],
                               capture_output=True, text=True, check=True).stdout.strip()
        info["dsv41_dirty"] = bool(dirty)
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def print_table(rows: list[dict], contexts: list[int], impls: list[str], hw: dict, args) -> None:
    by = {(r["impl"], r["context"]): r for r in rows}
    print()
    print(f"Hardware: {hw['cpu']}, {hw['cpu_count']} CPUs, {hw['ram_gb']:.1f} GB RAM; "
          f"jax {hw.get('jax')} devices {hw.get('jax_devices')}; torch {hw.get('torch')} "
          f"({hw.get('torch_threads')} threads); transformers {hw.get('transformers')}")
    src = hw.get("source", {})
    print(f"dsv41 measured from {src.get('dsv41_src')}" + (f" (commit {src['dsv41_commit']}"
          f"{', with uncommitted changes to dsv41/ or configs/' if src.get('dsv41_dirty') else ''})"
          if "dsv41_commit" in src else ""))
    threads = args.torch_threads or hw.get("torch_threads")
    print(f"Batch {getattr(args, 'batch', 1)}, fp32, random weights, torch threads {threads}; decode: {args.decode_steps} greedy steps after the prompt; "
          f"dsv41 prefill in chunks of {args.chunk}; timeout {args.timeout:.0f} s, memory limit "
          f"{args.mem_limit_gb:.1f} GB per measurement.")
    for impl in impls:
        print(f"  {impl:13s} {DESCRIPTIONS[impl]}")
    print("NOTE: dsv41-v4 and hf-v4 are one model (same config, weights and prompt); the other dsv41-* rows are")
    print("      DeepSeek-V4.1 at a matched toy size (a different architecture: their ratios compare implementations).")
    print("      peak GB: RSS high-water mark of the measurement's own process (runtime + weights + activations + cache);")
    print("      compile s: dsv41's jit trace + lowering + XLA compile, outside the timed prefill / decode;")
    if getattr(args, "device_loop", False):
        print("      decode tok/s A / B (dsv41): A the host loop (one decode call per token), B the on-device loop")
        print("      (generate_from, loop='device'); its compile is not in compile s; greedy: host loop's tokens;")
        print("      device=: whether the device loop drew the same first greedy tokens.")
    print("      other load: average cores kept busy by other processes of the machine during the measurement.")
    print()
    head = (f"{'implementation':14s} {'context':>7s} {'prefill s':>10s} {'decode tok/s':>12s} {'peak GB':>8s} "
            f"{'compile s':>9s} {'other load':>10s}  status")
    print(head)
    print("-" * len(head))
    notes = []
    for impl in impls:
        for ctx in contexts:
            r = by.get((impl, ctx))
            if r is None:
                continue
            if r["status"] == "skipped":
                peak = "-"
                notes.append(f"{impl} {fmt_context(ctx)}: skipped after {r['reason']} (--no-skip runs it)")
            elif r["status"] == "OOM" and r["peak_gb"] >= args.mem_limit_gb:
                peak = f">{args.mem_limit_gb:.0f}"
            else:
                peak = f"{r['peak_gb']:.2f}"
            comp = f"{r['compile_s']:.1f}" if r.get("compile_s") is not None else "-"
            load = f"{r['other_load']:.2f}" if "other_load" in r else "-"
            print(f"{impl:14s} {fmt_context(ctx):>7s} {prefill_cell(r):>10s} "
                  f"{decode_cell(r):>12s} {peak:>8s} {comp:>9s} {load:>10s}  {r['status']}")
            if r["status"] in ("timeout", "OOM") and "prefill_s" not in r and "prefilled_tokens" in r:
                done, el = r["prefilled_tokens"], r["prefill_elapsed_s"]
                est = f", about {el * ctx / done:.0f} s for the whole prompt at that rate" if done < ctx else ""
                notes.append(f"{impl} {fmt_context(ctx)}: {r['status']} after {r['wall_s']:.0f} s: prefilled {done} "
                             f"of {ctx} tokens in {el:.0f} s{est}")
            elif r["status"] in ("timeout", "OOM"):
                where = ("in the warm-up (compile + first chunk)" if "compile_s" not in r and r["impl"] != "hf-v4" else
                         f"{r['prefill_lower_bound_s']:.0f} s into the prefill" if "prefill_lower_bound_s" in r else
                         "in the decode" if "prefill_s" in r else "before the prefill")
                notes.append(f"{impl} {fmt_context(ctx)}: {r['status']} after {r['wall_s']:.0f} s, {where} "
                             f"(peak {r['peak_gb']:.2f} GB)")
    for impl in [i for i in MATCHED if i in impls and "hf-v4" in impls]:
        print()
        same = impl == "dsv41-v4"
        print(f"{impl} vs hf-v4 " + ("(the same V4 model)" if same else "(V4.1 vs V4 at the same toy size)") +
              ": speedups (>1: dsv41 faster) and peak memory ratio dsv41 / transformers (<1: dsv41 smaller)" +
              (f"; greedy: how many of the first {GREEDY_COMPARED} greedy tokens agree before the first difference"
               if same else ""))
        head = (f"{'context':>7s} {'prefill speedup':>16s} {'decode speedup':>15s} {'peak memory ratio':>18s}"
                + (f" {'greedy':>8s}" if same else ""))
        print(head)
        print("-" * len(head))
        for ctx in contexts:
            d, h = by.get((impl, ctx)), by.get(("hf-v4", ctx))
            if d is None or h is None:
                continue
            mem = "-"
            if d["status"] == "ok" and h["status"] == "ok":
                mem = f"{d['peak_gb'] / h['peak_gb']:.2f}"
            elif d["status"] == "ok" and h["status"] in ("OOM", "timeout"):  # transformers needed at least this
                mem = f"<{d['peak_gb'] / h['peak_gb']:.2f}"
            agree = ""
            if same:
                a, b = d.get("greedy"), h.get("greedy")
                n = min(len(a or []), len(b or []))
                common = next((i for i in range(n) if a[i] != b[i]), n)
                agree = f" {'-':>8s}" if not n else f" {common:>3d}/{n:<4d}"
                if "greedy_device_same" in d:
                    agree += f" device={'same' if d['greedy_device_same'] else 'DIFFERENT'}"
            print(f"{fmt_context(ctx):>7s} {prefill_speedup(d, h):>16s} "
                  f"{decode_speedup(d, h):>15s} {mem:>18s}{agree}")
    if notes:
        print()
        for n in notes:
            print("  " + n)
    for r in rows:
        if r["status"] == "error":
            print(f"\n{r['impl']} at {fmt_context(r['context'])}: error:\n{r.get('error', '')}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--contexts", default=None, help=f"comma-separated, K = 1024 (default {DEFAULT_CONTEXTS})")
    p.add_argument("--quick", action="store_true", help=f"contexts {QUICK_CONTEXTS} only")
    p.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                   help=f"some of {','.join(IMPLS)} (default {','.join(DEFAULT_IMPLS)})")
    p.add_argument("--dsv41-src", type=Path, default=REPO,
                   help="the checkout whose dsv41 package and configs/ are measured (default: this repository;\n"
                        "e.g. a `git archive HEAD` export, to measure a commit while the work tree changes)")
    p.add_argument("--decode-steps", type=int, default=64, help="timed greedy decode steps (default 64)")
    p.add_argument("--chunk", type=int, default=1024, help="dsv41 prefill chunk in tokens (default 1024)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per measurement (default 300)")
    p.add_argument("--mem-limit-gb", type=float, default=None,
                   help="kill a measurement above this RSS and report OOM (default: the smaller of 85%% of RAM\n"
                        "and the memory available at the start less 1.5 GB)")
    p.add_argument("--no-skip", action="store_true",
                   help="run longer contexts of an implementation even after it ran out of memory or time")
    p.add_argument("--json", metavar="PATH", help="also write every measurement as JSON ('-' for stdout)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch.set_num_threads for transformers (default: torch's own, one per core); with other\n"
                        "processes busy on the machine, 1 can be much faster than oversubscribed cores")
    p.add_argument("--from-json", metavar="PATH", type=Path,
                   help="print the table of a previous run's --json output instead of measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=1,
                   help="rows decoded together (default 1); tokens/s counts every row, greedy compares row 0")
    p.add_argument("--device-loop", action="store_true",
                   help="also time dsv41's on-device decode loop (generate_from, loop='device') over the same greedy\n"
                        "tokens, from a second prefill of the prompt (compiled in the warm-up; peak memory unchanged)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", help=argparse.SUPPRESS)
    p.add_argument("--ctx", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args)
        return 0

    import psutil

    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        for k, v in saved["args"].items():
            if k not in ("from_json", "json"):
                setattr(args, k, v)
        rows = saved["rows"]
        print_table(rows, sorted({r["context"] for r in rows}), list(dict.fromkeys(r["impl"] for r in rows)),
                    saved["hardware"], args)
        print(f"\nTotal wall time: {saved['total_wall_s']:.0f} s")
        return 0
    if args.mem_limit_gb is None:  # what the machine can give one process now, less a margin
        vm = psutil.virtual_memory()
        args.mem_limit_gb = min(0.85 * vm.total, vm.available - 1.5 * 2**30) / 2**30
    contexts = [parse_context(c) for c in (args.contexts or (QUICK_CONTEXTS if args.quick else DEFAULT_CONTEXTS))
                .split(",")]
    impls = [i.strip() for i in args.impls.split(",")]
    for i in impls:
        if i not in IMPLS:
            p.error(f"--impls: unknown {i!r}; expected some of {IMPLS}")
    hw = hardware()
    hw["source"] = source_info(args.dsv41_src)
    print(f"bench_decode: contexts {[fmt_context(c) for c in contexts]}, implementations {impls}; "
          f"{hw['cpu_count']} CPUs, {hw['ram_gb']:.1f} GB RAM, jax devices {hw.get('jax_devices')}", flush=True)
    rows, failed = [], {}
    t_start = time.perf_counter()
    for ctx in sorted(contexts):
        for impl in impls:
            if impl in failed and not args.no_skip:
                rows.append({"impl": impl, "context": ctx, "status": "skipped", "reason": failed[impl], "peak_gb": 0.0})
                continue
            row = run_one(impl, ctx, args)
            rows.append(row)
            if row["status"] in ("OOM", "timeout"):
                failed[impl] = f"{row['status']} at {fmt_context(ctx)}"
            keys = ("prefill_s", "prefill_lower_bound_s", "decode_tok_s", "peak_gb", "compile_s", "other_load")
            msg = ", ".join(f"{k} {row[k]:.2f}" for k in keys if isinstance(row.get(k), float))
            print(f"  {impl:13s} {fmt_context(ctx):>4s}: {row['status']:8s} {msg} (wall {row['wall_s']:.0f} s)"
                  if "wall_s" in row else f"  {impl:13s} {fmt_context(ctx):>4s}: {row['status']}", flush=True)
    total = time.perf_counter() - t_start
    print_table(rows, sorted(contexts), impls, hw, args)
    print(f"\nTotal wall time: {total:.0f} s")
    if args.json:
        blob = json.dumps({"hardware": hw, "args": {k: v for k, v in vars(args).items()
                                                    if k not in ("worker", "impl", "ctx")},
                           "configs": {"hf-v4": HF_V4, **OVERRIDES},
                           "descriptions": DESCRIPTIONS, "rows": rows, "total_wall_s": total}, indent=1, default=str)
        if args.json == "-":
            print(blob)
        else:
            Path(args.json).write_text(blob + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
