"""The serving engine: fixed decode slots over one cache, continuous batching, chunked prefill.

The engine owns one cache pytree of `slots` rows (the decode batch) and a scheduler with a waiting queue
and the running slots. Each step of its loop (`Engine.step`) does, in this order:

1. admit: each waiting request takes a free slot; its row starts from the prefix cache's longest stored
   prefix of the prompt (global KV restored from the store, window rings from the host pool or rebuilt
   by bounded replay, DESIGN §7) or empty;
2. prefill: at most one chunk — up to `prefill_rows` prefilling slots, each its next (up to) `chunk`
   prompt tokens, run on those rows only (gathered from the cache and put back), the slots taken in
   turn, so that a request waits behind another request's prefill for at most one chunk; a row whose
   prompt is complete samples its first token;
3. decode: one step for every decoding slot (one token per row; the other rows bring none), then each
   row's next token is sampled with its own settings (`generate.sample_rows`: temperature, top-k,
   top-p, a PRNG stream per request from its seed).

The device programs form a closed set, compiled by `warmup` at start: the prefill step for each chunk
width in `chunks` (`prefill_rows` rows), the decode step (`slots` rows), the samplers for both widths
and the prefix cache's restore, save and replay. A compile after warm-up is logged and counted
(`Engine.stats()["compiles_after_warmup"]`): it means a shape escaped the set.

Requests come in through `submit` (any thread) and report through their `emit` callback, called on the
engine's thread with `Event`s: text deltas as tokens are sampled, then one final event with the finish
reason and usage, or an error. `cancel` frees a request's slot at the next step (a client that went away).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import steps, xla_options
from dsv41.cache import host_view, init_cache, put_rows, round_capacity, take_rows, with_mirror
from dsv41.errors import ConfigError
from dsv41.generate import Sampling, sample_rows

log = logging.getLogger("dsv41.engine")

DEFAULT_CHUNKS = (32, 128, 512)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """A request's decoding settings (OpenAI's names). temperature 0: greedy. top_k 0: every id.
    stop: strings that end the output (not included); stop_token_ids: ids that end it (not included).
    seed: the request's PRNG stream (None: drawn at random)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclasses.dataclass(frozen=True)
class Event:
    """What a request reports. kind: "text" (delta: new text, tokens: the ids it came from), "done"
    (finish_reason "stop" | "length" | "cancelled", usage) or "error" (message)."""

    kind: str
    delta: str = ""
    tokens: tuple[int, ...] = ()
    finish_reason: str | None = None
    usage: dict | None = None
    message: str = ""


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request. prompt: token ids; emit(Event) is called on the engine's thread."""

    prompt: list[int]
    params: SamplingParams
    emit: object
    id: str = ""
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    # Filled in by the engine.
    slot: int | None = None
    cached: int = 0            # prompt tokens restored from the prefix cache
    done_tokens: int = 0       # prompt tokens the slot's row holds
    save_at: int = 0           # prefix-cache save point (a block boundary), 0: none
    generated: list = dataclasses.field(default_factory=list)
    text: str = ""             # output text so far (stop strings cut off)
    sent: int = 0              # characters of `text` already emitted
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False
    stream: object = None      # the tokenizer's incremental decoder

    @property
    def prefilling(self) -> bool:
        return self.done_tokens < len(self.prompt)


class Engine:
    """Continuous batching over one cache of `slots` rows (module doc).

    Args:
      params, cfg: the model (V4.1 or V4 compat; the `full` prefill schedule).
      tokenizer: `dsv41.tokenizer` object (encode/decode/stream); its `eos_id`, if any, ends a request.
      slots: decode rows (the batch of the cache). max_model_len: tokens per row, prompt + output
        (default: the config's context window), rounded up to the compression ratios.
      chunks: the prefill chunk widths compiled (each call takes the smallest that holds every selected
        row's next part, else the largest). prefill_rows: rows one prefill call runs (≤ slots).
      prefix_cache: a `dsv41.prefix_cache.PrefixCache` of these params and config, or None.
      observer: optional object with `on_event(name, **values)` (metrics).
      mesh: a `jax.sharding.Mesh` to serve on (None: one device): the parameters and the cache are placed
        by the `rules` preset of `dsv41.sharding` (`serve`: rows over every mesh axis, experts over
        `expert`) and every step is the sharded step over all `slots` rows (a prefill chunk brings tokens
        for its `prefill_rows` rows, the others none); slots must be a multiple of the mesh's devices.
      engram_host: with a mesh, keep the Engram tables in host memory, their rows split over the chips'
        hosts (`dsv41.sharding.shard_params`); each step gathers the rows its tokens hash to there.
    """

    def __init__(self, params, cfg, tokenizer, *, slots: int = 8, max_model_len: int | None = None,
                 chunks=DEFAULT_CHUNKS, prefill_rows: int = 1, prefix_cache=None, observer=None, mesh=None,
                 rules="serve", engram_host: bool = False):
        if cfg.runtime.prefill_schedule != "full":
            raise ConfigError("runtime.prefill_schedule", cfg.runtime.prefill_schedule,
                              "expected 'full' for serving: the engine prefills rows in interleaved chunks, and CED's "
                              "decoder replay needs a whole prompt's final chunk")
        if engram_host and mesh is None:
            raise ConfigError("engram_host", engram_host, "expected a mesh: host-memory Engram tables are split over "
                              "its chips' hosts")
        _positive("slots", slots)
        _positive("prefill_rows", prefill_rows)
        if prefill_rows > slots:
            raise ConfigError("prefill_rows", prefill_rows, f"expected at most slots = {slots}")
        chunks = tuple(sorted(set(chunks)))
        if not chunks or any(isinstance(c, bool) or not isinstance(c, int) or c <= 0 for c in chunks):
            raise ConfigError("chunks", list(chunks), "expected positive integers (prefill chunk widths)")
        max_model_len = cfg.context_window if max_model_len is None else max_model_len
        _positive("max_model_len", max_model_len)
        if max_model_len < 2:
            raise ConfigError("max_model_len", max_model_len, "expected at least 2 (a prompt token and an output token)")
        if max_model_len > cfg.context_window:
            raise ConfigError("max_model_len", max_model_len,
                              f"expected at most the model's context window, {cfg.context_window} tokens")
        if prefix_cache is not None and max_model_len < prefix_cache_min_len(prefix_cache):
            raise ConfigError("max_model_len", max_model_len,
                              f"expected at least {prefix_cache_min_len(prefix_cache)} with a prefix cache of "
                              f"{prefix_cache.block}-token blocks (kv_cache.persistent_cache.block_tokens): a "
                              "shorter row never saves or restores a block; or serve without the prefix cache")
        if prefix_cache is not None and prefix_cache.params is not params:
            raise ValueError("prefix_cache: built for other parameters: expected a PrefixCache of the params served")
        self.cfg, self.params, self.tokenizer = cfg, params, tokenizer
        self.max_model_len = max_model_len
        self.capacity = round_capacity(cfg, max_model_len)
        self.slots, self.prefill_rows, self.chunks = slots, prefill_rows, chunks
        self.prefix_cache = prefix_cache
        self.observer = observer
        self.vocab = min(cfg.architecture.vocab_size, tokenizer.vocab_size)
        self.eos_id = getattr(tokenizer, "eos_id", None)
        self.mesh, self.rules = mesh, rules
        if mesh is None:
            self.steps = steps.bind(params, cfg)
            self.cache = init_cache(cfg, slots, self.capacity)
        else:
            from dsv41 import sharding

            if slots % mesh.devices.size:
                raise ConfigError("slots", slots, f"expected a multiple of the mesh's {mesh.devices.size} devices "
                                  "(the cache's rows are split over them)")
            self.params = params = sharding.shard_params(params, cfg, mesh, rules, engram_host=engram_host)
            self.cache = sharding.init_cache(cfg, mesh, rules, batch=slots, max_len=self.capacity)
        self.empty_row = init_cache(cfg, 1, self.capacity)
        self.lengths = np.zeros(slots, np.int64)                     # host mirror of the rows' lengths
        self.recent = np.asarray(host_view(self.cache).recent_tokens).copy()
        self.keys = np.zeros((slots, *_key_shape()), np.uint32)     # PRNG key data per slot
        self.running: list[Request | None] = [None] * slots
        self.waiting: collections.deque[Request] = collections.deque()
        self.turn = 0                                                # prefill rotation
        self._inbox: collections.deque[Request] = collections.deque()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._ids = itertools.count()
        self.counts = collections.Counter()
        self.compiles_after_warmup = 0
        self._warm = False
        _watch_compiles(self)

    # -- requests -------------------------------------------------------------------------------

    def check(self, prompt, params: SamplingParams) -> None:
        """Raises ValueError (field, value, expectation) for a request this engine cannot serve."""
        if not prompt:
            raise ValueError("prompt: empty: expected at least one token")
        bad = [t for t in prompt if not 0 <= t < self.vocab]
        if bad:
            raise ValueError(f"prompt: token ids {bad[:8]}: expected ids in 0..{self.vocab - 1}")
        p = params
        if isinstance(p.max_tokens, bool) or not isinstance(p.max_tokens, int) or p.max_tokens < 1:
            raise ValueError(f"max_tokens: {p.max_tokens!r}: expected an integer >= 1")
        if len(prompt) + p.max_tokens > self.max_model_len:
            raise ContextLengthError(len(prompt), p.max_tokens, self.max_model_len)
        if not 0 <= p.temperature <= 2:
            raise ValueError(f"temperature: {p.temperature!r}: expected a number in [0, 2]")
        if not 0 < p.top_p <= 1:
            raise ValueError(f"top_p: {p.top_p!r}: expected a number in (0, 1]")
        if isinstance(p.top_k, bool) or not isinstance(p.top_k, int) or p.top_k < 0:
            raise ValueError(f"top_k: {p.top_k!r}: expected an integer >= 0 (0: every token)")
        bad = [t for t in p.stop_token_ids if not 0 <= t < self.vocab]
        if bad:
            raise ValueError(f"stop_token_ids: {bad[:8]}: expected ids in 0..{self.vocab - 1}")
        if p.seed is not None and (isinstance(p.seed, bool) or not isinstance(p.seed, int) or not 0 <= p.seed < 2 ** 32):
            raise ValueError(f"seed: {p.seed!r}: expected an integer in 0..{2 ** 32 - 1} (as `generate` takes)")

    def submit(self, request: Request) -> Request:
        """Queues a request (checked first: raises ValueError / ContextLengthError); thread-safe."""
        self.check(request.prompt, request.params)
        if not request.id:
            request.id = f"req-{next(self._ids)}"
        with self._lock:
            self._inbox.append(request)
        self._wake.set()
        return request

    def cancel(self, request_id: str) -> None:
        """Ends a request at the next step and frees its slot (thread-safe; unknown ids are ignored)."""
        with self._lock:
            self._cancelled.add(request_id)
        self._wake.set()

    def stats(self) -> dict:
        busy = [r for r in self.running if r is not None]
        return {"waiting": len(self.waiting) + len(self._inbox), "running": len(busy),
                "prefilling": sum(r.prefilling for r in busy), "slots": self.slots,
                "tokens_held": int(self.lengths.sum()), "compiles_after_warmup": self.compiles_after_warmup,
                **self.counts}

    # -- the loop -------------------------------------------------------------------------------

    def start(self) -> None:
        """Runs the loop on a background thread (`stop` ends it)."""
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="dsv41-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _loop(self) -> None:
        while not self._stop:
            try:
                busy = self.step()
            except Exception as e:  # never let one bad step end the loop: its requests fail, the rest go on
                log.exception("engine step failed")
                self._reset_after_failure(f"{type(e).__name__}: {e}")
                continue
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()

    def idle(self) -> bool:
        return not (self.waiting or self._inbox or any(r is not None for r in self.running))

    def step(self) -> bool:
        """One scheduler step (module doc). Returns whether there was work."""
        self._take_inbox()
        if self.idle():
            return False
        self._admit()
        prefill = [r for r in self.running if r is not None and r.prefilling]
        if prefill:
            self._prefill(prefill)
        if any(r is not None and not r.prefilling for r in self.running):
            self._decode()
        return True

    def _take_inbox(self) -> None:
        with self._lock:
            new, self._inbox = list(self._inbox), collections.deque()
            cancelled, self._cancelled = self._cancelled, set()
        self.waiting.extend(new)
        if cancelled:
            for r in [r for r in self.waiting if r.id in cancelled]:
                self.waiting.remove(r)
                self._finish(r, "cancelled")
            for r in self.running:
                if r is not None and r.id in cancelled:
                    self._finish(r, "cancelled")

    def _admit(self) -> None:
        while self.waiting and None in self.running:
            r = self.waiting.popleft()
            slot = self.running.index(None)
            try:
                self._place(r, slot)
            except Exception as e:  # a damaged store entry is the prefix cache's to count; anything else ends r
                log.exception("request %s: could not start", r.id)
                self._fail([r], f"{type(e).__name__}: {e}")

    def _place(self, r: Request, slot: int) -> None:
        """Puts r's row in `slot`: the prefix cache's restored prefix, or an empty row."""
        pc, n = self.prefix_cache, 0
        row = self.empty_row
        if pc is not None:
            row, cached, infos = pc.restore([r.prompt], self.capacity)
            n = int(cached[0])
            r.save_at = pc.restorable(len(r.prompt))
            if r.save_at <= n or infos[0].rings == "replay":
                r.save_at = 0  # nothing new to save, or a replayed (approximate) row, which never saves
        view = host_view(row)
        self._put(slot, row)
        self.lengths[slot] = n
        self.recent[slot] = view.recent_tokens[0]
        seed = r.params.seed if r.params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.keys[slot] = _key_data(seed)
        r.slot, r.cached, r.done_tokens = slot, n, n
        self.running[slot] = r
        self.counts["requests_started"] += 1
        self._observe("admitted", request=r, queued_s=time.perf_counter() - r.arrival)

    # -- prefill --------------------------------------------------------------------------------

    def _prefill(self, prefill: list[Request]) -> None:
        order = sorted(prefill, key=lambda r: (r.slot - self.turn) % self.slots)
        chosen = order[:self.prefill_rows]
        self.turn = (chosen[-1].slot + 1) % self.slots
        ends = [min(len(r.prompt), r.save_at) if r.done_tokens < r.save_at else len(r.prompt) for r in chosen]
        need = max(e - r.done_tokens for r, e in zip(chosen, ends))
        width = next((c for c in self.chunks if c >= need), self.chunks[-1])
        # Fill the call's other rows with slots that bring no tokens (distinct rows: they are put back).
        others = [s for s in range(self.slots) if s not in {r.slot for r in chosen}]
        rows = [r.slot for r in chosen] + others[:self.prefill_rows - len(chosen)]
        tokens = np.zeros((self.prefill_rows, width), np.int32)
        counts = np.zeros(self.prefill_rows, np.int32)
        for i, (r, end) in enumerate(zip(chosen, ends)):
            part = r.prompt[r.done_tokens:min(end, r.done_tokens + width)]
            tokens[i, :len(part)] = part
            counts[i] = len(part)
        try:
            logits = self._run_prefill(rows, tokens, counts)
        except Exception as e:
            log.exception("prefill step failed")
            self._reset_after_failure(f"{type(e).__name__}: {e}")
            return
        self.counts["prefill_tokens"] += int(counts.sum())
        complete = []
        for i, r in enumerate(chosen):
            r.done_tokens += int(counts[i])
            if r.save_at and r.done_tokens == r.save_at:
                self._save(r)
            if not r.prefilling:
                complete.append(i)
        if complete:
            rows_done = [chosen[i] for i in complete]
            tokens = self._sample(logits, [r.slot for r in chosen] + [None] * (self.prefill_rows - len(chosen)),
                                  [len(r.generated) for r in chosen] + [0] * (self.prefill_rows - len(chosen)))
            for i, r in zip(complete, rows_done):
                self._take_or_fail(r, int(tokens[i]))

    def _run_prefill(self, rows, tokens, counts):
        """The prefill step on cache rows `rows` (tokens [P, S], counts [P]): logits [P, V]."""
        if self.mesh is not None:  # the sharded step runs every row; the others bring no tokens
            from dsv41 import sharding

            tokens_B = np.zeros((self.slots, tokens.shape[1]), np.int32)
            counts_B = np.zeros(self.slots, np.int32)
            tokens_B[rows], counts_B[rows] = tokens, counts
            return sharding.one_at_a_time(self.mesh, self._step_all(tokens_B, counts_B)[np.asarray(rows)])
        held = self.lengths[rows]
        ids, recent = steps.engram_inputs(self.cfg, self.recent[rows], tokens, counts, held)
        logits, self.cache = _prefill_rows(self.steps.key, self.steps.treedef, self.steps.leaves, self.cache,
                                           jnp.asarray(rows, jnp.int32), tokens, counts, ids)
        self.lengths[rows] = held + counts
        self.recent[rows] = recent
        return logits

    def _step_all(self, tokens_BS, counts_B):
        """The step over every row of the cache (row b: its first counts_B[b] tokens): logits [B, V]."""
        cache = with_mirror(self.cache, self.lengths, self.recent)
        if self.mesh is None:
            logits, cache = self.steps.prefill(cache, tokens_BS, counts_B)
        else:
            from dsv41 import sharding

            logits, cache = sharding.prefill(self.params, self.cfg, cache, tokens_BS, counts_B, mesh=self.mesh,
                                             rules=self.rules)
        view = host_view(cache)
        self.cache, self.lengths, self.recent = cache, view.lengths.copy(), view.recent_tokens.copy()
        return logits

    def _put(self, slot: int, row) -> None:
        """Replaces cache row `slot` by the one-row cache `row`."""
        if self.mesh is None:
            self.cache = _put_row(self.cache, jnp.asarray([slot], jnp.int32), row)
            return
        from jax.sharding import NamedSharding, PartitionSpec

        from dsv41 import sharding

        whole = NamedSharding(self.mesh, PartitionSpec())
        row = jax.device_put(row, whole)
        cache = sharding.one_at_a_time(self.mesh, _put_row(self.cache, jax.device_put(jnp.asarray([slot], jnp.int32),
                                                                                      whole), row))
        self.cache = sharding.shard_cache(cache, self.cfg, self.mesh, self.rules)

    def _save(self, r: Request) -> None:
        """Saves r's prompt blocks up to its save point (the row is there now) to the prefix cache."""
        try:
            cache = with_mirror(self.cache, self.lengths, self.recent)
            self.prefix_cache.save(np.asarray(r.prompt[:r.save_at]), cache, r.slot)
        except OSError as e:  # a full or read-only disk costs the cache entry, not the request
            log.warning("prefix cache: could not save request %s's prefix: %s", r.id, e)
            self.counts["prefix_cache_save_errors"] += 1

    # -- decode and sampling --------------------------------------------------------------------

    def _decode(self) -> None:
        live = np.array([r is not None and not r.prefilling for r in self.running])
        tokens = np.array([r.generated[-1] if live[s] else 0 for s, r in enumerate(self.running)], np.int32)
        try:
            logits = self._step_all(tokens[:, None], live.astype(np.int32))
        except Exception as e:
            log.exception("decode step failed")
            self._reset_after_failure(f"{type(e).__name__}: {e}")
            return
        self.counts["decode_steps"] += 1
        slots = [s if live[s] else None for s in range(self.slots)]
        drawn = self._sample(logits, slots, [len(r.generated) if live[s] else 0 for s, r in enumerate(self.running)])
        for s in np.flatnonzero(live):
            self._take_or_fail(self.running[s], int(drawn[s]))

    def _sample(self, logits, slots, steps_done):
        """Each row's next id with its slot's settings (rows of slot None: greedy, ignored)."""
        reqs = [None if s is None else self.running[s] for s in slots]
        temp = np.array([0.0 if r is None else r.params.temperature for r in reqs], np.float32)
        top_k = np.array([0 if r is None else r.params.top_k for r in reqs], np.int32)
        top_p = np.array([1.0 if r is None else r.params.top_p for r in reqs], np.float32)
        keys = np.stack([self.keys[0] if s is None else self.keys[s] for s in slots])
        return np.asarray(_sample(logits, keys, temp, top_k, top_p, np.int32(self.vocab),
                                  np.asarray(steps_done, np.int32)))

    def _take_or_fail(self, r: Request, token: int) -> None:
        try:
            self._take(r, token)
        except Exception as e:  # e.g. the tokenizer refused an id: this request ends, the others go on
            log.exception("request %s: could not take token %d", r.id, token)
            self._fail([r], f"{type(e).__name__}: {e}")

    def _take(self, r: Request, token: int) -> None:
        """Adds a sampled id to r: its text, a stop, or the end of its budget."""
        now = time.perf_counter()
        if r.first_token_at is None:
            r.first_token_at = now
            self._observe("first_token", request=r, ttft_s=now - r.arrival)
        else:
            self._observe("token", request=r, gap_s=now - r.last_token_at)
        r.last_token_at = now
        r.generated.append(token)
        self.counts["generated_tokens"] += 1
        p = r.params
        if r.stream is None:
            r.stream = self.tokenizer.stream()
        if token in p.stop_token_ids or token == self.eos_id:  # not part of the output
            r.text += r.stream.flush()
            self._emit_text(r, final=True)
            return self._finish(r, "stop")
        r.text += r.stream.step(token)
        hit = _first_stop(r.text, p.stop, r.sent)
        if hit is not None:
            r.text = r.text[:hit]
            self._emit_text(r, final=True)
            return self._finish(r, "stop")
        if len(r.generated) >= p.max_tokens:
            r.text += r.stream.flush()
            hit = _first_stop(r.text, p.stop, r.sent)
            r.text = r.text if hit is None else r.text[:hit]
            self._emit_text(r, final=True)
            return self._finish(r, "length" if hit is None else "stop")
        self._emit_text(r, final=False)

    def _emit_text(self, r: Request, final: bool) -> None:
        """Emits r's new text, holding back a tail that may still become a stop string."""
        hold = 0 if final or not r.params.stop else max(map(len, r.params.stop)) - 1
        upto = max(r.sent, len(r.text) - hold)
        if upto > r.sent:
            self._send(r, Event("text", delta=r.text[r.sent:upto], tokens=(r.generated[-1],)))
            r.sent = upto

    # -- endings --------------------------------------------------------------------------------

    def usage(self, r: Request) -> dict:
        return {"prompt_tokens": len(r.prompt), "completion_tokens": len(r.generated),
                "total_tokens": len(r.prompt) + len(r.generated),
                "prompt_tokens_details": {"cached_tokens": r.cached}}

    def _finish(self, r: Request, reason: str) -> None:
        if r.finished:
            return
        r.finished = True
        self._free(r)
        self.counts[f"finished_{reason}"] += 1
        self._observe("finished", request=r, reason=reason)
        self._send(r, Event("done", finish_reason=reason, usage=self.usage(r)))

    def _fail(self, requests, message: str) -> None:
        for r in requests:
            if r.finished:
                continue
            r.finished = True
            self._free(r)
            self.counts["failed"] += 1
            self._observe("failed", request=r)
            self._send(r, Event("error", message=message))

    def _free(self, r: Request) -> None:
        if r.slot is not None and self.running[r.slot] is r:
            self.running[r.slot] = None
            self.lengths[r.slot] = 0  # the row is replaced before its next use (`_place`)

    def _reset_after_failure(self, message: str) -> None:
        """A failed step may have consumed the donated cache: the running requests end with the error, and
        the engine goes on with an empty cache (the waiting requests are not affected)."""
        self._fail([r for r in self.running if r is not None], message)
        if self.mesh is None:
            self.cache = init_cache(self.cfg, self.slots, self.capacity)
        else:
            from dsv41 import sharding

            self.cache = sharding.init_cache(self.cfg, self.mesh, self.rules, batch=self.slots, max_len=self.capacity)
        self.lengths[:] = 0
        self.recent = np.asarray(host_view(self.cache).recent_tokens).copy()

    def _send(self, r: Request, event: Event) -> None:
        try:
            r.emit(event)
        except Exception:  # the receiver's failure (a closed connection) must not stop the engine
            log.exception("request %s: emit failed", r.id)

    def _observe(self, name: str, **values) -> None:
        if self.observer is not None:
            self.observer.on_event(name, **values)

    # -- warm-up ------------------------------------------------------------------------------

    def warmup(self) -> dict:
        """Compiles the closed set of programs (module doc) by running it: every prefill width, with the
        prefix cache a request of one prompt block and a token (pad tokens) twice (save, then restore) and
        a bounded replay, and a request past the smallest chunk, each with two output tokens where the
        rows hold them; from now on every compile is counted and logged."""
        t0 = time.perf_counter()
        for width in self.chunks:  # every prefill width, on rows that bring no tokens
            rows = list(range(self.prefill_rows))
            logits = self._run_prefill(rows, np.zeros((self.prefill_rows, width), np.int32),
                                       np.zeros(self.prefill_rows, np.int32))
            self._sample(logits, [None] * self.prefill_rows, [0] * self.prefill_rows)
        pc = self.prefix_cache
        # With a prefix cache a prompt past one block, twice (saved, then restored); then one past the smallest
        # chunk; each with a decode step where the rows hold it (rows of 2 tokens never decode, rows with a
        # prefix cache hold at least `prefix_cache_min_len`).
        prompts = [pc.block + 1] * 2 if pc is not None else []
        prompts.append(max(1, min(self.chunks[0] + 1, self.max_model_len - 2)))
        for n in prompts:
            params = SamplingParams(max_tokens=min(2, self.max_model_len - n), temperature=0.0)
            self._run_alone(Request([0] * n, params, emit=lambda e: None))
        if pc is not None and pc.replay_tokens[0]:
            row, _, _ = pc.restore([[0]], self.capacity)
            enc, dec = pc.replay_tokens
            pc.steps.replay(row, np.zeros((1, enc), np.int32), np.zeros(1, np.int32), decoder_tokens=dec)
        jax.block_until_ready(self.cache)
        self.counts.clear()
        self._warm = True
        return {"seconds": time.perf_counter() - t0}

    def _run_alone(self, request: Request) -> None:
        """Runs one request to its end on this thread (before `start`)."""
        self.submit(request)
        for _ in range(len(request.prompt) + request.params.max_tokens + 8):
            if not self.step():
                return
        raise RuntimeError(f"request {request.id}: did not finish")


def prefix_cache_min_len(prefix_cache) -> int:
    """The shortest rows (`max_model_len`) a prefix cache serves: a prompt of one block and a token left to
    prefill (`PrefixCache.restorable` under the engine's `full` schedule), and an output token."""
    return prefix_cache.block + 2


class ContextLengthError(ValueError):
    """A prompt and its max_tokens over the context window (OpenAI's `context_length_exceeded`)."""

    def __init__(self, prompt: int, max_tokens: int, limit: int):
        super().__init__(f"This model's maximum context length is {limit} tokens. However, you requested "
                         f"{prompt + max_tokens} tokens ({prompt} in the prompt, {max_tokens} in the "
                         "completion). Please reduce the length of the prompt or of the completion.")
        self.limit = limit


def _positive(name, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(name, value, "expected a positive integer")


def _first_stop(text: str, stops, sent: int) -> int | None:
    """Where the earliest stop string starts in `text` (searching from just before the sent part)."""
    found = [i for s in stops for i in [text.find(s, max(0, sent - len(s) + 1))] if s and i >= 0]
    return min(found) if found else None


def _key_shape():
    return jax.random.key_data(jax.random.key(0)).shape


def _key_data(seed: int) -> np.ndarray:
    """The request's key: row 0 of `generate(seed=…)` (fold_in(key(seed), 0)), as raw key data."""
    return np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(seed), 0)))


@xla_options.jit
def _sample(logits_PV, key_data, temperature, top_k, top_p, vocab_limit, step_P):
    p = logits_PV.shape[0]
    rows = Sampling(jax.random.wrap_key_data(key_data), temperature, top_k, top_p,
                    jnp.full((p,), vocab_limit, jnp.int32), jnp.zeros((p,), jnp.int32), jnp.full((p, 1), -1, jnp.int32))
    return sample_rows(logits_PV, rows, step_P)


@functools.partial(xla_options.jit, donate_argnums=0)
def _put_row(cache, rows, part):
    return put_rows(cache, rows, part)


@functools.partial(xla_options.jit, static_argnums=(0, 1), donate_argnums=3)
def _prefill_rows(key: str, treedef, leaves, cache, rows_P, tokens_PS, counts_P, engram_ids):
    """The prefill step on rows `rows_P` of the cache only: (logits [P, V], cache with those rows advanced)."""
    part = take_rows(cache, rows_P)
    logits, part = steps.step_body(key, None, jax.tree.unflatten(treedef, leaves), part, tokens_PS, counts_P,
                                   engram_ids)
    return logits, put_rows(cache, rows_P, part)


def _watch_compiles(engine: Engine) -> None:
    """Counts (and logs) every XLA compile after the engine's warm-up."""
    import weakref

    from jax import monitoring

    ref = weakref.ref(engine)

    def listener(event, seconds, **_):
        e = ref()
        if e is not None and e._warm and event == "/jax/core/compile/backend_compile_duration":
            e.compiles_after_warmup += 1
            e._observe("compile_after_warmup", seconds=seconds)
            log.warning("compiled a program after warm-up (%.2f s): a shape outside the engine's closed set", seconds)

    monitoring.register_event_duration_secs_listener(listener)
