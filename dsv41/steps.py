"""Prefill and decode over the inference cache (DESIGN §6): pure functions, jitted, the cache donated.

`prefill(params, cfg, cache, tokens [B, S], lengths [B])` appends each row's first `lengths[b]` tokens
(the rest of the row is padding) to what the cache already holds — call it again for the next chunk —
and returns the logits at each row's last new token. `decode(params, cfg, cache, next_tokens [B])`
appends one token per row. `bind(params, cfg)` gives both (and `replay`) bound to the parameters and
the config once, for loops of steps (each free call flattens the parameters again). The Engram hash ids
are computed on the host (int64 NumPy) from the new tokens and the n-gram look-back kept in the cache.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41 import engram_hash, schema, xla_options
from dsv41 import selections as selections_lib
from dsv41 import model as model_lib
from dsv41.cache import Cache, CompressedKV, host_view, ring_slots, store_of, store_slots, with_mirror
from dsv41.kv_store import LayerStore
from dsv41.errors import ConfigError
from dsv41.plan import layer_plan
from dsv41.nn import mhc


def capacity(cfg, cache: Cache, plan=None) -> int:
    """The number of tokens a cache row can hold (a window-only model: its context window)."""
    rec = next((r for r in (plan or layer_plan(cfg)) if r.stores_entries), None)
    return cfg.context_window if rec is None else cache.compressed[0].entries.shape[2] * rec.ratio


@functools.lru_cache(maxsize=32)
def _plan_of(key: str):
    return layer_plan(model_lib.config_from_key(key))


class Bound:
    """`prefill`, `decode` and `replay` bound to one config and its parameters: the config's key and the
    parameters' leaves are taken once, so that a call pays only its host checks and the dispatch of the
    compiled step (the free functions serialise the config and flatten every parameter each call: about
    half of a small model's host time per decode step). Bind again after changing either; `cfg` is the
    bound config itself (built from its key), so a later change to the caller's config cannot reach it."""

    def __init__(self, params, cfg):
        self.key = model_lib.config_key(cfg)
        self.cfg = model_lib.config_from_key(self.key)
        self.plan = _plan_of(self.key)
        self.leaves, self.treedef = jax.tree.flatten(params)

    def prefill(self, cache: Cache, tokens, lengths=None, *, token_map=None, final: bool = True,
                selections: bool = False):
        """Appends tokens [B, S] (row b: its first lengths[b]) to the cache: (logits [B, V] fp32, cache).

        With `selections`, returns (logits, cache, selections): the indexer picks, pool ids and routed experts
        every layer used for these tokens (`dsv41.selections`, each [B, S, width]; a row's padding past its
        length holds what its padding chose), for the training forward to take (selection replay). It needs
        the `full` schedule: CED runs the decoder over a prompt's last tokens only.

        With `runtime.prefill_schedule = "ced"` (DESIGN §3.5) the tokens run through the encoder and the
        decoder's KV projections; on the `final` chunk of a prompt its last `decoder_replay_tokens` also run
        through the decoder, their windows truncated to the replayed span, and give the logits (on other
        chunks the returned logits are None).
        """
        cfg, key = self.cfg, self.key
        view = host_view(cache)
        held = view.lengths
        tokens, counts = check_tokens(cfg, tokens, lengths, held, capacity(cfg, cache, self.plan))
        s = tokens.shape[1]
        ids, recent = engram_inputs(cfg, view.recent_tokens, tokens, counts, held, token_map)
        tokens = tokens.astype(np.int32)  # host arrays go to the jitted step as they are (no eager device ops)
        if cfg.runtime.prefill_schedule == "ced" and cfg.architecture.family != schema.V41:
            raise ConfigError("runtime.prefill_schedule", "ced", f"expected 'full' for the {cfg.architecture.family!r} "
                              "family: CED needs V4.1's encoder and decoder stages")
        chosen = None
        if cfg.runtime.prefill_schedule == "ced" and s > 1:
            if selections:
                raise ConfigError("runtime.prefill_schedule", "ced", "expected 'full' to return selections: the "
                                  "CED prefill runs the decoder over a prompt's last tokens only")
            replay = min(cfg.swa_bounded_replay.decoder_replay_tokens, s) if final else 0
            logits, cache = _ced(key, None, self.treedef, self.leaves, cache, tokens, counts, ids, replay)
        elif selections:
            logits, cache, chosen = _step(key, None, self.treedef, self.leaves, cache, tokens, counts, ids, True)
        else:
            logits, cache = _step(key, None, self.treedef, self.leaves, cache, tokens, counts, ids)
        if ids is not None:
            cache = dataclasses.replace(cache, recent_tokens=jnp.asarray(recent, jnp.int32))
        cache = with_mirror(cache, held + counts, recent)
        return (logits, cache) if chosen is None else (logits, cache, chosen)

    def decode(self, cache: Cache, next_tokens, *, token_map=None, selections: bool = False):
        """Appends one token per row: next_tokens [B] -> (logits [B, V] fp32, cache), with `selections` also
        what the step chose ([B, 1, width] each, `prefill`'s)."""
        next_tokens = np.asarray(next_tokens)
        if next_tokens.ndim != 1:
            raise ValueError(f"next_tokens: shape {next_tokens.shape}: expected [batch]")
        return self.prefill(cache, next_tokens[:, None], token_map=token_map, selections=selections)

    def replay(self, cache: Cache, tokens_BR, counts_B, *, decoder_tokens: int, engram_ids_BRLC=None) -> Cache:
        """SWA bounded replay (DESIGN §7): rebuilds the window rings of a cache whose global KV was restored.

        Row b's last counts_B[b] cached tokens (left-aligned in tokens_BR [B, R]) run through the encoder,
        the last min(counts_B[b], decoder_tokens) of them through the decoder, every window truncated to its
        replayed span. The Full layers read the restored entries and never rewrite them; lengths and global
        KV are unchanged. engram_ids_BRLC: the replayed tokens' Engram ids (their n-grams reach before the span).
        """
        view = host_view(cache)
        out = _replay(self.key, None, self.treedef, self.leaves, cache, jnp.asarray(tokens_BR, jnp.int32),
                      jnp.asarray(counts_B, jnp.int32), engram_ids_BRLC, int(decoder_tokens))
        return with_mirror(out, view.lengths, view.recent_tokens)


def bind(params, cfg) -> Bound:
    """prefill / decode / replay bound to these parameters and this config (`Bound`): for loops of steps."""
    return Bound(params, cfg)


def prefill(params, cfg, cache: Cache, tokens, lengths=None, *, token_map=None, final: bool = True,
            selections: bool = False):
    """Appends tokens [B, S] (row b: its first lengths[b]) to the cache: (logits [B, V] fp32, cache). See
    `Bound.prefill`; a loop of steps with the same parameters binds them once (`bind`)."""
    return Bound(params, cfg).prefill(cache, tokens, lengths, token_map=token_map, final=final,
                                      selections=selections)


def check_tokens(cfg, tokens, lengths, held_B, cap: int):
    """The host checks of a prefill call: tokens [B, S] (row b: its first lengths[b]; default all) must be
    vocabulary ids and fit the cache beside the held_B tokens each row holds. Returns (tokens with the
    padding set to 0, counts [B] int32); raises ValueError naming what is wrong."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] == 0:
        raise ValueError(f"tokens: shape {tokens.shape}: expected [batch, seq] with seq >= 1")
    b, s = tokens.shape
    counts = np.full((b,), s, np.int32) if lengths is None else np.asarray(lengths, np.int32)
    if counts.shape != (b,) or (counts < 0).any() or (counts > s).any():
        raise ValueError(f"lengths: {counts.tolist()}: expected {b} counts in 0..{s}")
    vocab = cfg.architecture.vocab_size
    live = np.arange(s)[None, :] < counts[:, None]
    if ((tokens < 0) | (tokens >= vocab))[live].any():
        bad = tokens[live & ((tokens < 0) | (tokens >= vocab))]
        raise ValueError(f"tokens: ids {sorted(set(bad.tolist()))[:8]}: expected 0..{vocab - 1}")
    if (held_B + counts > cap).any():
        row = int(np.argmax(held_B + counts > cap))
        raise ValueError(f"row {row}: {int(held_B[row])} cached + {int(counts[row])} new tokens exceed the cache's "
                         f"capacity of {cap} tokens (maximum context length {min(cap, cfg.context_window)})")
    return np.where(live, tokens, 0), counts


def decode(params, cfg, cache: Cache, next_tokens, *, token_map=None, selections: bool = False):
    """Appends one token per row: next_tokens [B] -> (logits [B, V] fp32, cache) (`Bound.decode`)."""
    return Bound(params, cfg).decode(cache, next_tokens, token_map=token_map, selections=selections)


def replay(params, cfg, cache: Cache, tokens_BR, counts_B, *, decoder_tokens: int, engram_ids_BRLC=None) -> Cache:
    """SWA bounded replay (DESIGN §7, `Bound.replay`): rebuilds the window rings of a restored cache."""
    return Bound(params, cfg).replay(cache, tokens_BR, counts_B, decoder_tokens=decoder_tokens,
                                     engram_ids_BRLC=engram_ids_BRLC)


def lower(params, cfg, cache: Cache, tokens_BS, counts_B, engram_ids_BSLC=None, *, replay: int | None = None,
          lowering=None):
    """The lowered prefill/decode step (`jax.stages.Lowered`: `.compile()`, `.cost_analysis()`) for these
    arguments (arrays or `jax.ShapeDtypeStruct`s): every layer over the tokens (the `full` schedule and
    decode), or with `replay` the CED schedule replaying that many tokens through the decoder."""
    key = model_lib.config_key(cfg)
    leaves, treedef = jax.tree.flatten(params)
    if replay is None:
        return _step.lower(key, lowering, treedef, leaves, cache, tokens_BS, counts_B, engram_ids_BSLC)
    return _ced.lower(key, lowering, treedef, leaves, cache, tokens_BS, counts_B, engram_ids_BSLC, replay)


def engram_inputs(cfg, recent_BL, tokens, counts, held, token_map=None):
    """Host-side Engram inputs of a step: (hash ids [B, S, L_engram, C] int32 on device, the new look-back
    [B, max_ngram-1]) for tokens [B, S] (row b: its first counts[b]) after held[b] tokens whose last ones are
    recent_BL (-1 before the start). A config without Engram layers gives (None, recent_BL). Every row is
    hashed at once (`engram_hash.hash_token_window`), in int64 NumPy."""
    e = cfg.architecture.engram
    if not list(e.layers):
        return None, recent_BL
    look = e.max_ngram - 1
    tokens, held = np.asarray(tokens), np.asarray(held)
    if look == 0:
        window = tokens
    else:
        before = held[:, None] - look + np.arange(look) < 0  # look-back positions before the row's start
        window = np.concatenate([np.where(before, -1, np.asarray(recent_BL)), tokens], axis=1)
    new_recent = window[np.arange(len(window))[:, None], np.asarray(counts)[:, None] + np.arange(look)]
    ids = engram_hash.hash_token_window(model_lib.engram_layout(cfg), model_lib.engram_token_map(cfg, token_map),
                                        e.pad_id, window)
    return jnp.asarray(ids, jnp.int32), new_recent.astype(np.asarray(recent_BL).dtype)


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """What every layer of a step reads: the new tokens' positions [B, S] and validity [B, S], the tokens
    each row held before them [B] (lengths), the tokens [B, S] (V4's hash-routed MoE) and Engram ids."""

    positions: jax.Array
    valid: jax.Array
    lengths: jax.Array
    tokens: jax.Array
    engram_ids: jax.Array | None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _State:
    """What a step threads through its layers (the scans' carry): the residual streams x [B,S,N,D] and
    pre [B,S,N], and the cache leaves every layer writes its own slice of, in place (`Cache`'s)."""

    x: jax.Array
    pre: jax.Array
    window: tuple          # per stack slot (`cache.ring_slots`)
    window_scales: tuple
    window_start: jax.Array
    compressed: tuple

    def replace(self, **changes) -> "_State":
        return dataclasses.replace(self, **changes)


def _run(model, cfg, stage, state: _State, published, inputs: _Inputs, entries_ready=(), chosen: dict | None = None):
    """Runs the stacks of `stage` ("encoder", "decoder", or None: all) over the new tokens, the `_State`
    threaded through each stack's scan. entries_ready: layers whose compressor already wrote these
    tokens' entries. chosen: a selections value (`dsv41.selections`) to add the layers' choices to.
    Returns (state, published)."""
    plan = layer_plan(cfg)
    slots, rings = store_slots(cfg), ring_slots(cfg)
    for s, st in enumerate(model.stacks):
        spec = st.spec
        if stage is not None and plan[spec.first].stage != stage:
            continue
        ready = [{layer in entries_ready for layer in np.ravel(spec.grid(j))} for j in range(spec.slots)]
        if any(len(r) > 1 for r in ready):
            raise ValueError(f"entries_ready: {sorted(entries_ready)}: expected all or none of the layers of a stack")

        def layer_fn(block, at, state: _State, published, s=s, spec=spec, ready=ready):
            compressed = list(state.compressed)
            rec = block.attn.record  # the template group's: its sources inside the stack are this group's
            kr = rings.index((s, at.j))  # this slot's ring leaf, the layer at row · run + r on its leading axis
            ring = LayerStore({"values": state.window[kr], "scales": state.window_scales[kr]},
                              spec.row(at.g, at.j) * spec.runs[at.j] + at.r)
            stores, where = {}, {}
            if rec.kv_source is not None:
                src = rec.kv_source
                inside = spec.locate(src)
                if inside is not None and inside[0] == spec.template:  # in this group (a store's slot: one layer)
                    k, src_group = slots.index((s, inside[1])), spec.row(at.g, inside[1])
                else:
                    k, src_group = store_of(cfg, src)
                stores[src], where[src] = LayerStore(vars(compressed[k]).copy(), src_group), k

            def attend(attn, h):
                return attn.step(h, inputs.positions, inputs.valid, inputs.lengths, ring, state.window_start[at.layer],
                                 published, stores, entries_ready=True in ready[at.j])

            x = model.engram_step(at, state.x, inputs.engram_ids)
            x, pre, (new_ring, new_stores, handoff) = block(x, state.pre, attend, inputs.tokens)
            for src, k in where.items():
                compressed[k] = CompressedKV(**new_stores[src].leaves)
            if handoff is not None:
                published = {**published, rec.index: handoff}
            return state.replace(x=x, pre=pre, window=_put(state.window, kr, new_ring.leaves["values"]),
                                 window_scales=_put(state.window_scales, kr, new_ring.leaves["scales"]),
                                 compressed=tuple(compressed)), published

        state, published, records = st.run(layer_fn, state, published, record=chosen is not None)
        if chosen is not None:
            for kind, layers in selections_lib.widths(cfg).items():
                for layer in set(layers) & set(records):
                    chosen.setdefault(kind, {})[layer] = selections_lib.flat(records[layer])[kind]
    return state, published


def _put(leaves: tuple, k: int, leaf) -> tuple:
    return (*leaves[:k], leaf, *leaves[k + 1:])


def _state(cache: Cache, x, pre) -> _State:
    return _State(x, pre, cache.window, cache.window_scales, cache.window_start, cache.compressed)


@jax.named_scope("head")
def _head(model, x_BSND, pre, counts_B):
    rows, last = jnp.arange(x_BSND.shape[0]), jnp.maximum(counts_B - 1, 0)
    x = x_BSND[rows, last][:, None]
    h = model.hc_head(x) if model.hc_head is not None else mhc.collapse(x, pre[rows, last][:, None])
    return model.head(model.norm(h)[:, 0]).astype(jnp.float32)


def _finish(cache, lengths, state: _State):
    return Cache(lengths=lengths, window=state.window, window_scales=state.window_scales, compressed=state.compressed,
                 window_start=state.window_start, recent_tokens=cache.recent_tokens)


def step_body(key: str, lowering, params, cache: Cache, tokens_BS, counts_B, engram_ids_BSLC, chosen: bool = False):
    """The traced prefill/decode step: every layer over the new tokens (the `full` schedule, and every
    decode step) -> (logits [B, V] fp32 at each row's last new token, cache). key: `model.config_key`;
    lowering: `policy.Lowering` (how it is traced). Jit it with both static and the cache donated
    (`dsv41.sharding.step_function` adds shardings). chosen: also return the selections the layers made
    (logits, cache, selections)."""
    model = nnx.merge(model_lib.graphdef(key, lowering), params)
    cfg = model_lib.config_from_key(key)

    s = tokens_BS.shape[1]
    inputs = _Inputs(cache.lengths[:, None] + jnp.arange(s, dtype=jnp.int32), jnp.arange(s) < counts_B[:, None],
                     cache.lengths, tokens_BS, engram_ids_BSLC)
    x, pre = model.embed_tokens(tokens_BS)
    made = {kind: {} for kind in selections_lib.KINDS} if chosen else None
    state, _ = _run(model, cfg, None, _state(cache, x, pre), {}, inputs, chosen=made)
    out = _head(model, state.x, state.pre, counts_B), _finish(cache, cache.lengths + counts_B, state)
    return out if made is None else (*out, made)


# The jitted steps take the parameters as their leaves and (static) tree structure: a list of arrays is
# flattened in C++, an nnx.State calls Python once per Variable (`Bound` flattens once).
@functools.partial(xla_options.jit, static_argnums=(0, 1, 2, 8), donate_argnums=4)
def _step(key, lowering, treedef, leaves, cache: Cache, tokens_BS, counts_B, engram_ids_BSLC, chosen: bool = False):
    """The jitted `step_body`; chosen (static): also return the selections it made."""
    return step_body(key, lowering, jax.tree.unflatten(treedef, leaves), cache, tokens_BS, counts_B, engram_ids_BSLC,
                     chosen=chosen)


@functools.partial(xla_options.jit, static_argnums=(0, 1, 2, 8), donate_argnums=4)
def _ced(key, lowering, treedef, leaves, cache, tokens_BS, counts_B, engram_ids_BSLC, replay: int):
    return ced_body(key, lowering, jax.tree.unflatten(treedef, leaves), cache, tokens_BS, counts_B, engram_ids_BSLC,
                    replay)


@functools.partial(xla_options.jit, static_argnums=(0, 1, 2, 8), donate_argnums=4)
def _replay(key, lowering, treedef, leaves, cache, tokens_BR, counts_B, engram_ids_BRLC, dec: int):
    return replay_body(key, lowering, jax.tree.unflatten(treedef, leaves), cache, tokens_BR, counts_B,
                       engram_ids_BRLC, dec)


def ced_body(key, lowering, params, cache: Cache, tokens_BS, counts_B, engram_ids_BSLC, replay: int):
    """The CED schedule (DESIGN §3.5): encoder + the decoder source's KV for every token; then the last
    `replay` tokens of each row through the decoder, with windows truncated to the replayed span."""
    model = nnx.merge(model_lib.graphdef(key, lowering), params)
    cfg = model_lib.config_from_key(key)
    plan = layer_plan(cfg)
    decoder = [r.index for r in plan if r.stage == "decoder"]
    source = decoder[0]  # validated: the decoder's only Full layer, first

    b, s = tokens_BS.shape
    positions = cache.lengths[:, None] + jnp.arange(s, dtype=jnp.int32)
    valid = jnp.arange(s) < counts_B[:, None]
    x, pre = model.embed_tokens(tokens_BS)
    state, published = _run(model, cfg, "encoder", _state(cache, x, pre), {},
                            _Inputs(positions, valid, cache.lengths, tokens_BS, engram_ids_BSLC))
    block = model.layer(source)
    k, g = store_of(cfg, source)
    compressed = state.compressed
    store = block.attn.write_entries(block.attn_norm(mhc.collapse(state.x, state.pre)), cache.lengths, counts_B,
                                     LayerStore(vars(compressed[k]).copy(), g))
    state = state.replace(compressed=_put(compressed, k, CompressedKV(**store.leaves)))
    new_len = cache.lengths + counts_B
    if not replay:
        return None, _finish(cache, new_len, state)
    # Each row's last `replay` tokens (fewer if the row brought fewer), left-aligned.
    n = jnp.minimum(counts_B, replay)
    first = counts_B - n
    idx = jnp.clip(first[:, None] + jnp.arange(replay), 0, s - 1)
    rows = jnp.arange(b)[:, None]
    start = cache.lengths + first
    ids = None if engram_ids_BSLC is None else engram_ids_BSLC[rows, idx]
    state = state.replace(x=state.x[rows, idx], pre=state.pre[rows, idx],
                          window_start=_restart(state.window_start, decoder, n > 0, start))
    state, _ = _run(model, cfg, "decoder", state, published,
                    _Inputs(positions[rows, idx], jnp.arange(replay) < n[:, None], start, tokens_BS[rows, idx], ids),
                    entries_ready=(source,))
    return _head(model, state.x, state.pre, n), _finish(cache, new_len, state)


def _restart(window_start_LB, layers, when_B, start_B):
    """window_start with the rings of `layers` restarting at start_B where when_B (a replayed span)."""
    layers = jnp.asarray(layers)
    return window_start_LB.at[layers].set(jnp.where(when_B[None], start_B[None], window_start_LB[layers]))


def replay_body(key, lowering, params, cache: Cache, tokens_BR, counts_B, engram_ids_BRLC, dec: int):
    """Each row's last counts[b] restored tokens (left-aligned in tokens_BR) through the encoder, and the
    last min(counts[b], dec) of them through the decoder; every window truncated to its replayed span
    (window_start = the span's first position). Full layers read the restored entries and never write
    them (entries_ready). Returns the cache with rebuilt rings; lengths and global KV unchanged."""
    model = nnx.merge(model_lib.graphdef(key, lowering), params)
    cfg = model_lib.config_from_key(key)
    plan = layer_plan(cfg)
    encoder = [r.index for r in plan if r.stage == "encoder"]
    decoder = [r.index for r in plan if r.stage == "decoder"]
    ready = tuple(r.index for r in plan if r.stores_entries)

    b, s = tokens_BR.shape
    start = cache.lengths - counts_B
    positions = start[:, None] + jnp.arange(s, dtype=jnp.int32)
    valid = jnp.arange(s) < counts_B[:, None]
    x, pre = model.embed_tokens(tokens_BR)
    state = _state(cache, x, pre)
    state = state.replace(window_start=_restart(state.window_start, encoder, counts_B > 0, start))
    state, published = _run(model, cfg, "encoder", state, {},
                            _Inputs(positions, valid, start, tokens_BR, engram_ids_BRLC), entries_ready=ready)
    if not dec:
        return _finish(cache, cache.lengths, state)
    n = jnp.minimum(counts_B, dec)
    first = counts_B - n
    idx = jnp.clip(first[:, None] + jnp.arange(dec), 0, s - 1)
    rows = jnp.arange(b)[:, None]
    dstart = cache.lengths - n
    state = state.replace(x=state.x[rows, idx], pre=state.pre[rows, idx],
                          window_start=_restart(state.window_start, decoder, n > 0, dstart))
    ids = None if engram_ids_BRLC is None else engram_ids_BRLC[rows, idx]
    state, _ = _run(model, cfg, "decoder", state, published,
                    _Inputs(positions[rows, idx], jnp.arange(dec) < n[:, None], dstart, tokens_BR[rows, idx], ids),
                    entries_ready=ready)
    return _finish(cache, cache.lengths, state)
