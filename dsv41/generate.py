"""Text generation over the inference cache (DESIGN §6, §11): chunked prefill, then one decode per token.

`generate(params, cfg, prompt_ids, max_new_tokens=…)` returns the new ids of one prompt;
`generate_batch` does the same for several prompts of different lengths at once. Greedy when
temperature is 0, otherwise temperature sampling with nucleus (top-p) filtering, drawn with
`jax.random` from the seed: the same seed gives the same ids.

A stop token ends generation and is not part of the output, so an output shorter than
max_new_tokens means a stop token was drawn.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import model as model_lib
from dsv41.cache import init_cache
from dsv41.plan import layer_plan
from dsv41.steps import decode, prefill


def generate(params, cfg, prompt_ids, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             stop_tokens=(), seed: int = 0, chunk: int = 512, vocab_limit: int | None = None, token_map=None,
             on_token=None, on_prefill_progress=None, prefix_cache=None) -> list[int]:
    """The ids generated after `prompt_ids` (a list of ints), at most max_new_tokens of them.

    vocab_limit: draw only ids below it (a tokenizer smaller than the embedding, whose padding rows an
    untrained model would otherwise draw). token_map: the Engram token map (`steps.prefill`).
    on_token(id) is called as each id is drawn (not for a stop token); on_prefill_progress(done, total)
    after each prefill chunk, in prompt tokens. prefix_cache: a `dsv41.prefix_cache.PrefixCache` of these
    params and config: the prompt's cached prefix is restored and its new blocks are saved (DESIGN §7).
    """
    emit = None if on_token is None else (lambda row, token: on_token(token))
    return _generate(params, cfg, [prompt_ids], max_new_tokens=max_new_tokens, temperature=temperature,
                     top_p=top_p, stop_tokens=stop_tokens, seed=seed, chunk=chunk, vocab_limit=vocab_limit,
                     token_map=token_map, on_token=emit, on_prefill_progress=on_prefill_progress,
                     prefix_cache=prefix_cache)[0]


def generate_batch(params, cfg, prompts, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                   stop_tokens=(), seed: int = 0, chunk: int = 512, vocab_limit: int | None = None,
                   token_map=None, on_prefill_progress=None, prefix_cache=None) -> list[list[int]]:
    """`generate` for several prompts (lists of ids, any lengths) in one batch: a list of outputs.

    Each row stops on its own; finished rows keep stepping (on a dummy token) until all are done.
    """
    return _generate(params, cfg, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                     stop_tokens=stop_tokens, seed=seed, chunk=chunk, vocab_limit=vocab_limit, token_map=token_map,
                     on_token=None, on_prefill_progress=on_prefill_progress, prefix_cache=prefix_cache)


def _generate(params, cfg, prompts, *, max_new_tokens, temperature, top_p, stop_tokens, seed, chunk, vocab_limit,
              token_map, on_token, on_prefill_progress, prefix_cache=None):
    prompts = [list(p) for p in prompts]
    stop = set(check_request(cfg, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                             stop_tokens=stop_tokens, chunk=chunk, vocab_limit=vocab_limit))
    max_len = cache_length(cfg, max(map(len, prompts)) + max_new_tokens)
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
    key = jax.random.key(seed)
    outputs = [[] for _ in prompts]
    done = np.zeros(len(prompts), bool)
    for step in range(max_new_tokens):
        if vocab_limit is not None:
            logits_BV = logits_BV[:, :vocab_limit]
        if temperature == 0:
            tokens = np.asarray(jnp.argmax(logits_BV, axis=-1))
        else:
            tokens = np.asarray(sample(logits_BV, jax.random.fold_in(key, step), temperature, top_p))
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
        logits_BV, cache = decode(params, cfg, cache, np.where(done, 0, tokens), token_map=token_map)
    return outputs


@jax.jit
def sample(logits_BV, key, temperature, top_p):
    """Token ids [B] drawn from softmax(logits / temperature) kept to its nucleus and renormalised.

    The nucleus is the smallest set of most likely ids whose probabilities sum to at least top_p
    (the most likely id is always in it; top_p = 1 keeps every id). Ties are broken towards the lower
    id, as argmax does, so a tiny top_p is greedy.
    """
    logits_BV = logits_BV.astype(jnp.float32) / temperature
    order_BV = jnp.argsort(-logits_BV, axis=-1, stable=True)
    sorted_BV = jnp.take_along_axis(logits_BV, order_BV, axis=-1)
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    keep_BV = (mass_before_BV < top_p) | (top_p >= 1.0)
    pick_B = jax.random.categorical(key, jnp.where(keep_BV, sorted_BV, -jnp.inf), axis=-1)
    return jnp.take_along_axis(order_BV, pick_B[:, None], axis=-1)[:, 0]


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
    for k in range(calls):
        end = lengths - (calls - 1 - k) * width
        start = np.maximum(end - width, 0)
        counts = np.maximum(end - start, 0)
        tokens_BS = np.zeros((len(prompts), width), np.int32)
        for row, p in enumerate(prompts):
            tokens_BS[row, :counts[row]] = p[start[row]:start[row] + counts[row]]
        logits_BV, cache = prefill(params, cfg, cache, tokens_BS, counts, token_map=token_map, final=k == calls - 1)
        done += int(counts.sum())
        if on_progress is not None:
            on_progress(done, int(lengths.sum()))
    return logits_BV, cache


def cache_length(cfg, tokens: int) -> int:
    """The cache size for `tokens`: the smallest multiple of the compression ratios that holds them."""
    step = math.lcm(*{r.ratio for r in layer_plan(cfg) if r.ratio})
    return -(-tokens // step) * step


def check_request(cfg, prompts, *, max_new_tokens, temperature, top_p, stop_tokens, chunk,
                  vocab_limit=None) -> list[int]:
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
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens: {max_new_tokens!r}: expected a positive integer")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
        raise ValueError(f"chunk: {chunk!r}: expected a positive integer")
    if not temperature >= 0:
        raise ValueError(f"temperature: {temperature!r}: expected >= 0 (0 is greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p: {top_p!r}: expected a value in (0, 1]")
    if vocab_limit is not None and not (isinstance(vocab_limit, int) and 0 < vocab_limit <= vocab):
        raise ValueError(f"vocab_limit: {vocab_limit!r}: expected None or an integer in 1..{vocab} (vocab_size)")
    stop = list(stop_tokens)
    _check_ids("stop_tokens", stop, vocab)
    longest = max(map(len, prompts))
    if longest + max_new_tokens > cfg.context_window:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} = "
                         f"{longest + max_new_tokens}: expected at most the model's maximum context length "
                         f"of {cfg.context_window} tokens (context_window)")
    return stop


def _check_ids(name: str, ids, vocab: int) -> None:
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < vocab]
    if bad:
        raise ValueError(f"{name}: ids {list(dict.fromkeys(bad))[:8]}: expected integers in 0..{vocab - 1} "
                         "(the vocabulary)")
