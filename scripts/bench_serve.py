#!/usr/bin/env python3
"""Serving benchmark for an OpenAI-compatible server (`dsv41 serve`), in the manner of `vllm bench serve`.

N clients stream completions (`/v1/completions` or `/v1/chat/completions`) from a running server, or
from one this script starts, and the script prints request and token throughput and the time to first
token (TTFT), time per output token (TPOT), inter-token latency (ITL) and end-to-end latency (E2EL).

  python scripts/bench_serve.py --start-server --num-prompts 4 --concurrency 2 --input-len 256 --output-len 8
  python scripts/bench_serve.py --base-url http://127.0.0.1:8000/v1 --concurrency 1,4,16,32
  python scripts/bench_serve.py --request-rate 2 --duration 60 --shared-prefix-len 768 --json
  python scripts/bench_serve.py --start-server --server-args "--slots 16" --endpoint chat --api-key KEY

Prompts are ASCII words drawn from --seed, each exactly --input-len characters, which the byte-level
tokenizer of the default passkey model reads as --input-len tokens; the first --shared-prefix-len
characters are the same in every prompt (and in every pass), the rest differs per request and per
pass, so the prefix cache's hit rate (cached / prompt tokens, from the server's `usage`) measures
the shared prefix only. `dsv41 serve` keeps its prefix cache on disk, so a rerun with the same --seed
finds its prompts cached: vary --seed, or pass --server-args "--no-prefix-cache" for a cold server.
Under --endpoint chat the chat template adds its own tokens to the prompt.
Token counts come from the server's `usage` chunk (`stream_options.include_usage`).

Arrivals: --request-rate inf (the default) sends every request at once, at most --concurrency in
flight; a finite rate spaces arrivals by exponential (Poisson) gaps from a seeded RNG. A comma list
of concurrencies runs one pass per value and prints one row per pass. --warmup requests (not
measured) go first, so that the server's compilation does not count in the first pass.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import requests

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu the of and to "
         "in is was for on with as by at from river stone cloud lamp paper garden window seven "
         "blue quiet north rapid silver orange market").split()
MAX_ERRORS_SHOWN = 5  # distinct error messages kept per pass
STATS = (("mean", "Mean", None), ("median", "Median", 50.0), ("p90", "P90", 90.0), ("p99", "P99", 99.0))


@dataclass
class RequestResult:
    """One request's outcome; times in seconds from its own start (ttft, latency, itl gaps)."""
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    has_usage: bool = False
    ttft: float | None = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    end: float = 0.0  # perf_counter at completion


# --------------------------------------------------------------------------------------------- prompts

def words_text(rng: random.Random, n: int) -> str:
    """Exactly n characters of space-separated random words."""
    parts: list[str] = []
    size = 0
    while size < n:
        word = rng.choice(WORDS)
        parts.append(word)
        size += len(word) + 1
    return " ".join(parts)[:n].ljust(n)


def make_prompt(seed: int, pass_index: int, index: int, input_len: int, prefix_len: int) -> str:
    """The shared prefix (same for every request and pass) + a unique rest, input_len characters."""
    prefix_len = min(prefix_len, input_len)
    prefix = words_text(random.Random(f"prefix-{seed}"), prefix_len)
    tag = f"[{pass_index}.{index}] "
    rest = tag + words_text(random.Random(f"rest-{seed}-{pass_index}-{index}"), input_len)
    return prefix + rest[:input_len - prefix_len]


# --------------------------------------------------------------------------------------------- client

class Client:
    """Streams one request at a time from the server's completions or chat endpoint."""

    def __init__(self, base_url: str, api_key: str | None, model: str, endpoint: str, output_len: int,
                 temperature: float, timeout: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model, self.endpoint, self.output_len = model, endpoint, output_len
        self.temperature, self.timeout = temperature, timeout

    def payload(self, prompt: str, seed: int) -> dict:
        body = {"model": self.model, "max_tokens": self.output_len, "temperature": self.temperature,
                "stream": True, "stream_options": {"include_usage": True}, "seed": seed}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

    def url(self) -> str:
        return f"{self.base_url}/{'chat/completions' if self.endpoint == 'chat' else 'completions'}"

    def delta_text(self, choice: dict) -> str:
        if self.endpoint == "chat":
            return (choice.get("delta") or {}).get("content") or ""
        return choice.get("text") or ""

    def send(self, prompt: str, seed: int) -> RequestResult:
        """One streamed request; every failure (HTTP, transport, malformed stream, timeout) is recorded."""
        result = RequestResult()
        start = time.perf_counter()
        try:
            self._stream(prompt, seed, start, result)
        except Exception as e:  # noqa: BLE001 -- a benchmark records every failure and goes on
            result.error = f"{type(e).__name__}: {e}"
        result.end = time.perf_counter()
        result.latency = result.end - start
        result.ok = not result.error
        return result

    def _stream(self, prompt: str, seed: int, start: float, result: RequestResult) -> None:
        deadline = start + self.timeout
        last_text_at: float | None = None
        with requests.post(self.url(), json=self.payload(prompt, seed), headers=self.headers, stream=True,
                           timeout=(min(10.0, self.timeout), self.timeout)) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {r.text[:300]}"
                return
            for chunk in sse_events(r.iter_lines(decode_unicode=False)):
                now = time.perf_counter()
                if now > deadline:
                    result.error = f"timeout after {self.timeout:g} s"
                    return
                if "error" in chunk:
                    result.error = f"server error: {json.dumps(chunk['error'])[:300]}"
                    return
                if chunk.get("usage"):
                    read_usage(chunk["usage"], result)
                choices = chunk.get("choices") or []
                if choices and self.delta_text(choices[0]):
                    if last_text_at is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last_text_at)
                    last_text_at = now


def sse_events(lines: Iterator[bytes]) -> Iterator[dict]:
    """The JSON payloads of `data:` lines, up to `data: [DONE]`."""
    for raw in lines:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):  # blank separators, `:` comments, `event:` lines
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)
    raise ValueError("stream ended without `data: [DONE]`")


def read_usage(usage: dict, result: RequestResult) -> None:
    result.has_usage = True
    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    result.completion_tokens = int(usage.get("completion_tokens") or 0)
    result.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


# --------------------------------------------------------------------------------------------- passes

def arrival_gaps(rate: float, rng: random.Random) -> Iterator[float]:
    """Seconds before each request: 0 at an infinite rate, else exponential (Poisson arrivals)."""
    while True:
        yield 0.0 if math.isinf(rate) else rng.expovariate(rate)


def run_pass(client: Client, prompt_of: Callable[[int], str], *, concurrency: int, num_prompts: int,
             duration: float | None, rate: float, seed: int) -> tuple[list[RequestResult], float]:
    """Issue requests (num_prompts of them, or for `duration` seconds) with at most `concurrency` in
    flight; return the results and the wall time from the first send to the last completion."""
    slots = threading.BoundedSemaphore(concurrency)
    futures: list[cf.Future[RequestResult]] = []
    gaps = arrival_gaps(rate, random.Random(seed))
    slot_wait = 2 * client.timeout + 30  # a slot frees when a request ends, at the latest after its timeout
    start = time.perf_counter()
    stop_issuing = start + duration if duration is not None else math.inf
    next_arrival = start
    pool = cf.ThreadPoolExecutor(max_workers=concurrency)
    try:
        for i in range(num_prompts if duration is None else sys.maxsize):
            next_arrival += next(gaps)
            if next_arrival >= stop_issuing:
                break
            sleep_until(next_arrival)
            if not slots.acquire(timeout=max(0.0, min(stop_issuing - time.perf_counter(), slot_wait))):
                break
            fut = pool.submit(client.send, prompt_of(i), seed + i)
            fut.add_done_callback(lambda _: slots.release())
            futures.append(fut)
        results = [f.result(timeout=slot_wait) for f in futures]
    finally:  # on an interrupt, do not wait for requests in flight (a started server is stopped next)
        pool.shutdown(wait=False, cancel_futures=True)
    end = max((r.end for r in results), default=start)
    return results, end - start


def sleep_until(t: float) -> None:
    wait = t - time.perf_counter()
    if wait > 0:
        time.sleep(wait)


# --------------------------------------------------------------------------------------------- metrics

def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(values_s: list[float]) -> dict[str, float | None]:
    """mean / median / p90 / p99 in milliseconds (None when there are no values)."""
    ms = sorted(v * 1000.0 for v in values_s)
    return {name: (None if not ms else sum(ms) / len(ms) if q is None else percentile(ms, q))
            for name, _, q in STATS}


def compute_metrics(results: list[RequestResult], duration_s: float, concurrency: int) -> dict:
    ok = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.completion_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.completion_tokens - 1)
            for r in ok if r.ttft is not None and r.completion_tokens > 1]

    def per_s(x: float) -> float:
        return x / duration_s if duration_s > 0 else 0.0

    return {
        "concurrency": concurrency,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(Counter(r.error for r in results if not r.ok).most_common(MAX_ERRORS_SHOWN)),
        "without_usage": sum(not r.has_usage for r in ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "prefix_cache_hit_rate": cached / input_tokens if input_tokens else None,
        "ttft_ms": summarize([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": summarize(tpot),
        "itl_ms": summarize([gap for r in ok for gap in r.itl]),
        "e2el_ms": summarize([r.latency for r in ok]),
    }


# --------------------------------------------------------------------------------------------- output

def fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def print_result(m: dict) -> None:
    """One pass in the layout of `vllm bench serve`."""
    print(" Serving Benchmark Result ".center(50, "="))
    rate = m["prefix_cache_hit_rate"]
    for label, value in (("Maximum request concurrency:", m["concurrency"]),
                         ("Successful requests:", m["completed"]),
                         ("Failed requests:", m["failed"]),
                         ("Benchmark duration (s):", fmt(m["duration_s"])),
                         ("Total input tokens:", m["total_input_tokens"]),
                         ("Total generated tokens:", m["total_output_tokens"]),
                         ("Request throughput (req/s):", fmt(m["request_throughput"])),
                         ("Output token throughput (tok/s):", fmt(m["output_throughput"])),
                         ("Total token throughput (tok/s):", fmt(m["total_token_throughput"])),
                         ("Prefix cache hit rate (%):", fmt(None if rate is None else 100 * rate))):
        print(f"{label:<40}{value:<10}")
    for key, short, title in (("ttft_ms", "TTFT", "Time to First Token"),
                              ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
                              ("itl_ms", "ITL", "Inter-token Latency"),
                              ("e2el_ms", "E2EL", "End-to-end Latency")):
        print(title.center(50, "-"))
        for name, label, _ in STATS:
            print(f"{f'{label} {short} (ms):':<40}{fmt(m[key][name]):<10}")
    print("=" * 50)
    print_errors(m)


def print_rows(runs: list[dict]) -> None:
    """One row per concurrency."""
    header = ("conc", "ok", "errors", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
              "cache %")
    widths = (6, 6, 7, 9, 10, 10, 10, 10, 10, 8)
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for m in runs:
        rate = m["prefix_cache_hit_rate"]
        cells = (str(m["concurrency"]), str(m["completed"]), str(m["failed"]), fmt(m["request_throughput"]),
                 fmt(m["output_throughput"], 1), fmt(m["ttft_ms"]["median"], 1), fmt(m["ttft_ms"]["p99"], 1),
                 fmt(m["tpot_ms"]["median"], 1), fmt(m["tpot_ms"]["p99"], 1),
                 fmt(None if rate is None else 100 * rate, 1))
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths)))
    print("(TTFT / TPOT in ms)")
    for m in runs:
        print_errors(m)


def print_errors(m: dict) -> None:
    for error, count in m["errors"].items():
        print(f"error (concurrency {m['concurrency']}, {count}x): {error}")
    if m["without_usage"]:
        print(f"warning (concurrency {m['concurrency']}): {m['without_usage']} responses had no usage chunk; "
              "their token counts are 0")


# --------------------------------------------------------------------------------------------- server

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, proc: subprocess.Popen, log_path: str, timeout: float) -> None:
    """Poll /health until 200; raise (with the log's tail) when the server exits or the time runs out."""
    health = base_url.rstrip("/").removesuffix("/v1") + "/health"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}:\n{log_tail(log_path)}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(health, timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {timeout:g} s:\n{log_tail(log_path)}")


def log_tail(path: str, n: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


@contextlib.contextmanager
def started_server(api_key: str | None, server_args: str, timeout: float) -> Iterator[str]:
    """`python -m dsv41 serve` on a free local port; yields its base URL and stops it on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "dsv41", "serve", "--host", "127.0.0.1", "--port", str(port),
           *(["--api-key", api_key] if api_key else []), *shlex.split(server_args)]
    base_url = f"http://127.0.0.1:{port}/v1"
    with tempfile.NamedTemporaryFile("w", prefix="dsv41-serve-", suffix=".log", delete=False) as log_file:
        log(f"starting: {shlex.join(cmd)} (log: {log_file.name})")
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_healthy(base_url, proc, log_file.name, timeout)
        log(f"server ready on {base_url}")
        yield base_url
    finally:
        exited_early = proc.poll()
        stop(proc)
        if exited_early is None:
            os.unlink(log_file.name)
        else:
            log(f"the server exited with code {exited_early} before the end; its log: {log_file.name}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 15 s."""
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=15)


def first_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = requests.get(f"{base_url.rstrip('/')}/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


# --------------------------------------------------------------------------------------------- main

def positive_ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("expected positive integers, comma-separated")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="server URL (default %(default)s)")
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY` (and given to "
                                                   "a --start-server server)")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions or /v1/chat/completions (default %(default)s)")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per pass (default %(default)s)")
    p.add_argument("--concurrency", type=positive_ints, default=[8],
                   help="max requests in flight; a comma list (1,4,16) runs one pass per value (default 8)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s with Poisson arrivals (default inf: all at once)")
    p.add_argument("--input-len", type=int, default=1024, help="prompt characters = byte tokens (default %(default)s)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens (default %(default)s)")
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="leading prompt characters shared by every request (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="prompts, arrivals and request seeds (default %(default)s)")
    p.add_argument("--duration", type=float, default=None,
                   help="issue requests for this many seconds per pass instead of --num-prompts")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests before the passes (default %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--start-server", action="store_true",
                   help="start `python -m dsv41 serve` on a free local port (ignores --base-url)")
    p.add_argument("--server-args", default="", help='extra `dsv41 serve` arguments, e.g. "--slots 16"')
    p.add_argument("--server-timeout", type=float, default=600.0,
                   help="seconds to wait for the started server's /health (default %(default)s)")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1 or args.warmup < 0:
        p.error("--num-prompts, --input-len and --output-len must be positive, --warmup not negative")
    if args.request_rate <= 0 or (args.duration is not None and args.duration <= 0):
        p.error("--request-rate and --duration must be positive")
    return args


def log(msg: str) -> None:
    print(msg, file=sys.stderr)


def benchmark(args: argparse.Namespace, base_url: str) -> list[dict]:
    model = args.model or first_model(base_url, args.api_key)
    client = Client(base_url, args.api_key, model, args.endpoint, args.output_len, args.temperature, args.timeout)
    log(f"model {model}, {args.endpoint}, {args.input_len} in / {args.output_len} out, "
        f"shared prefix {args.shared_prefix_len}, rate {args.request_rate:g}/s")
    for i in range(args.warmup):
        warm = client.send(make_prompt(args.seed, -1, i, args.input_len, 0), args.seed)
        if not warm.ok:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        log(f"warm-up {i + 1}/{args.warmup}: {warm.latency:.2f} s")
    runs = []
    for pass_index, concurrency in enumerate(args.concurrency):
        prompt_of = lambda i, p=pass_index: make_prompt(args.seed, p, i, args.input_len, args.shared_prefix_len)
        results, duration_s = run_pass(client, prompt_of, concurrency=concurrency, num_prompts=args.num_prompts,
                                       duration=args.duration, rate=args.request_rate, seed=args.seed)
        metrics = compute_metrics(results, duration_s, concurrency)
        log(f"concurrency {concurrency}: {metrics['completed']} ok, {metrics['failed']} failed in {duration_s:.2f} s")
        runs.append(metrics)
    return runs


def exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, exit_on_signal)  # so that a started server is stopped on SIGTERM too
    try:
        with (started_server(args.api_key, args.server_args, args.server_timeout) if args.start_server
              else contextlib.nullcontext(args.base_url)) as base_url:
            runs = benchmark(args, base_url)
    except (requests.RequestException, RuntimeError) as e:
        log(f"bench_serve: {e}")
        return 2
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "api_key", "base_url")}
        settings["request_rate"] = str(args.request_rate) if math.isinf(args.request_rate) else args.request_rate
        print(json.dumps({"settings": settings, "base_url": base_url, "runs": runs}, indent=1))
    elif len(runs) == 1:
        print_result(runs[0])
    else:
        print_rows(runs)
    return 0 if all(m["completed"] for m in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
