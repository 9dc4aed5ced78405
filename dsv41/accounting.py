"""KV-cache accounting (DESIGN §5): bytes of global KV per token, computed from the config.

Per-token global KV = Σ over the layers that store entries of (entry bytes) / ratio, where the
entry bytes follow from the storage formats (`dsv41.formats`) and the plan decides which layers
store. Window rings are a fixed per-sequence cost, reported separately.
"""

from __future__ import annotations

from fractions import Fraction

from dsv41 import formats, schema
from dsv41.config import family
from dsv41.plan import CSA, layer_plan

GB = 10**9


def _split_parts(cfg, name: str, dtype: str, scale: str, rope_dtype: str | None) -> list[formats.Part]:
    a = cfg.architecture
    if rope_dtype is None:
        return [formats.make_part(f"kv_cache.{name}", a.head_dim, dtype, scale)]
    return [
        formats.make_part(f"kv_cache.{name}", a.head_dim - a.rope_head_dim, dtype, scale),
        formats.make_part(f"kv_cache.{name}_rope", a.rope_head_dim, rope_dtype),
    ]


def main_entry_parts(cfg) -> list[formats.Part]:
    """The stored parts of one main global KV entry (V4.1: 512 FP4 + E4M3/16; V4: 448 FP8 + 64 BF16)."""
    kv = cfg.kv_cache
    return _split_parts(cfg, "global_kv", kv.global_kv_dtype, kv.global_kv_scale, kv.global_kv_rope_dtype)


def window_row_parts(cfg) -> list[formats.Part]:
    """The stored parts of one window-ring row (V4.1: 512 FP8 + UE8M0/32; V4: 448 FP8 + UE8M0/64 + 64 BF16)."""
    kv = cfg.kv_cache
    return _split_parts(cfg, "swa_kv", kv.swa_kv_dtype, kv.swa_kv_scale, kv.swa_kv_rope_dtype)


def index_head_dim(cfg) -> int:
    return cfg.csa2.indexer.head_dim if family(cfg) == schema.V41 else cfg.v4.indexer.head_dim


def entry_bytes(cfg) -> dict[str, Fraction]:
    """Bytes of one main entry, one indexer key and one window-ring row."""
    kv = cfg.kv_cache
    return {
        "main": formats.entry_bytes(main_entry_parts(cfg), kv.global_kv_entry_align_bytes),
        "index": formats.make_part("kv_cache.index_kv", index_head_dim(cfg), kv.index_kv_dtype, kv.index_kv_scale).bytes,
        "window": sum((p.bytes for p in window_row_parts(cfg)), Fraction(0)),
    }


def _number(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


def kv_bytes_per_token(cfg) -> dict:
    """Global KV bytes per token of a model (or reference layout) config.

    Returns a dict with "total", "main" and "index" (bytes per token; int when whole), "model",
    "gb_per_million_tokens", and for model configs also "entry_bytes", "without_sharing" (every
    compressed layer storing its own entries and indexer keys), "per_layer" (bytes per token of each
    storing layer) and "window_ring_bytes_per_sequence".
    """
    if family(cfg) == schema.LAYOUT:
        return _layout_bytes(cfg)
    sizes = entry_bytes(cfg)
    plan = layer_plan(cfg)
    main = index = unshared = Fraction(0)
    per_layer = {}
    for r in plan:
        if r.ratio == 0:
            continue
        layer_main = sizes["main"] / r.ratio if r.stores_entries else Fraction(0)
        layer_index = sizes["index"] / r.ratio if r.stores_index_keys else Fraction(0)
        main += layer_main
        index += layer_index
        if layer_main or layer_index:
            per_layer[r.index] = _number(layer_main + layer_index)
        # Without cross-layer sharing every compressed layer keeps its own entries, plus indexer keys
        # when it selects (V4 HCA layers attend all entries and keep none).
        unshared += (sizes["main"] + (sizes["index"] if r.selects else 0)) / r.ratio
    window = cfg.kv_cache.swa_window_size
    return {
        "model": cfg.model,
        "total": _number(main + index),
        "main": _number(main),
        "index": _number(index),
        "gb_per_million_tokens": float((main + index) * 10**6 / GB),
        "entry_bytes": {k: _number(v) for k, v in sizes.items()},
        "without_sharing": _number(unshared),
        "per_layer": per_layer,
        "window_ring_bytes_per_sequence": _number(len(plan) * window * sizes["window"]),
        "window_ring_layout": {"layers": len(plan), "window": window, "row_bytes": _number(sizes["window"])},
    }


def _layout_bytes(cfg) -> dict:
    lay = cfg.kv_layout
    main = index = Fraction(0)
    for i, p in enumerate(lay.parts):
        part = formats.make_part(f"kv_layout.parts.{i}", p["dims"], p["dtype"], p.get("scale", "none"), p.get("count", 1))
        if p.get("role", "main") == "index":
            index += part.bytes
        else:
            main += part.bytes
    aligned = formats.align_up(main + index, lay.entry_align_bytes)
    pad = aligned - (main + index)
    total = aligned * lay.layers
    return {
        "model": cfg.model,
        "total": _number(total),
        "main": _number((main + pad) * lay.layers),
        "index": _number(index * lay.layers),
        "gb_per_million_tokens": float(total * 10**6 / GB),
    }


def _leftover_values(cfg, r) -> int:
    """fp32 values a compressor keeps of its unfinished group: (ratio − 1) tokens of wkv·x | wgate·x; V4's
    overlapped CSA compressor 2·ratio − 1 tokens of its two series (4K), and its indexer's own compressor the
    same at the indexer's width."""
    k = cfg.architecture.head_dim
    if r.mode == CSA:
        return (2 * r.ratio - 1) * 4 * (k + index_head_dim(cfg))
    return (r.ratio - 1) * 2 * k


def fixed_bytes_per_sequence(cfg) -> dict:
    """The per-sequence part of the inference cache that does not grow with the context.

    window_rings: every layer's FP8 ring of `swa_window_size` rows; leftovers: the fp32 wkv·x and
    wgate·x of the (ratio − 1) tokens a ratio > 1 compressor may hold; lengths: one int32; window_starts:
    per layer, the first position its ring holds (0, or the replay start after a CED prefill);
    recent_tokens: the int32 Engram look-back.
    """
    plan = layer_plan(cfg)
    a = cfg.architecture
    sizes = entry_bytes(cfg)
    int32, fp32 = 4, 4
    parts = {
        "window_rings": _number(len(plan) * cfg.kv_cache.swa_window_size * sizes["window"]),
        "leftovers": sum(_leftover_values(cfg, r) * fp32 for r in plan if r.stores_entries),
        "lengths": int32,
        "window_starts": int32 * len(plan),
        "recent_tokens": int32 * (a.engram.max_ngram - 1) if list(a.engram.layers) else 0,
    }
    parts["total"] = sum(parts.values())
    return parts
