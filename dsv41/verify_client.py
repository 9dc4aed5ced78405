"""The client mode of `dsv41 verify`: passkey retrieval and latency as an OpenAI-compatible endpoint serves them.

Any server that speaks `POST /v1/completions` (`dsv41 serve`, vLLM, SGLang, a hosted API) is sent the
passkey prompts of `dsv41.passkey.examples`, one request at a time, each twice: with a small max_tokens
(1: the latency is the prefill and the first token) and a large one (128: the prefill and 127 decode
steps more). The difference of the two mean latencies is the decode time; the large request's text says
whether the key came back. Prompt tokens as the server counts them sit beside the prompt's bytes, so a
byte-level server's count can be checked exactly and a BPE server's compression read off.

A server with a prefix cache (`dsv41 serve` has one) restores the large request's prompt from the small
one's, so its latency holds less prefill and the difference understates the decode time: `cached_tokens`
records what the server reported restoring, and `format_client` says so under its table.

The standard library does the HTTP (`urllib.request`): the client mode adds no dependency.
"""

from __future__ import annotations

import http.client
import json
import math
import time
import urllib.error
import urllib.request

import numpy as np

from dsv41 import data as data_lib
from dsv41 import passkey
from dsv41.errors import ConfigError


def client_report(base_url: str, *, api_key: str | None, model: str | None, contexts: list[int],
                  depths: list[float], n: int, seed: int = 0, max_tokens: tuple[int, int] = (1, 128),
                  timeout_s: float = 3600.0, progress=None) -> dict:
    """Passkey accuracy, prompt tokens and wall latencies of the endpoint at `base_url`, one row per (context, depth).

    base_url: the API root with its version, e.g. `http://127.0.0.1:8000/v1` (like the openai client's).
    model: the id sent; None takes the first one `GET /models` lists. contexts: tokens per prompt, the
    5 answer digits included (`passkey.examples`); depths: the needle's place, fractions of the filler.
    Every request has its own filler text, so that none finds another's prefix in a server's prefix cache
    (which would take prefill out of its latency): the cell of depth j asks for the key in
    `passkey.examples(context, depth, n, seed + 1000·j)` (the row's "seed") with max_tokens large, and times
    max_tokens small on prompts of the same lengths from seed + 1000·j + 500. Both are sent greedily (temperature 0);
    timeout_s bounds each request (a long prefill answers nothing until it is done). progress(row) is
    called after each cell. A hit: the large completion, leading whitespace stripped, starts with the key.

    Returns {"mode": "client", "base_url", "model", "max_tokens": [small, large], "rows"}; a row holds
    "context", "depth", "n", per prompt "prompt_tokens" (the server's usage), "expected_prompt_tokens"
    (the prompt's bytes), "latency_s" {"small", "large"} (s), "cached_tokens" {"small", "large"} (None
    where usage has no prompt_tokens_details), "completion_tokens_large", "answers", "decoded" (the
    first 16 characters of each large completion); and per cell "mean_latency_small_s",
    "mean_latency_large_s", "decode_s" (their difference) and "accuracy" (the fraction of hits).
    """
    base_url = _check_args(base_url, contexts, depths, n, seed, max_tokens, timeout_s)
    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    if model is None:
        model = _first_model(base_url, headers, timeout_s)
    small, large = max_tokens
    rows = []
    for context in contexts:
        for j, depth in enumerate(depths):
            cell_seed = seed + 1000 * j
            prompts, answers = passkey.examples(context, depth, n, cell_seed)
            timing, _ = passkey.examples(context, depth, n, cell_seed + 500)
            row = {"context": context, "depth": depth, "n": n, "seed": cell_seed, "prompt_tokens": [],
                   "expected_prompt_tokens": [len(p) for p in prompts], "latency_s": {"small": [], "large": []},
                   "cached_tokens": {"small": [], "large": []}, "completion_tokens_large": [],
                   "answers": [a.decode() for a in answers], "decoded": []}
            hits = []
            for prompt, other, answer in zip(prompts, timing, row["answers"]):
                for size, m, ids in (("small", small, other), ("large", large, prompt)):
                    seconds, out = _complete(base_url, headers, timeout_s, model, bytes(ids).decode("ascii"), m)
                    row["latency_s"][size].append(seconds)
                    row["cached_tokens"][size].append(out["cached_tokens"])
                row["prompt_tokens"].append(out["prompt_tokens"])
                row["completion_tokens_large"].append(out["completion_tokens"])
                row["decoded"].append(out["text"][:16])
                hits.append(out["text"].lstrip().startswith(answer))
            row["mean_latency_small_s"] = float(np.mean(row["latency_s"]["small"]))
            row["mean_latency_large_s"] = float(np.mean(row["latency_s"]["large"]))
            row["decode_s"] = row["mean_latency_large_s"] - row["mean_latency_small_s"]
            row["accuracy"] = float(np.mean(hits))
            rows.append(row)
            if progress is not None:
                progress(row)
    return {"mode": "client", "base_url": base_url, "model": model, "max_tokens": [small, large], "rows": rows}


def format_client(report: dict) -> str:
    """The report of `client_report` as a Markdown section: the endpoint, one table line per cell, and a note
    when the server's prefix cache gave the large requests prompt tokens the small ones computed."""
    small, large = report["max_tokens"]
    n = report["rows"][0]["n"] if report["rows"] else 0
    lines = ["## Client mode", "",
             f"Endpoint `{report['base_url']}`, model `{report['model']}`: {n} passkey prompts per cell, sent one "
             f"at a time, greedy, each with max_tokens {small} and then {large} (wall latency per request).", "",
             f"| context | depth | prompt tokens (mean) | latency, max_tokens {small} (s) | "
             f"latency, max_tokens {large} (s) | difference (s) | accuracy |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        lines.append(f"| {r['context']} | {r['depth']:g} | {np.mean(r['prompt_tokens']):.1f} | "
                     f"{r['mean_latency_small_s']:.3f} | {r['mean_latency_large_s']:.3f} | {r['decode_s']:.3f} | "
                     f"{r['accuracy']:.1%} |")
    more = [l - s for r in report["rows"] for s, l in zip(r["cached_tokens"]["small"], r["cached_tokens"]["large"])
            if s is not None and l is not None]
    if more and max(more) > 0:
        lines += ["", f"The large requests restored up to {max(more)} prompt tokens more than the small ones from the "
                  "server's prefix cache (usage `cached_tokens`): their latency holds less prefill, so the difference "
                  "understates the decode time (serve without a prefix cache, e.g. `dsv41 serve --no-prefix-cache`, "
                  "to measure it)."]
    return "\n".join(lines)


def _check_args(base_url, contexts, depths, n, seed, max_tokens, timeout_s) -> str:
    """base_url without its trailing "/"; ConfigError naming the flag of the first bad argument."""
    whole = lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, bool)
    number = lambda v: isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise ConfigError("--base-url", base_url, "expected an http:// or https:// URL of the API root, "
                          "e.g. http://127.0.0.1:8000/v1")
    shortest = data_lib.passkey_min_length(passkey.DIGITS)
    if not contexts or not all(whole(c) and c >= shortest for c in contexts):
        raise ConfigError("--contexts", contexts, f"expected whole token counts of at least {shortest} (the "
                          "needle, the question and the answer)")
    if not depths or not all(number(d) and 0 <= d <= 1 for d in depths):
        raise ConfigError("--depths", depths, "expected fractions of the filler in [0, 1]")
    if not whole(n) or n < 1:
        raise ConfigError("--n", n, "expected at least 1 prompt per cell")
    if not whole(seed) or seed < 0:
        raise ConfigError("--seed", seed, "expected a non-negative integer")
    if (not isinstance(max_tokens, (tuple, list)) or len(max_tokens) != 2 or not all(whole(m) for m in max_tokens)
            or not 1 <= max_tokens[0] < max_tokens[1]):
        raise ConfigError("--max-tokens", max_tokens, "expected two whole token counts, 1 <= small < large")
    if not number(timeout_s) or not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ConfigError("--timeout", timeout_s, "expected a positive number of seconds per request")
    return base_url.rstrip("/")


def _first_model(base_url: str, headers: dict, timeout_s: float) -> str:
    url = base_url + "/models"
    listed = _call(url, None, headers, timeout_s)
    ids = [m.get("id") for m in listed.get("data") or [] if isinstance(m, dict)] if isinstance(listed, dict) else []
    if not ids or not isinstance(ids[0], str):
        raise ValueError(f"GET {url} listed no model: expected at least one id in its 'data' (or pass --model)")
    return ids[0]


def _complete(base_url: str, headers: dict, timeout_s: float, model: str, prompt: str, max_tokens: int):
    """(wall seconds, {"text", "prompt_tokens", "completion_tokens", "cached_tokens"}) of one greedy completion."""
    url = base_url + "/completions"
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    out = _call(url, body, headers, timeout_s)
    seconds = time.perf_counter() - t0
    try:
        usage = out["usage"]
        details = usage.get("prompt_tokens_details") or {}
        return seconds, {"text": out["choices"][0]["text"], "prompt_tokens": usage["prompt_tokens"],
                         "completion_tokens": usage["completion_tokens"], "cached_tokens": details.get("cached_tokens")}
    except (KeyError, IndexError, TypeError, AttributeError):
        raise ValueError(f"POST {url} answered {json.dumps(out)[:300]}: expected a completion with choices[0].text "
                         "and usage.prompt_tokens / usage.completion_tokens") from None


def _call(url: str, body: dict | None, headers: dict, timeout_s: float):
    """The JSON answer of GET `url` (body None) or POST `url` with the JSON `body`; ValueError for an HTTP
    error (its status and the server's message) or an endpoint that cannot be reached (naming --base-url)."""
    data = None if body is None else json.dumps(body).encode()
    method = "GET" if body is None else "POST"
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
    except urllib.error.HTTPError as e:
        text = e.read().decode("utf-8", "replace")
        try:
            message = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = text.strip()[:500] or e.reason
        raise ValueError(f"{method} {url}: HTTP {e.code}: {message}") from None
    except urllib.error.URLError as e:
        reason = getattr(e.reason, "strerror", None) or str(e.reason)
        raise ValueError(f"--base-url: could not reach {url} ({reason.lower()}): expected an OpenAI-compatible "
                         "server there, e.g. `dsv41 serve` on http://127.0.0.1:8000/v1") from None
    except TimeoutError:
        raise ValueError(f"{method} {url}: no answer in {timeout_s:g} s: expected a larger --timeout "
                         "(seconds per request) for prompts this long") from None
    except (OSError, http.client.HTTPException) as e:  # the connection dropped, or the answer broke off
        raise ValueError(f"--base-url: {method} {url}: the connection failed ({e}): expected an OpenAI-compatible "
                         "server there") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise ValueError(f"{method} {url} answered {raw[:300]!r}: expected a JSON object (is --base-url the API "
                         "root, ending in /v1?)") from None
