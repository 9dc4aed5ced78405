"""The inference cache (DESIGN §6): one explicit pytree, outside the modules, in the stored formats.

Per Full layer (the layers that own a compressor): the packed FP4 main entries (FP8, one code a byte,
with `kv_cache.global_kv_dtype: fp8`) with their E4M3 scales, the packed FP4 indexer keys with their
UE8M0 scales, both [B, max_len // ratio, ·], and the compressor leftovers (fp32 wkv·x and wgate·x of the tokens of the unfinished group), stacked like the
parameters: one `CompressedKV` per stack slot that owns a compressor (`store_slots`), each leaf with a
leading layers axis [G, B, ·] over the stack's groups, so a scanned layer reads and writes its own
slice in place (`layer_stores` gives the per-layer view). Per layer: the FP8 window ring with its
UE8M0 scales, stacked the same way: one leaf per stack slot (`ring_slots`), [N, B, W, ·] over the
slot's layers (`ring_layers`: group by group, a run's layers in order; `layer_rings` gives them in
layer order). Per sequence: its length and the last tokens the Engram n-gram hashes look back on.
Every shape is static; a capacity is rounded up to a multiple of every compression ratio
(`round_capacity`). The
one-byte formats are kept as their bits (uint8): a gather then moves bytes and nothing converts a
whole store (`quant.to_bytes` / `quant.from_bytes` convert). The main entries keep their bytes in pairs, as
uint16 words (`kv_store.to_words`): a TPU writes rows into an 8-bit array only after copying the whole store
into another tiling, a 16-bit one in place (docs/decode_bytes.md).

A V4.1 config with `quant: none` (no fake-quant, DESIGN §3.8) gets the float cache: the same leaves
with the entries [B, T, K], indexer keys [B, T, dI] and window rings [N, B, W, K] in the compute dtype
and every scale leaf empty ([..., 0]); the steps then store and read exactly the values the
teacher-forced forward computes, and run the XLA reference paths (the kernels read packed bytes).

V4 (compat, DESIGN §4) with `quant: qat` stores its own formats, as its official inference does: every
window row and CSA/HCA entry one `kv_store.RopeSplitFP8` record of bytes (FP8 NoPE channels with their
UE8M0 scales and BF16 RoPE channels; V4-Flash's entry 584 bytes, its ring row 583), its scale leaves empty;
a CSA layer's indexer keys MXFP4 after the Hadamard rotation, packed like V4.1's. With `quant: none` (what
the released transformers V4 runs) its cache is the float cache. Its overlapped CSA compressors look back
one whole window, so their leftovers hold 2·ratio − 1 tokens, and a CSA layer's indexer (its own
compressor) keeps its own leftovers. The byte accounting (`expected_bytes`) describes both quantised caches.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import accounting, kv_store, quant, schema
from dsv41.errors import ConfigError
from dsv41.nn import policy as policy_lib
from dsv41.plan import layer_plan, layer_slot, layer_stacks


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CompressedKV:
    """The global KV of the Full layers of one stack slot, each leaf [G, B, ·] (a leading layers axis over
    the stack's groups; below, one layer's shapes. The float cache holds entries [B, T, K] and index_keys
    [B, T, dI] in the compute dtype and scale leaves [B, T, 0])."""

    entries: jax.Array        # uint16 [B, T, K/4]    FP4 E2M1, two per byte (even element low nibble), the bytes
                              #   in pairs (`kv_store.to_words`); FP8 main KV: [B, T, K/2], one E4M3 code a byte
    entry_scales: jax.Array   # uint8 [B, T, K/16]     the bits of E4M3 scales
    index_keys: jax.Array     # uint8 [B, T, dI/2]    FP4 E2M1
    index_scales: jax.Array   # uint8 [B, T, dI/32]    the bits of UE8M0 scales
    leftover: jax.Array       # float32 [B, ratio-1, 2K]: wkv·x | wgate·x of the unfinished group's tokens
    index_leftover: jax.Array  # float32 [B, 2·ratio-1, 4·dI]: a V4 CSA indexer's own compressor; else [B, 0, 0]


@dataclasses.dataclass(frozen=True)
class HostMirror:
    """What the host knows of a cache without reading the device (DESIGN §6: no device → host read inside
    prefill/decode): the tokens each row holds and the Engram look-back, as the steps last wrote them."""

    lengths: np.ndarray        # int64 [B]
    recent_tokens: np.ndarray  # int32 [B, max_ngram-1], -1 before the start


@functools.partial(jax.tree_util.register_dataclass, meta_fields=(),
                   data_fields=("lengths", "window", "window_scales", "compressed", "window_start", "recent_tokens"))
@dataclasses.dataclass
class Cache:
    """The whole inference state (as packed; the float cache: window [N, B, W, K] in the compute dtype and
    window_scales [N, B, W, 0]). `mirror` is not a pytree leaf: tree operations, jitted functions and
    `dataclasses.replace` drop it, and `host_view` then reads the lengths from the device once."""

    lengths: jax.Array        # int32 [B]           tokens seen per row
    window: tuple             # uint8 [N, B, W, K] per stack slot (`ring_slots`): the bits of FP8 E4M3
                              #   values; ring slot p % W holds position p
    window_scales: tuple      # uint8 [N, B, W, K/32] per stack slot: the bits of UE8M0 scales
    compressed: tuple         # CompressedKV per stack slot that owns a compressor (`store_slots`), [G, B, ...]
    window_start: jax.Array   # int32 [L, B]          the first position each ring holds (CED replay start)
    recent_tokens: jax.Array  # int32 [B, max_ngram-1] the last tokens (Engram look-back), -1 before start
    mirror: HostMirror | None = dataclasses.field(default=None, init=False, repr=False, compare=False)


def host_view(cache: Cache, read=np.asarray) -> HostMirror:
    """The cache's host mirror, or (a cache built by tree operations, restored or placed on a mesh) its
    lengths and look-back read from the device with `read` (multi-host: `sharding.to_host`)."""
    if cache.mirror is not None:
        return cache.mirror
    return HostMirror(np.asarray(read(cache.lengths)).astype(np.int64), np.asarray(read(cache.recent_tokens)))


def with_mirror(cache: Cache, lengths, recent_tokens) -> Cache:
    """The cache with its host mirror set (host values: what the device leaves hold)."""
    out = dataclasses.replace(cache)  # init=False fields are not copied: the result has no mirror yet
    out.mirror = HostMirror(np.asarray(lengths, np.int64).copy(), np.asarray(recent_tokens, np.int32).copy())
    return out


def full_layers(cfg) -> tuple[int, ...]:
    return tuple(r.index for r in layer_plan(cfg) if r.stores_entries)


def store_slots(cfg) -> tuple[tuple[int, int], ...]:
    """(stack, slot) of each `Cache.compressed` entry: the stack slots whose layers own a compressor."""
    plan = layer_plan(cfg)
    return tuple((s, j) for s, st in enumerate(layer_stacks(cfg)) for j in range(st.slots)
                 if plan[st.slot_layers(st.template, j)[0]].stores_entries)  # a store's slot holds one layer


def store_of(cfg, layer: int) -> tuple[int, int]:
    """(index into `Cache.compressed`, group on its leading axis) of a layer that owns a compressor."""
    s, g, j, _ = layer_slot(cfg, layer)
    slots = store_slots(cfg)
    if (s, j) not in slots:
        raise ValueError(f"layer: {layer}: expected a layer that owns a compressor, one of {full_layers(cfg)}")
    return slots.index((s, j)), layer_stacks(cfg)[s].row(g, j)


def ring_slots(cfg) -> tuple[tuple[int, int], ...]:
    """(stack, slot) of each `Cache.window` / `window_scales` leaf: every stack slot, in order."""
    return tuple((s, j) for s, st in enumerate(layer_stacks(cfg)) for j in range(st.slots))


def ring_layers(cfg) -> tuple[tuple[int, ...], ...]:
    """The layers of each ring leaf, in the order of its leading axis: group by group, and a run's layers
    in order (position g · run + r)."""
    stacks = layer_stacks(cfg)
    return tuple(tuple(int(i) for i in np.ravel(stacks[s].grid(j))) for s, j in ring_slots(cfg))


def layer_rings(cfg, rings) -> list:
    """The per-slot ring leaves `rings` (`Cache.window` or `window_scales`) as one [B, W, ·] per layer, in
    layer order (views of NumPy leaves; `jnp.stack` / `np.stack` them for [L, B, W, ·]; works on
    `abstract_cache` shapes too)."""
    def one(x, n):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x[n]

    where = {layer: (k, n) for k, layers in enumerate(ring_layers(cfg)) for n, layer in enumerate(layers)}
    return [one(rings[k], n) for k, n in (where[i] for i in range(len(where)))]


def layer_stores(cfg, cache) -> dict[int, CompressedKV]:
    """{layer: its CompressedKV [B, ·]} sliced out of the stacked stores (for inspection and the prefix
    cache; works on arrays, on NumPy copies of them (views) and on `abstract_cache` shapes)."""
    def one(x, g):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x[g]

    out = {}
    for i in full_layers(cfg):
        k, g = store_of(cfg, i)
        out[i] = jax.tree.map(lambda x: one(x, g), cache.compressed[k])
    return out


def _shapes(cfg, batch: int, max_len: int) -> dict:
    if cfg.architecture.family == schema.V4:
        return _shapes_v4(cfg, batch, max_len)
    a = cfg.architecture
    k, w = a.head_dim, cfg.kv_cache.swa_window_size
    d_i = cfg.csa2.indexer.head_dim
    packed = cfg.quant == "qat"
    # Packed: two FP4 codes a byte (FP8 main entries: one) and one scale per block; float (quant none): one
    # value an element.
    dtype, per_element = (jnp.uint8, 2) if packed else (policy_lib.from_config(cfg).compute_dtype, 1)
    per_entry = (1 if kv_store.main_kv_format(cfg) == quant.FP8_E4M3_16 else 2) if packed else 1

    def scales(width, fmt):
        return width // quant.BLOCK[fmt] if packed else 0

    plan = layer_plan(cfg)
    compressed = []
    for r in plan:
        if not r.stores_entries:
            continue
        t = max_len // r.ratio
        compressed.append(CompressedKV(
            # packed: the entry's bytes as uint16 words (`kv_store.to_words`)
            entries=_sds((batch, t, k // per_entry // 2), jnp.uint16) if packed else _sds((batch, t, k), dtype),
            entry_scales=_sds((batch, t, scales(k, quant.FP4_E4M3_16)), jnp.uint8),
            index_keys=_sds((batch, t, d_i // per_element), dtype),
            index_scales=_sds((batch, t, scales(d_i, quant.MXFP4)), jnp.uint8),
            leftover=_sds((batch, r.ratio - 1, 2 * k), jnp.float32),
            index_leftover=_sds((batch, 0, 0), jnp.float32),
        ))
    return _common(cfg, plan, batch, _rings(cfg, (batch, w, k), dtype),
                   _rings(cfg, (batch, w, scales(k, quant.FP8_UE8M0_32)), jnp.uint8), _stacked(cfg, compressed))


def _shapes_v4(cfg, batch: int, max_len: int) -> dict:
    a = cfg.architecture
    k, w, d_i = a.head_dim, cfg.kv_cache.swa_window_size, cfg.v4.indexer.head_dim
    packed = cfg.quant == "qat"  # V4's formats (`kv_store.RopeSplitFP8` records, MXFP4 keys); else floats
    dtype = jnp.uint8 if packed else policy_lib.from_config(cfg).compute_dtype
    main, window = kv_store.v4_records(cfg) if packed else (None, None)
    plan = layer_plan(cfg)
    compressed = []
    for r in plan:
        if not r.stores_entries:
            continue
        t, csa = max_len // r.ratio, r.stores_index_keys
        # Overlapped (CSA) compressors pool the previous window too: they keep 2·ratio − 1 tokens of
        # two-part (Ca | Cb) projections, kv | gate each.
        held, width = (2 * r.ratio - 1, 4) if csa else (r.ratio - 1, 2)
        compressed.append(CompressedKV(
            entries=_sds((batch, t, main.row_bytes if packed else k), dtype),
            entry_scales=_sds((batch, t, 0), jnp.uint8),
            index_keys=_sds((batch, t, (d_i // 2 if packed else d_i) if csa else 0), dtype),
            index_scales=_sds((batch, t, d_i // quant.BLOCK[quant.MXFP4] if packed and csa else 0), jnp.uint8),
            leftover=_sds((batch, held, width * k), jnp.float32),
            index_leftover=_sds((batch, held if csa else 0, 4 * d_i if csa else 0), jnp.float32),
        ))
    return _common(cfg, plan, batch, _rings(cfg, (batch, w, window.row_bytes if packed else k), dtype),
                   _rings(cfg, (batch, w, 0), jnp.uint8), _stacked(cfg, compressed))


def _common(cfg, plan, batch: int, window, window_scales, compressed) -> dict:
    a = cfg.architecture
    return dict(
        lengths=_sds((batch,), jnp.int32),
        window=window,
        window_scales=window_scales,
        compressed=tuple(compressed),
        window_start=_sds((len(plan), batch), jnp.int32),
        recent_tokens=_sds((batch, a.engram.max_ngram - 1 if list(a.engram.layers) else 0), jnp.int32),
    )


def _stacked(cfg, per_layer: list) -> list:
    """Per-layer CompressedKV shapes (in layer order) -> one per store slot with a leading layers axis."""
    by_layer = dict(zip(full_layers(cfg), per_layer))
    out = []
    for s, j in store_slots(cfg):
        layers = list(layer_stacks(cfg)[s].grid(j))
        out.append(jax.tree.map(lambda x: _sds((len(layers), *x.shape), x.dtype), by_layer[layers[0]]))
    return out


def _rings(cfg, shape, dtype) -> tuple:
    """One ring leaf per stack slot, [N, *shape] over the slot's layers."""
    return tuple(_sds((len(layers), *shape), dtype) for layers in ring_layers(cfg))


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def quantised(cache: Cache) -> bool:
    """True when the cache holds the packed formats (V4.1 with quant qat), False for the float cache
    (quant none: V4.1 for comparisons, V4 compat)."""
    return cache.window[0].dtype == jnp.uint8


def round_capacity(cfg, max_len: int) -> int:
    """The capacity of a cache row that holds `max_len` tokens: `max_len` rounded up to a multiple of every
    compression ratio (a row's stores hold whole entries), at most the context window."""
    if cfg.architecture.family not in (schema.V41, schema.V4):
        raise ConfigError("architecture.family", cfg.architecture.family,
                          f"the inference cache supports {schema.V41!r} and {schema.V4!r}")
    if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len <= 0:
        raise ConfigError("max_len", max_len, "expected a positive whole number of tokens")
    ratios = sorted({r.ratio for r in layer_plan(cfg) if r.ratio})
    step = math.lcm(*ratios) if ratios else 1
    capacity = -(-int(max_len) // step) * step
    if capacity > cfg.context_window:
        rounded = "" if capacity == max_len else (f", got {capacity}: {max_len} rounded up to a multiple of {step} "
                                                  f"(the compression ratios {ratios})")
        raise ConfigError("max_len", max_len, f"expected a capacity of at most context_window = {cfg.context_window} "
                          f"(the maximum context length){rounded}")
    return capacity


def abstract_cache(cfg, batch: int, max_len: int) -> Cache:
    """The cache's shapes and dtypes without memory (for sizing a 1M-token cache); its capacity is
    `round_capacity(cfg, max_len)`."""
    return Cache(**_shapes(cfg, batch, round_capacity(cfg, max_len)))


def init_cache(cfg, batch: int, max_len: int) -> Cache:
    """An empty cache for `batch` rows of up to `max_len` tokens, its capacity rounded up to a multiple of
    the compression ratios (`round_capacity`; `steps.capacity` reads it back)."""
    shapes = abstract_cache(cfg, batch, max_len)
    # All-zero bytes: +0 values and the smallest scales (the UE8M0 byte 0 is 2^-127; there is no UE8M0 zero).
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    recent = np.full(shapes.recent_tokens.shape, -1, np.int32)
    cache = dataclasses.replace(cache, recent_tokens=jnp.asarray(recent))
    return with_mirror(cache, np.zeros((batch,), np.int64), recent)


def nbytes(cache) -> int:
    """Bytes of every leaf (works on arrays and on ShapeDtypeStructs)."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(cache))


def expected_bytes(cfg, batch: int, max_len: int) -> dict:
    """The accounting the cache of `init_cache(cfg, batch, max_len)` must equal: kv_bytes_per_token × its
    capacity (`round_capacity`) + the fixed per-sequence part (the quantised cache, V4.1's or V4's; a float
    cache, quant none, is not what it describes)."""
    if cfg.quant != "qat":
        raise ConfigError("quant", cfg.quant, "expected 'qat': the byte accounting describes the quantised cache "
                          "(its stored formats), and quant 'none' stores floats (cache.nbytes gives their size)")
    capacity = round_capacity(cfg, max_len)
    per_token = accounting.kv_bytes_per_token(cfg)["total"]
    fixed = accounting.fixed_bytes_per_sequence(cfg)
    return {"global_kv": batch * per_token * capacity, "fixed": batch * fixed["total"],
            "total": batch * (per_token * capacity + fixed["total"])}


def _row_axis(path) -> int:
    """Where a cache leaf keeps its rows: [B, ·] for lengths and recent_tokens; [N, B, ·] (a leading layers
    axis) for the rings, the stores and window_start."""
    return 0 if path[0].name in ("lengths", "recent_tokens") else 1


def take_rows(cache: Cache, rows) -> Cache:
    """The cache of rows `rows` ([P] int) of `cache`, in that order (traceable; no host mirror)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: jnp.take(x, rows, axis=_row_axis(p)), cache)


def put_rows(cache: Cache, rows, part: Cache) -> Cache:
    """`cache` with rows `rows` ([P] distinct ints) replaced by the P rows of `part` (traceable)."""
    def put(p, x, y):
        a = _row_axis(p)
        index = (slice(None),) * a + (rows,)
        return x.at[index].set(y.astype(x.dtype))

    return jax.tree_util.tree_map_with_path(put, cache, part)
