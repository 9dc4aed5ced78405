"""`dsv41 serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the serving engine.

    dsv41 serve                                   # the shipped passkey model on http://127.0.0.1:8000/v1
    dsv41 serve --config v41_flash --weights params.safetensors --tokenizer tokenizer.json --api-key $KEY

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (streamed as server-sent events with
`"stream": true`, `stream_options.include_usage`), `GET /v1/models` (with the context window),
`GET /health`, `GET /metrics` (Prometheus). Usage always carries `prompt_tokens`, `completion_tokens`,
`total_tokens` and `prompt_tokens_details.cached_tokens` (the prompt tokens restored from the prefix
cache, 0 included). Errors have OpenAI's shape `{"error": {"message", "type", "param", "code"}}`, and
every check runs before a 200 is sent.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations (HTTPRequest) at runtime.

import argparse
import asyncio
import dataclasses
import faulthandler
import hmac
import json
import logging
import os
import signal
import sys
import time
import uuid

from dsv41 import config as config_lib
from dsv41.chat import ROLES
from dsv41.engine import ContextLengthError, Event, Request, SamplingParams

log = logging.getLogger("dsv41.server")

STARTED = int(time.time())  # /v1/models' "created": when this server started
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# -- request bodies ---------------------------------------------------------------------------------

def _field(body: dict, name: str, kinds, default=None, *, check=None, expected: str = ""):
    """body[name] if present and of one of `kinds` (and passing `check`), else `default`; APIError 400
    naming the field, the value and what was expected."""
    if name not in body or body[name] is None:
        return default
    value = body[name]
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in _tuple(kinds))
    if not ok or (check is not None and not check(value)):
        raise APIError(400, f"{name}: {json.dumps(value)[:200]} is not valid: expected {expected}", param=name,
                       code="invalid_value" if ok else "invalid_type")
    return value


def _tuple(kinds):
    return kinds if isinstance(kinds, tuple) else (kinds,)


# Fields this server does not implement, with the values that ask for nothing (accepted).
UNSUPPORTED = {"logprobs": (False, 0), "top_logprobs": (0,), "echo": (False,), "suffix": ("",), "best_of": (1,),
               "logit_bias": ({},), "tools": ([],), "response_format": ({"type": "text"},)}


def sampling_params(body: dict, *, chat: bool) -> SamplingParams:
    """The sampling settings of a request body (OpenAI's fields, plus vLLM's top_k and stop_token_ids).
    max_tokens defaults to 16 for completions (OpenAI's default) and, for chat, to the room left in the
    context window (-1 here: the caller fills it in once the prompt's length is known)."""
    _field(body, "n", int, 1, check=lambda v: v == 1, expected="1 (one choice per request)")
    for name, neutral in UNSUPPORTED.items():
        if body.get(name) is not None and body[name] not in neutral:
            raise APIError(400, f"{name}: {json.dumps(body[name])[:100]}: not supported by this server", param=name,
                           code="unsupported_parameter")
    for penalty in ("presence_penalty", "frequency_penalty"):
        _field(body, penalty, (int, float), 0, check=lambda v: v == 0, expected="0 (penalties are not supported)")
    max_tokens = None
    for name in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):
        max_tokens = _field(body, name, int, None, check=lambda v: v >= 1, expected="an integer >= 1")
        if max_tokens is not None:
            break
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
                             or len(stop) > 16):
        raise APIError(400, f"stop: {json.dumps(stop)[:200]} is not valid: expected a non-empty string or a list of "
                       "up to 16 of them", param="stop", code="invalid_value")
    ids = _field(body, "stop_token_ids", list, [], expected="a list of token ids",
                 check=lambda v: all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v))
    number = (int, float)
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else (-1 if chat else 16),
        temperature=float(_field(body, "temperature", number, 1.0, check=lambda v: 0 <= v <= 2,
                                 expected="a number in [0, 2]")),
        top_p=float(_field(body, "top_p", number, 1.0, check=lambda v: 0 < v <= 1, expected="a number in (0, 1]")),
        top_k=max(0, _field(body, "top_k", int, 0, check=lambda v: v >= -1, expected="an integer >= -1 (-1, 0: all)")),
        stop=tuple(stop or ()), stop_token_ids=tuple(ids),
        seed=_field(body, "seed", int, None, check=lambda v: 0 <= v < 2 ** 32, expected=f"an integer in 0..{2 ** 32 - 1}"))


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, f"messages: {json.dumps(messages)[:200]} is not valid: expected a non-empty list of "
                       "{\"role\", \"content\"} objects", param="messages", code="invalid_value" if messages else None)
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise APIError(400, f"{where}: {json.dumps(m)[:200]} is not valid: expected an object with 'role' one of "
                           f"{', '.join(ROLES)}", param=f"{where}.role", code="invalid_value")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(400, f"{where}.content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                               "supported", param=f"{where}.content", code="invalid_value")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"{where}.content: {json.dumps(content)[:200]} is not valid: expected a string",
                           param=f"{where}.content", code="invalid_type")
        out.append({**m, "content": content})
    return out


# -- the app ----------------------------------------------------------------------------------------

class Metrics:
    """Prometheus metrics of one server (its own registry), fed by the engine's events."""

    def __init__(self, engine, kv_bytes_per_token: float, fixed_bytes_per_row: int, cache_bytes: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("dsv41_requests", "Requests finished, by finish reason", ["finish_reason"], registry=r)
        self.errors = Counter("dsv41_request_errors", "Requests that ended with an error", registry=r)
        self.prompt_tokens = Counter("dsv41_prompt_tokens", "Prompt tokens of started requests", registry=r)
        self.cached_tokens = Counter("dsv41_cached_prompt_tokens", "Prompt tokens restored from the prefix cache",
                                     registry=r)
        self.generated = Counter("dsv41_generation_tokens", "Tokens generated", registry=r)
        self.compiles = Counter("dsv41_compiles_after_warmup", "XLA compiles after warm-up (should stay 0)", registry=r)
        self.ttft = Histogram("dsv41_time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram("dsv41_time_per_output_token_seconds", "Time between output tokens of a request",
                              buckets=TPOT_BUCKETS, registry=r)
        self.queued = Histogram("dsv41_request_queue_time_seconds", "Time from arrival to a slot", buckets=TTFT_BUCKETS,
                                registry=r)
        Gauge("dsv41_num_requests_waiting", "Requests waiting for a slot", registry=r).set_function(
            lambda: engine.stats()["waiting"])
        Gauge("dsv41_num_requests_running", "Requests holding a slot", registry=r).set_function(
            lambda: engine.stats()["running"])
        Gauge("dsv41_slots", "Decode slots (rows of the cache)", registry=r).set(engine.slots)
        Gauge("dsv41_slots_in_use", "Decode slots holding a request", registry=r).set_function(
            lambda: engine.stats()["running"])
        Gauge("dsv41_kv_bytes_per_token", "Bytes of global KV per token (the formula)", registry=r).set(
            kv_bytes_per_token)
        Gauge("dsv41_kv_cache_bytes", "Bytes of the cache pytree (every slot at capacity)", registry=r).set(cache_bytes)
        Gauge("dsv41_kv_bytes_in_use",
              "kv_bytes_per_token x tokens held + the fixed per-sequence bytes of the running requests",
              registry=r).set_function(lambda: kv_bytes_per_token * engine.stats()["tokens_held"]
                                       + fixed_bytes_per_row * engine.stats()["running"])

    def on_event(self, name: str, request=None, **values) -> None:
        if name == "admitted":
            self.prompt_tokens.inc(len(request.prompt))
            self.cached_tokens.inc(request.cached)
            self.queued.observe(values["queued_s"])
        elif name == "first_token":
            self.ttft.observe(values["ttft_s"])
        elif name == "token":
            self.tpot.observe(values["gap_s"])
        elif name == "finished":
            self.requests.labels(values["reason"]).inc()
            self.generated.inc(len(request.generated))
        elif name == "failed":
            self.errors.inc()
        elif name == "compile_after_warmup":
            self.compiles.inc()


def create_app(engine, tokenizer, chat_template, *, model_name: str, api_keys=(), metrics: Metrics | None = None):
    """The FastAPI app serving `engine` (started and stopped by the caller)."""
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    app = FastAPI(title="dsv41", docs_url=None, redoc_url=None)
    keys = [k.encode() for k in api_keys]

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def unexpected(_, e: Exception):
        log.exception("unhandled error")
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").body(),
                            status_code=500)

    def authorise(request: HTTPRequest) -> None:
        if not keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        # Every key is compared (constant time each), so the time taken does not tell which one nearly matched.
        ok = scheme.lower() == "bearer" and sum(hmac.compare_digest(given.strip().encode(), k) for k in keys) > 0
        if not ok:
            raise APIError(401, "Incorrect API key provided: expected 'Authorization: Bearer <key>' with a key the "
                           "server was started with (--api-key)", code="invalid_api_key")

    async def read_body(request: HTTPRequest) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"We could not parse the JSON body of your request ({e}): expected a JSON object",
                           code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body is not valid: expected a JSON object", code="invalid_json")
        model = body.get("model")
        if not isinstance(model, str):
            raise APIError(400, f"model: {json.dumps(model)}: expected the model's id, {model_name!r}", param="model",
                           code="invalid_value" if model is not None else "missing_required_parameter")
        if model != model_name:
            raise APIError(404, f"The model '{model}' does not exist: this server serves {model_name!r}",
                           param="model", code="model_not_found")
        return body

    @app.get("/health")
    async def health():
        return {"status": "ok", **engine.stats()}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry) if metrics else b"", media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: HTTPRequest):
        authorise(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": STARTED,
                                            "owned_by": "dsv41", "max_model_len": engine.max_model_len,
                                            "context_window": engine.max_model_len}]}

    async def generate(request: HTTPRequest, *, chat: bool):
        authorise(request)
        body = await read_body(request)
        params = sampling_params(body, chat=chat)
        if chat:
            prompt = tokenizer.encode(chat_template.render(chat_messages(body)))
            where = "messages"
        else:
            prompt, where = _prompt_ids(body.get("prompt"), tokenizer), "prompt"
        if params.max_tokens == -1:
            params = dataclasses.replace(params, max_tokens=max(1, engine.max_model_len - len(prompt)))
        try:
            engine.check(prompt, params)
        except ContextLengthError as e:
            raise APIError(400, str(e), param=where, code="context_length_exceeded") from None
        except ValueError as e:
            field = str(e).split(":")[0]
            raise APIError(400, str(e), param=field if field in body or field == "prompt" else None,
                           code="invalid_value") from None
        stream = _field(body, "stream", bool, False, expected="true or false")
        options = _field(body, "stream_options", dict, {}, expected="an object")
        include_usage = bool(options.get("include_usage", False))
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        req = Request(prompt, params, emit=lambda e: loop.call_soon_threadsafe(events.put_nowait, e),
                      id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex)
        engine.submit(req)
        shape = _Shape(req.id, model_name, chat)
        if stream:
            return StreamingResponse(_sse(engine, req, events, shape, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _whole(engine, req, events, shape, request)

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await generate(request, chat=True)

    return app


def _prompt_ids(prompt, tokenizer) -> list[int]:
    """A completion prompt: a string, one string in a list, or token ids (a list of ints)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise APIError(400, f"prompt: {json.dumps(prompt)[:200]} is not valid: expected a non-empty string or a list "
                   "of token ids (one prompt per request)", param="prompt",
                   code="missing_required_parameter" if prompt is None else "invalid_value")


class _Shape:
    """The response objects of one request (completion or chat)."""

    def __init__(self, id: str, model: str, chat: bool):
        self.id, self.model, self.chat = id, model, chat
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def chunk(self, delta: str | None, finish_reason=None, *, first=False) -> dict:
        if self.chat:
            d = {"role": "assistant", "content": ""} if first else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}
        return {"id": self.id, "object": self.object + (".chunk" if self.chat else ""), "created": self.created,
                "model": self.model, "choices": [choice]}

    def whole(self, text: str, finish_reason: str, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage}


async def _whole(engine, req: Request, events: asyncio.Queue, shape: _Shape, http_request):
    from fastapi.responses import JSONResponse

    parts = []
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await http_request.is_disconnected():
                    engine.cancel(req.id)
                    return JSONResponse({}, status_code=499)
                continue
            if event.kind == "text":
                parts.append(event.delta)
            elif event.kind == "error":
                raise APIError(500, f"the request failed in the engine: {event.message}", type="server_error")
            else:
                return shape.whole("".join(parts), event.finish_reason, event.usage)
    except asyncio.CancelledError:
        engine.cancel(req.id)
        raise


async def _sse(engine, req: Request, events: asyncio.Queue, shape: _Shape, include_usage: bool):
    def line(obj) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    finished = False
    try:
        first = shape.chunk(None, first=True) if shape.chat else None
        if first is not None:
            yield line({**first, **({"usage": None} if include_usage else {})})
        while True:
            event = await events.get()
            if event.kind == "text":
                chunk = shape.chunk(event.delta)
                yield line({**chunk, **({"usage": None} if include_usage else {})})
            elif event.kind == "error":
                finished = True
                yield line(APIError(500, f"the request failed in the engine: {event.message}",
                                    type="server_error").body())
                break
            else:
                finished = True
                chunk = shape.chunk(None, event.finish_reason)
                yield line({**chunk, **({"usage": None} if include_usage else {})})
                if include_usage:
                    yield line({"id": shape.id, "object": chunk["object"], "created": shape.created,
                                "model": shape.model, "choices": [], "usage": event.usage})
                break
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away: free the slot
            engine.cancel(req.id)


# -- the command ------------------------------------------------------------------------------------

def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="an OpenAI-compatible server with continuous batching over the compressed cache",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: dsv41 serve --api-key sk-local   # then an OpenAI client at http://127.0.0.1:8000/v1")
    p.add_argument("--config", default="passkey", help="config name or path (default: the trained passkey model)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    config_lib.add_weight_format_argument(p)
    p.add_argument("--weights", default=None,
                   help="a .safetensors weights file (`dsv41 train --export`, `dsv41 convert`); default: the "
                        "weights shipped with --config (passkey's), else random parameters from --seed")
    p.add_argument("--seed", type=int, default=0, help="seed of random parameters (configs without --weights)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=[],
                   help="accept this Bearer key (repeatable; also $DSV41_API_KEY, comma-separated); none: no auth")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the config's model)")
    p.add_argument("--slots", type=int, default=8, help="decode slots: requests served at once (default 8)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="tokens per request, prompt + output (default: the config's context window)")
    p.add_argument("--prefill-chunks", default=",".join(map(str, _chunks_default())),
                   help="the prefill chunk widths compiled (comma-separated; default %(default)s)")
    p.add_argument("--prefill-rows", type=int, default=1,
                   help="requests one prefill chunk runs at once (default 1: on a CPU a padded row costs as much as a real one)")
    p.add_argument("--prefix-cache", metavar="DIR", default=None,
                   help="the prefix cache's directory (default: $DSV41_PREFIX_CACHE or ~/.cache/dsv41/prefix_cache)")
    p.add_argument("--no-prefix-cache", action="store_true", help="serve without the prefix cache")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer.json (its tokenizer_config.json beside it gives the chat template and EOS); "
                        "default: UTF-8 bytes")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file (overrides the tokenizer's)")
    p.add_argument("--mesh", default=None, metavar="AXIS=N,...",
                   help="serve on a mesh of the local devices, e.g. data=8 or data=2,expert=4 (rules `serve`: rows over "
                        "every axis, experts over `expert`); --slots must be a multiple of the devices")
    p.add_argument("--engram-host", action="store_true",
                   help="with --mesh: keep the Engram tables in host memory, their rows split over the chips' hosts "
                        "(each step gathers the rows its tokens hash to there)")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)
    return p


def _check_port(host: str, port: int) -> None:
    import socket

    from dsv41.errors import ConfigError

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise ConfigError("--port", port, f"expected a free port on {host} ({e.strerror})") from None


def _chunks_default():
    from dsv41.engine import DEFAULT_CHUNKS

    return DEFAULT_CHUNKS


def _parse_chunks(text: str) -> tuple[int, ...]:
    from dsv41.errors import ConfigError

    try:
        chunks = tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise ConfigError("--prefill-chunks", text, "expected comma-separated positive integers") from None
    if not chunks or min(chunks) < 1:
        raise ConfigError("--prefill-chunks", text, "expected comma-separated positive integers")
    return chunks


def build(args):
    """(engine, app) of the parsed `serve` arguments (the engine warmed up, not started)."""
    from dsv41 import accounting, cache as cache_lib, schema
    from dsv41.chat import ChatTemplate, read_tokenizer_config
    from dsv41.convert import command_params
    from dsv41.engine import Engine
    from dsv41.tokenizer import load_tokenizer

    cfg = config_lib.load_config(args.config, [*args.set, *config_lib.weight_format_overrides(args.weight_format)])
    params, weights = command_params(cfg, args.config, args.weights, seed=args.seed)
    if weights is None:
        print(f"no --weights: random parameters (seed {args.seed}); the numbers are real, the text is not",
              file=sys.stderr)
    tokenizer = load_tokenizer(cfg, args.tokenizer)
    template = ChatTemplate()
    if args.tokenizer is not None:
        config_path = os.path.join(os.path.dirname(os.path.abspath(args.tokenizer)), "tokenizer_config.json")
        if os.path.exists(config_path):
            found, eos = read_tokenizer_config(config_path)
            template = found or template
            if eos:
                tokenizer.eos_id = tokenizer.token_id(eos)
    if args.chat_template is not None:
        template = ChatTemplate.from_file(args.chat_template)
    prefix_cache = None
    if not args.no_prefix_cache and cfg.architecture.family == schema.V41:
        from dsv41.engine import prefix_cache_min_len
        from dsv41.prefix_cache import PrefixCache

        prefix_cache = PrefixCache(cfg, params, args.prefix_cache)
        need, rows = prefix_cache_min_len(prefix_cache), args.max_model_len or cfg.context_window
        if args.prefix_cache is None and rows < need:
            # The default prefix cache, rows too short for one of its blocks: serve without it (asked for by
            # --prefix-cache DIR, the engine refuses the length instead).
            print(f"prefix cache off: rows of {rows} tokens (--max-model-len) hold no {prefix_cache.block}-token "
                  f"block (kv_cache.persistent_cache.block_tokens) with a token after it; it needs at least {need}",
                  file=sys.stderr, flush=True)
            prefix_cache = None
    mesh = None
    if args.mesh is not None:
        from dsv41 import sharding

        mesh = sharding.make_mesh(sharding.parse_mesh(args.mesh))
    engine = Engine(params, cfg, tokenizer, slots=args.slots, max_model_len=args.max_model_len,
                    chunks=_parse_chunks(args.prefill_chunks), prefill_rows=args.prefill_rows,
                    prefix_cache=prefix_cache, mesh=mesh, engram_host=args.engram_host)
    if cfg.architecture.family == schema.V41 and cfg.quant == "qat":
        per_token = accounting.kv_bytes_per_token(cfg)["total"]
        fixed = accounting.fixed_bytes_per_sequence(cfg)["total"]
    else:  # the float cache: its own bytes, spread evenly
        per_token, fixed = cache_lib.nbytes(engine.cache) / (engine.slots * engine.capacity), 0
    metrics = Metrics(engine, per_token, fixed, cache_lib.nbytes(engine.cache))
    engine.observer = metrics
    keys = list(args.api_key) + [k for k in os.environ.get("DSV41_API_KEY", "").split(",") if k]
    app = create_app(engine, tokenizer, template, model_name=args.served_model_name or cfg.model, api_keys=keys,
                     metrics=metrics)
    return engine, app


def run(args) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID`: every thread's Python stack to stderr (a stuck server)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    _check_port(args.host, args.port)  # before the warm-up's minute of compiling, not after it
    engine, app = build(args)
    print(f"warming up: compiling prefill chunks {engine.chunks} x {engine.prefill_rows} rows and decode x "
          f"{engine.slots} slots ...", file=sys.stderr, flush=True)
    warm = engine.warmup()
    engine.start()
    print(f"serving {engine.cfg.model} on http://{args.host}:{args.port}/v1 ({engine.slots} slots of "
          f"{engine.max_model_len} tokens; warm-up {warm['seconds']:.1f} s)", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.stop()
    return 0
