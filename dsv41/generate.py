"""Text generation over the inference cache (DESIGN §6, §11): chunked prefill, then the decode loop.

`generate(params, cfg, prompt_ids, max_new_tokens=…)` returns the new ids of one prompt;
`generate_batch` does the same for several prompts of different lengths at once; `generate_from`
continues from a cache already prefilled. Greedy when temperature is 0, otherwise temperature sampling
kept to the top-k ids and then to the nucleus (top-p), drawn with `jax.random`: row b draws step n from
fold_in(fold_in(key(seed), b), n), so the same seed gives the same ids and a row's draws do not depend
on the others.

Two decode loops, the same sampler: `loop="host"` dispatches one decode per token from Python (and can
stream each id); `loop="device"` runs `lax.while_loop` over decode steps on the device, `block` tokens a
call with no host round trip in between (gemma's sampler loop), with per-row stop tokens and lengths.

A stop token ends generation and is not part of the output, so an output shorter than
max_new_tokens means a stop token was drawn.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import engram_hash, sharding, xla_options
from dsv41 import model as model_lib
from dsv41.cache import host_view, init_cache
from dsv41.errors import ConfigError
from dsv41.steps import bind, capacity, step_body


def generate(params, cfg, prompt_ids, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, stop_tokens=(), seed: int = 0, chunk: int = 512, vocab_limit: int | None = None,
             token_map=None, on_token=None, on_prefill_progress=None, prefix_cache=None, loop: str = "host",
             block: int = 32, max_len: int | None = None) -> list[int]:
    """The ids generated after `prompt_ids` (a list of ints), at most max_new_tokens of them.

    vocab_limit: draw only ids below it (a tokenizer smaller than the embedding, whose padding rows an
    untrained model would otherwise draw). token_map: the Engram token map (`steps.prefill`).
    on_token(id) is called as each id is drawn (not for a stop token); on_prefill_progress(done, total)
    after each prefill chunk, in prompt tokens. prefix_cache: a `dsv41.prefix_cache.PrefixCache` of these
    params and config: the prompt's cached prefix is restored and its new blocks are saved (DESIGN §7).
    top_k: keep the k most likely ids before the nucleus (0: all). loop: "host" or "device" (module doc);
    block: tokens per device-loop call (on_token is then called a block at a time). max_len: the cache's
    capacity in tokens (default: the prompt + max_new_tokens); one fixed capacity keeps the steps' shapes,
    and so their compiled programs, the same for every request that fits, as gemma's `cache_length` does.
    """
    emit = None if on_token is None else (lambda row, token: on_token(token))
    return _generate(params, cfg, [prompt_ids], max_new_tokens=max_new_tokens, temperature=temperature,
                     top_p=top_p, top_k=top_k, stop_tokens=stop_tokens, seed=seed, chunk=chunk,
                     vocab_limit=vocab_limit, token_map=token_map, on_token=emit,
                     on_prefill_progress=on_prefill_progress, prefix_cache=prefix_cache, loop=loop, block=block,
                     max_len=max_len)[0]


def generate_batch(params, cfg, prompts, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                   top_k: int = 0, stop_tokens=(), seed: int = 0, chunk: int = 512, vocab_limit: int | None = None,
                   token_map=None, on_prefill_progress=None, prefix_cache=None, loop: str = "host",
                   block: int = 32, max_len: int | None = None) -> list[list[int]]:
    """`generate` for several prompts (lists of ids, any lengths) in one batch: a list of outputs.

    Each row stops on its own; a finished row brings no more tokens to the steps (length 0).
    """
    return _generate(params, cfg, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                     top_k=top_k, stop_tokens=stop_tokens, seed=seed, chunk=chunk, vocab_limit=vocab_limit,
                     token_map=token_map, on_token=None, on_prefill_progress=on_prefill_progress,
                     prefix_cache=prefix_cache, loop=loop, block=block, max_len=max_len)


def _generate(params, cfg, prompts, *, max_new_tokens, temperature, top_p, top_k, stop_tokens, seed, chunk,
              vocab_limit, token_map, on_token, on_prefill_progress, prefix_cache=None, loop="host", block=32,
              max_len=None):
    prompts = [list(p) for p in prompts]
    _check_tables(params)
    stop = set(check_request(cfg, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                             stop_tokens=stop_tokens, chunk=chunk, vocab_limit=vocab_limit, top_k=top_k, seed=seed,
                             loop=loop, block=block))
    needed = max(map(len, prompts)) + max_new_tokens
    if max_len is None:
        max_len = needed  # init_cache rounds it up to the compression ratios
    elif isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < needed:
        raise ValueError(f"max_len: {max_len!r}: expected an int of at least the longest prompt + max_new_tokens "
                         f"= {needed}")
    if prefix_cache is not None:
        if prefix_cache.params is not params or model_lib.config_key(prefix_cache.cfg) != model_lib.config_key(cfg):
            raise ValueError("prefix_cache: built for other parameters or another config: expected a PrefixCache "
                             "of the params and config being generated with")
        logits_BV, cache, _ = prefix_cache.prefill(prompts, max_len, chunk=chunk)
        if on_prefill_progress is not None:
            on_prefill_progress(max(map(len, prompts)), max(map(len, prompts)))
    else:
        cache = init_cache(cfg, len(prompts), max_len)
        logits_BV, cache = prefill_chunked(params, cfg, cache, prompts, chunk=chunk, token_map=token_map,
                                           on_progress=on_prefill_progress)
    return _continue(params, cfg, cache, logits_BV, max_new_tokens=max_new_tokens, temperature=temperature,
                     top_p=top_p, top_k=top_k, stop=stop, seed=seed, vocab_limit=vocab_limit, token_map=token_map,
                     on_token=on_token, loop=loop, block=block)


def generate_from(params, cfg, cache, logits_BV, *, max_new_tokens: int, temperature: float = 0.0,
                  top_p: float = 1.0, top_k: int = 0, stop_tokens=(), seed: int = 0, vocab_limit: int | None = None,
                  token_map=None, on_token=None, loop: str = "host", block: int = 32) -> list[list[int]]:
    """`generate_batch`'s decode loop from a cache already prefilled (by `prefill`, `prefill_chunked`, a
    prefix cache or a loop of your own): logits_BV [B, V] are the next-token logits the last step returned.
    The same sampler, loops and arguments as `generate_batch`; on_token(row, id) as ids are drawn. The
    cache is consumed (its buffers are donated to the steps). Each row's held tokens + max_new_tokens must
    fit the cache and the context window."""
    _check_tables(params)
    stop = _check_sampling(cfg, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                           stop_tokens=stop_tokens, seed=seed, loop=loop, block=block, vocab_limit=vocab_limit)
    held = host_view(cache).lengths
    b = held.shape[0]
    if getattr(logits_BV, "shape", None) != (b, cfg.architecture.vocab_size):
        raise ValueError(f"logits_BV: shape {getattr(logits_BV, 'shape', None)}: expected ({b}, "
                         f"{cfg.architecture.vocab_size}) (the cache's rows, the vocabulary)")
    limit = min(capacity(cfg, cache), cfg.context_window)
    if (held + max_new_tokens > limit).any():
        row = int(np.argmax(held + max_new_tokens > limit))
        raise ValueError(f"max_new_tokens: {max_new_tokens}: row {row} holds {int(held[row])} tokens; expected at "
                         f"most {limit - int(held[row])} more (the cache's capacity / the context window: {limit})")
    return _continue(params, cfg, cache, logits_BV, max_new_tokens=max_new_tokens, temperature=temperature,
                     top_p=top_p, top_k=top_k, stop=set(stop), seed=seed, vocab_limit=vocab_limit,
                     token_map=token_map, on_token=on_token, loop=loop, block=block)


def _continue(params, cfg, cache, logits_BV, *, max_new_tokens, temperature, top_p, top_k, stop, seed, vocab_limit,
              token_map, on_token, loop, block):
    """The decode loop of `_generate` and `generate_from` (arguments checked)."""
    b = logits_BV.shape[0]
    vocab = cfg.architecture.vocab_size if vocab_limit is None else vocab_limit
    rows = Sampling.of(b, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, vocab_limit=vocab,
                       max_new_tokens=max_new_tokens, stop_tokens=sorted(stop))
    if loop == "device":
        return _device_loop(params, cfg, cache, logits_BV, rows, block, on_token, token_map)
    outputs = [[] for _ in range(b)]
    done = np.zeros(b, bool)
    bound = bind(params, cfg)  # once for the loop (each free call flattens the parameters again)
    for step in range(max_new_tokens):
        tokens = np.asarray(sample_rows(logits_BV, rows, jnp.full((b,), step, jnp.int32)))
        for row, token in enumerate(tokens.tolist()):
            if done[row]:
                continue
            if token in stop:
                done[row] = True
                continue
            outputs[row].append(token)
            if on_token is not None:
                on_token(row, token)
        if done.all() or step == max_new_tokens - 1:
            break
        logits_BV, cache = bound.prefill(cache, np.where(done, 0, tokens)[:, None], (~done).astype(np.int32),
                                         token_map=token_map)
    return outputs


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Sampling:
    """Per-row sampling state of the decode loops (arrays [B]; stop_tokens [B, K] padded with -1)."""

    keys: jax.Array            # PRNG key per row: fold_in(key(seed), row)
    temperature: jax.Array     # float32; 0 = greedy
    top_k: jax.Array           # int32; 0 = every id
    top_p: jax.Array           # float32 in (0, 1]
    vocab_limit: jax.Array     # int32: draw only ids below it
    max_new_tokens: jax.Array  # int32
    stop_tokens: jax.Array     # int32 [B, K]

    @classmethod
    def of(cls, batch: int, *, temperature=0.0, top_k=0, top_p=1.0, seed=0, vocab_limit, max_new_tokens,
           stop_tokens=()):
        """Every row alike, or per row where an argument is a list of B values (stop_tokens: of B lists)."""
        per_row = lambda v, dtype: jnp.asarray(np.broadcast_to(np.asarray(v, dtype), (batch,)))
        stops = stop_tokens if stop_tokens and isinstance(stop_tokens[0], (list, tuple)) else [stop_tokens] * batch
        width = max(1, max(map(len, stops)))
        stop = np.full((batch, width), -1, np.int32)
        for row, ids in enumerate(stops):
            stop[row, :len(ids)] = ids
        seeds = np.broadcast_to(np.asarray(seed, np.uint32), (batch,))
        keys = jax.vmap(lambda s, r: jax.random.fold_in(jax.random.key(s), r))(jnp.asarray(seeds), jnp.arange(batch))
        return cls(keys, per_row(temperature, np.float32), per_row(top_k, np.int32), per_row(top_p, np.float32),
                   per_row(vocab_limit, np.int32), per_row(max_new_tokens, np.int32), jnp.asarray(stop))


@xla_options.jit
def sample_rows(logits_BV, rows: Sampling, step_B):
    """Token ids [B]: row b greedy (the lowest id of the largest logit) where its temperature is 0, else
    drawn with key fold_in(rows.keys[b], step_B[b]) from softmax(logits / temperature) kept to the top_k
    most likely ids (0: all), then to the nucleus — the smallest set of most likely ids whose renormalised
    probabilities sum to at least top_p (the most likely id is always in it) — and renormalised. Only ids
    below the row's vocab_limit are drawn. Ties are broken towards the lower id, as argmax does, so a tiny
    top_p or top_k = 1 is greedy."""
    v = logits_BV.shape[-1]
    logits_BV = jnp.where(jnp.arange(v) < rows.vocab_limit[:, None], logits_BV.astype(jnp.float32), -jnp.inf)
    greedy_B = jnp.argmax(logits_BV, axis=-1)
    t_B = jnp.where(rows.temperature > 0, rows.temperature, 1.0)
    scaled_BV = logits_BV / t_B[:, None]
    order_BV = jnp.argsort(-scaled_BV, axis=-1, stable=True)
    sorted_BV = jnp.take_along_axis(scaled_BV, order_BV, axis=-1)
    rank = jnp.arange(v)
    sorted_BV = jnp.where((rows.top_k[:, None] <= 0) | (rank < rows.top_k[:, None]), sorted_BV, -jnp.inf)
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    keep_BV = (mass_before_BV < rows.top_p[:, None]) | (rows.top_p[:, None] >= 1.0)
    keys = jax.vmap(jax.random.fold_in)(rows.keys, step_B)
    pick_B = jax.vmap(jax.random.categorical)(keys, jnp.where(keep_BV, sorted_BV, -jnp.inf))
    drawn_B = jnp.take_along_axis(order_BV, pick_B[:, None], axis=-1)[:, 0]
    return jnp.where(rows.temperature > 0, drawn_B, greedy_B).astype(jnp.int32)


def sample(logits_BV, key, temperature, top_p, top_k: int = 0):
    """`sample_rows` with one setting for every row and row b's key fold_in(key, b): token ids [B]."""
    b, v = logits_BV.shape
    rows = Sampling(jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(b)), jnp.full((b,), temperature),
                    jnp.full((b,), top_k, jnp.int32), jnp.full((b,), top_p), jnp.full((b,), v, jnp.int32),
                    jnp.zeros((b,), jnp.int32), jnp.full((b, 1), -1, jnp.int32))
    return sample_rows(logits_BV, rows, jnp.zeros((b,), jnp.int32))


def _device_loop(params, cfg, cache, logits_BV, rows: Sampling, block: int, on_token, token_map=None):
    """Blocks of `block` tokens from `_sample_block` until every row is done; the host reads each block.
    An Engram model hashes each step's n-grams on the device (`engram_hash.hash_ids_jax`, the host's values),
    from token_map (raw -> compressed, default the identity) and the look-back the cache keeps."""
    b = logits_BV.shape[0]
    outputs = [[] for _ in range(b)]
    generated, done = jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool)
    key = model_lib.config_key(cfg)
    engram = None
    if list(cfg.architecture.engram.layers):
        token_map = model_lib.engram_token_map(cfg, token_map)
        engram = jnp.asarray(engram_hash.validate_token_map(model_lib.engram_layout(cfg), token_map), jnp.int32)
    while True:
        tokens_BN, cache, logits_BV, generated, done = _sample_block(key, None, block, params, cache, logits_BV,
                                                                      rows, generated, done, engram)
        tokens_BN = np.asarray(tokens_BN)
        for row in range(b):
            for token in tokens_BN[row][tokens_BN[row] >= 0].tolist():
                outputs[row].append(token)
                if on_token is not None:
                    on_token(row, token)
        if bool(np.asarray(done).all()):
            return outputs


@functools.partial(xla_options.jit, static_argnums=(0, 1, 2), donate_argnums=(4,))
def _sample_block(key: str, lowering, block: int, params, cache, logits_BV, rows: Sampling, generated_B, done_B,
                  token_map_V=None):
    """Up to `block` decode steps in one `lax.while_loop`: each samples every row's next id, records it
    (tokens [B, block], -1 where a row emitted nothing), ends rows on a stop token or at max_new_tokens
    and, while some row goes on, runs the decode step with the live rows' ids (done rows bring length 0).
    token_map_V: an Engram model's raw -> compressed ids (int32 [V]); each step hashes its token's n-grams
    and moves the cache's look-back (`recent_tokens`) on by the rows' new tokens.
    Returns (tokens, cache, logits at the last step, generated counts, done)."""
    cfg = model_lib.config_from_key(key)

    def engram_ids(recent_BL, token_B, held_B):
        if token_map_V is None:
            return None
        look = recent_BL.shape[1]  # positions before a row's start are -1 whatever the cache holds, as on the host
        recent_BL = jnp.where(held_B[:, None] - look + jnp.arange(look) < 0, -1, recent_BL)
        window = jnp.concatenate([recent_BL, token_B[:, None]], axis=1)
        window = jnp.where(window < 0, -1, token_map_V[jnp.maximum(window, 0)])
        return engram_hash.hash_ids_jax(model_lib.engram_layout(cfg), window,
                                        token_map_V[cfg.architecture.engram.pad_id])

    def cond(carry):
        i, _, _, _, done, _ = carry
        return (i < block) & ~jnp.all(done)

    def body(carry):
        i, cache, logits, generated, done, out = carry
        token = sample_rows(logits, rows, generated)
        stop = jnp.any(token[:, None] == rows.stop_tokens, axis=-1)
        emit = ~done & ~stop
        out = out.at[:, i].set(jnp.where(emit, token, -1))
        generated = generated + emit.astype(jnp.int32)
        done = done | stop | (generated >= rows.max_new_tokens)

        # Every iteration runs the step, done rows with no new token (their cache rows unchanged). A
        # `lax.cond` that skipped it once every row is done would pass the cache through one branch, and XLA
        # copies a buffer a conditional branch passes through: the whole cache, every step
        # (docs/compile_time.md). The step it skipped is at most one per call, after the last token.
        token = jnp.where(done, 0, token)
        recent = cache.recent_tokens
        logits, cache = step_body(key, lowering, params, cache, token[:, None], (~done).astype(jnp.int32),
                                  engram_ids(recent, token, cache.lengths))
        if token_map_V is not None:
            moved = jnp.concatenate([recent[:, 1:], token[:, None]], axis=1)
            cache = dataclasses.replace(cache, recent_tokens=jnp.where(done[:, None], recent, moved))
        return i + 1, cache, logits, generated, done, out

    out = jnp.full((done_B.shape[0], block), -1, jnp.int32)
    _, cache, logits_BV, generated_B, done_B, out = jax.lax.while_loop(
        cond, body, (jnp.int32(0), cache, logits_BV, generated_B, done_B, out))
    return out, cache, logits_BV, generated_B, done_B


def prefill_chunked(params, cfg, cache, prompts, *, chunk: int = 512, token_map=None, on_progress=None):
    """Prefills prompts (lists of ids) in chunks of one fixed width: (logits [B, V] at each last token, cache).

    The width is `chunk`, or the longest prompt if shorter, so one compiled step serves every chunk.
    Chunks are aligned to the prompts' ends: every row's last token is in the final call, whose
    logits are the answer (and which alone is `final`, where the CED schedule replays the decoder);
    a shorter row brings no tokens (length 0) to the first calls.
    """
    lengths = np.array([len(p) for p in prompts])
    width = min(chunk, int(lengths.max()))
    calls = -(-int(lengths.max()) // width)
    done = 0
    bound = bind(params, cfg)
    for k in range(calls):
        end = lengths - (calls - 1 - k) * width
        start = np.maximum(end - width, 0)
        counts = np.maximum(end - start, 0)
        tokens_BS = np.zeros((len(prompts), width), np.int32)
        for row, p in enumerate(prompts):
            tokens_BS[row, :counts[row]] = p[start[row]:start[row] + counts[row]]
        logits_BV, cache = bound.prefill(cache, tokens_BS, counts, token_map=token_map, final=k == calls - 1)
        done += int(counts.sum())
        if on_progress is not None:
            on_progress(done, int(lengths.sum()))
    return logits_BV, cache


def check_request(cfg, prompts, *, max_new_tokens, temperature, top_p, stop_tokens, chunk,
                  vocab_limit=None, top_k=0, seed=0, loop="host", block=32) -> list[int]:
    """Raises ValueError (naming the argument, the value and what was expected) for a request the model
    cannot serve; returns the stop tokens as a list of ints."""
    vocab = cfg.architecture.vocab_size
    if not prompts:
        raise ValueError("prompts: []: expected at least one prompt")
    for row, p in enumerate(prompts):
        name = f"prompt_ids (row {row})" if len(prompts) > 1 else "prompt_ids"
        if not p:
            raise ValueError(f"{name}: []: expected at least one token")
        _check_ids(name, p, vocab)
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
        raise ValueError(f"chunk: {chunk!r}: expected a positive integer")
    stop = _check_sampling(cfg, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                           stop_tokens=stop_tokens, seed=seed, loop=loop, block=block, vocab_limit=vocab_limit)
    longest = max(map(len, prompts))
    if longest + max_new_tokens > cfg.context_window:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} = "
                         f"{longest + max_new_tokens}: expected at most the model's maximum context length "
                         f"of {cfg.context_window} tokens (context_window)")
    return stop


def _check_sampling(cfg, *, max_new_tokens, temperature, top_p, top_k, stop_tokens, seed, loop, block,
                    vocab_limit) -> list[int]:
    """The checks of the decode loop's arguments (`check_request`); returns the stop tokens as a list."""
    vocab = cfg.architecture.vocab_size
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens: {max_new_tokens!r}: expected a positive integer")
    if not temperature >= 0:
        raise ValueError(f"temperature: {temperature!r}: expected >= 0 (0 is greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p: {top_p!r}: expected a value in (0, 1]")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k: {top_k!r}: expected an integer >= 0 (0 keeps every id)")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ValueError(f"seed: {seed!r}: expected an integer in 0..{2**32 - 1}")
    if loop not in ("host", "device"):
        raise ValueError(f"loop: {loop!r}: expected 'host' or 'device'")
    if loop == "device":
        if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
            raise ValueError(f"block: {block!r}: expected a positive integer (tokens per device-loop call)")
    if vocab_limit is not None and not (isinstance(vocab_limit, int) and 0 < vocab_limit <= vocab):
        raise ValueError(f"vocab_limit: {vocab_limit!r}: expected None or an integer in 1..{vocab} (vocab_size)")
    stop = list(stop_tokens)
    _check_ids("stop_tokens", stop, vocab)
    return stop


def _check_tables(params) -> None:
    if sharding.engram_on_host(params):
        raise ConfigError("engram_host", True, "expected the Engram tables in device memory: host-memory tables are "
                          "read by the sharded steps (`dsv41.Engine(engram_host=True)`, `dsv41 serve --engram-host`)")


def _check_ids(name: str, ids, vocab: int) -> None:
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < vocab]
    if bad:
        raise ValueError(f"{name}: ids {list(dict.fromkeys(bad))[:8]}: expected integers in 0..{vocab - 1} "
                         "(the vocabulary)")
