"""Loading, overriding and validating configurations (DESIGN §2, §11).

`load_config(name_or_path, overrides)` reads a `.json`, `.toml` or `.py` file (or the name of one in
`configs/`), merges it onto the schema of its family (`dsv41.schema`), applies `key.path=value`
overrides, checks every rule and returns a locked `ml_collections.ConfigDict`. Any broken rule is a
`ConfigError` naming the field, the value and what was expected.
"""

from __future__ import annotations

import ast
import importlib.resources
import importlib.util
import json
import math
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

import ml_collections

from dsv41 import formats, kv_store, schema
from dsv41.errors import ConfigError

CONFIG_SUFFIXES = (".json", ".toml", ".py")
INT32_MAX = 2**31 - 1


# ------------------------------------------------------------------------------------------------
# Reading files


def configs_dir() -> Path:
    """The folder of shipped configs (`configs/`, installed as `dsv41.configs`)."""
    return Path(str(importlib.resources.files("dsv41.configs")))


def shipped_weights(name: str) -> Path:
    """Where trained weights of the shipped config `name` live (`configs/NAME.safetensors`, beside the
    config; `convert.save_params` format). The file may not exist."""
    return configs_dir() / f"{name}.safetensors"


def available_configs() -> list[str]:
    """Names accepted by `load_config` without a path."""
    return sorted({p.stem for p in configs_dir().iterdir() if p.suffix in CONFIG_SUFFIXES and p.stem != "__init__"})


def resolve(name_or_path: str | os.PathLike) -> Path:
    """The file meant by a path or by the name of a file in `configs/`."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    if path.name == str(name_or_path):  # a bare name: look in configs/
        stem, suffix = (path.stem, path.suffix) if path.suffix in CONFIG_SUFFIXES else (path.name, "")
        for s in (suffix,) if suffix else CONFIG_SUFFIXES:
            candidate = configs_dir() / f"{stem}{s}"
            if candidate.is_file():
                return candidate
    raise ConfigError(
        "config", str(name_or_path),
        f"expected an existing .json/.toml/.py file or one of the shipped configs {available_configs()}",
    )


def read_file(path: Path) -> dict:
    """The raw dictionary stored in a config file."""
    if path.suffix == ".json":
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError("config", str(path), f"expected valid JSON ({e})") from None
    elif path.suffix == ".toml":
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError("config", str(path), f"expected valid TOML ({e})") from None
    elif path.suffix == ".py":
        spec = importlib.util.spec_from_file_location(f"_dsv41_config_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            raise ConfigError("config", str(path), "expected a Python file defining get_config()")
        raw = module.get_config()
        if isinstance(raw, ml_collections.ConfigDict):
            raw = raw.to_dict()
    else:
        raise ConfigError("config", str(path), f"expected a file ending in one of {CONFIG_SUFFIXES}")
    if not isinstance(raw, Mapping):
        raise ConfigError("config", str(path), "expected a table/object at the top level")
    return dict(raw)


# ------------------------------------------------------------------------------------------------
# Merging onto the schema with type checks


def _type_name(t) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "table"}.get(t, str(t))


def _check_type(field: str, value, expected: type):
    """`value` converted to `expected` (int -> float only), or ConfigError."""
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is int and isinstance(value, bool):
        raise ConfigError(field, value, "expected int, got bool")
    if expected is list and isinstance(value, tuple):
        return list(value)
    if not isinstance(value, expected):
        raise ConfigError(field, value, f"expected {_type_name(expected)}, got {_type_name(type(value))}")
    return value


def _merge(field: str, default, value):
    """Merges `value` onto a schema node `default`, checking names and types."""
    if isinstance(default, dict):
        if not isinstance(value, Mapping):
            raise ConfigError(field, value, f"expected a table with fields {sorted(default)}")
        out = dict(default)
        for key, v in value.items():
            path = f"{field}.{key}" if field else key
            if key not in default:
                raise ConfigError(path, v, f"unknown field; expected one of {sorted(default)}")
            out[key] = _merge(path, default[key], v)
        return out
    if isinstance(default, schema.Nullable):
        return None if value is None else _check_type(field, value, default.type)
    if value is None:
        raise ConfigError(field, value, f"expected {_type_name(type(default))}, got null")
    return _check_type(field, value, type(default))


def _finalise(node):
    """Replaces Nullable defaults left unset by None."""
    if isinstance(node, dict):
        return {k: _finalise(v) for k, v in node.items()}
    return None if isinstance(node, schema.Nullable) else node


def family_of(raw: Mapping) -> str:
    if "kv_layout" in raw:
        return schema.LAYOUT
    arch = raw.get("architecture", {})
    family = arch.get("family", schema.V41) if isinstance(arch, Mapping) else schema.V41
    if family not in schema.FAMILIES:
        raise ConfigError("architecture.family", family, f"expected one of {list(schema.FAMILIES)}")
    return family


# ------------------------------------------------------------------------------------------------
# Overrides: key.path=value


def parse_override(text: str) -> tuple[str, object]:
    """Splits "a.b.c=value"; the value is read as JSON, else as a Python literal, else as a string."""
    if "=" not in text:
        raise ConfigError("override", text, "expected key.path=value")
    key, _, raw = text.partition("=")
    key = key.strip()
    for parse in (json.loads, ast.literal_eval):
        try:
            return key, parse(raw)
        except (ValueError, SyntaxError):
            pass
    return key, raw


def apply_override(tree: dict, family_defaults: dict, key: str, value) -> None:
    """Sets `key` (a dotted path; list items by index) in `tree`, type-checked against the schema."""
    parts = key.split(".")
    if parts == ["architecture", "family"]:
        raise ConfigError(key, value, "the family cannot be overridden; load a config of that family")
    node, default = tree, family_defaults
    for i, part in enumerate(parts):
        path = ".".join(parts[: i + 1])
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(path, value, f"expected a list index below {len(node)}")
            idx = int(part)
            if last:
                old = node[idx]
                node[idx] = value if old is None else _check_type(path, value, type(old))
                return
            node, default = node[idx], None
            continue
        if not isinstance(node, dict) or part not in node:
            known = sorted(node) if isinstance(node, dict) else []
            raise ConfigError(path, value, f"unknown field; expected one of {known}")
        sub_default = default.get(part) if isinstance(default, dict) else None
        if last:
            if sub_default is not None:
                node[part] = _merge(path, sub_default, value)
            else:  # inside a list item: keep the type of what is there
                node[part] = _check_type(path, value, type(node[part]))
            return
        node, default = node[part], sub_default


# ------------------------------------------------------------------------------------------------
# Public entry points


def build(raw: Mapping, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """Merges a raw dict onto its family's schema, applies overrides and validates."""
    family = family_of(raw)
    family_defaults = schema.defaults(family)
    tree = _finalise(_merge("", family_defaults, raw))
    for text in overrides:
        key, value = parse_override(text)
        apply_override(tree, family_defaults, key, value)
    cfg = ml_collections.ConfigDict(tree)
    validate(cfg)
    cfg.lock()
    return cfg


def load_config(name_or_path: str | os.PathLike, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """Loads a config by name (a file in `configs/`) or path (.json, .toml, .py).

    Args:
      name_or_path: e.g. "tiny", "v41_flash", "configs/v41_flash.toml", "my_model.py" (which defines
        `get_config()` returning a dict or ConfigDict).
      overrides: "key.path=value" strings (values read as JSON, e.g. "csa2.indexer.top_k=64"),
        type-checked against the schema.
    Returns:
      A locked `ml_collections.ConfigDict` that passed every rule of `validate`.
    """
    return build(read_file(resolve(name_or_path)), overrides)


def family(cfg) -> str:
    return schema.LAYOUT if "kv_layout" in cfg else cfg.architecture.family


# ------------------------------------------------------------------------------------------------
# Validation


def _positive(cfg, *paths):
    for path in paths:
        value = _get(cfg, path)
        if value <= 0:
            raise ConfigError(path, value, "expected a positive value")


def _non_negative(cfg, *paths):
    for path in paths:
        value = _get(cfg, path)
        if value < 0:
            raise ConfigError(path, value, "expected a value >= 0")


def _one_of(cfg, path, allowed):
    value = _get(cfg, path)
    if value not in allowed:
        raise ConfigError(path, value, f"expected one of {list(allowed)}")


def _get(cfg, path: str):
    node = cfg
    for part in path.split("."):
        node = node[part]
    return node


def _check_record(path: str, record, fields: dict, required: tuple) -> None:
    """Checks a table inside a list (a csa2 group, a layout part): known fields, required ones, types."""
    if not isinstance(record, Mapping):
        raise ConfigError(path, record, f"expected a table with fields {list(fields)}")
    for key in record:
        if key not in fields:
            raise ConfigError(f"{path}.{key}", record[key], f"unknown field; expected one of {list(fields)}")
    for key in required:
        if key not in record:
            raise ConfigError(f"{path}.{key}", None, f"missing; expected the fields {list(required)}")
    for key, t in fields.items():
        if key in record:
            _check_type(f"{path}.{key}", record[key], t)


def _divisible(path: str, width: int, block: int, what: str):
    if width % block:
        raise ConfigError(path, width, f"expected a multiple of {block} ({what})")


def validate(cfg) -> None:
    """Checks every rule; raises ConfigError for the first broken one."""
    fam = family(cfg)
    if fam == schema.LAYOUT:
        _validate_layout(cfg)
        return
    _validate_common(cfg)
    if fam == schema.V41:
        _validate_csa2(cfg)
    else:
        _validate_v4(cfg)
    from dsv41 import plan  # the plan rules (sources before use) live with the plan

    records = plan.layer_plan(cfg)
    ratios = sorted({r.ratio for r in records if r.ratio})
    step = math.lcm(*ratios) if ratios else 1
    block = cfg.kv_cache.persistent_cache.block_tokens
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0 or block % step:
        raise ConfigError("kv_cache.persistent_cache.block_tokens", block,
                          f"expected a positive multiple of {step} (the compression ratios {ratios}): a block "
                          "boundary must close every compressor group")


def _validate_common(cfg) -> None:
    if not cfg.model:
        raise ConfigError("model", cfg.model, "expected a non-empty model name")
    if not cfg.base_url.startswith(("http://", "https://")):
        raise ConfigError("base_url", cfg.base_url, "expected an http:// or https:// address")
    qb = cfg.runtime.query_block  # every family reads it (V4 compat's MoE token blocks)
    if isinstance(qb, bool) or not isinstance(qb, int) or qb < 0:
        raise ConfigError("runtime.query_block", qb,
                          "expected a whole number of queries ≥ 0 (0: the whole sequence at once)")
    a = cfg.architecture
    _positive(cfg, *(f"architecture.{k}" for k in (
        "vocab_size", "hidden_size", "num_heads", "head_dim", "rope_head_dim", "q_lora_rank",
        "o_groups", "o_lora_rank", "norm_eps", "initializer_range")))
    if a.rope_head_dim % 2 or a.rope_head_dim > a.head_dim:
        raise ConfigError("architecture.rope_head_dim", a.rope_head_dim,
                          f"expected an even number <= head_dim ({a.head_dim})")
    if a.num_heads % a.o_groups:
        raise ConfigError("architecture.o_groups", a.o_groups,
                          f"expected a divisor of num_heads ({a.num_heads})")
    _positive(cfg, *(f"architecture.rope.{k}" for k in (
        "theta", "compressed_theta", "yarn_factor", "yarn_original_max_position", "max_position")))
    _one_of(cfg, "architecture.rope.compressed_rope_type", ("yarn", "default"))
    if a.tie_embeddings:
        raise ConfigError("architecture.tie_embeddings", a.tie_embeddings,
                          "expected false: the model keeps a separate embedding and output head (tied weights "
                          "are not implemented)")
    m = a.moe
    _positive(cfg, "architecture.moe.num_experts", "architecture.moe.top_k",
              "architecture.moe.intermediate_size", "architecture.moe.route_scale",
              "architecture.moe.swiglu_limit")
    _non_negative(cfg, "architecture.moe.num_shared_experts", "architecture.moe.hash_layers")
    if m.top_k > m.num_experts:
        raise ConfigError("architecture.moe.top_k", m.top_k,
                          f"expected at most num_experts ({m.num_experts})")
    _one_of(cfg, "architecture.moe.score_func", ("sqrtsoftplus",))
    _positive(cfg, "architecture.mhc.streams", "architecture.mhc.sinkhorn_iters", "architecture.mhc.eps")
    _one_of(cfg, "architecture.mhc.variant", ("single_pass", "classic"))
    _one_of(cfg, "quant", ("qat", "none"))
    _one_of(cfg, "runtime.param_dtype", ("float32", "bfloat16"))
    _one_of(cfg, "runtime.compute_dtype", ("float32", "bfloat16"))
    from dsv41.nn.policy import weight_format
    weight_format(cfg)
    _one_of(cfg, "runtime.prefill_schedule", ("full", "ced"))
    _one_of(cfg, "runtime.kernels", ("auto", "pallas", "pallas_interpret", "reference"))
    _one_of(cfg, "runtime.row_loop", ("off", "on"))
    e = a.engram
    _positive(cfg, "architecture.engram.heads_per_ngram", "architecture.engram.row_dim",
              "architecture.engram.compressed_vocab_size", "architecture.engram.prime_floor")
    if e.max_ngram < 2:
        raise ConfigError("architecture.engram.max_ngram", e.max_ngram, "expected at least 2 (bigrams)")
    if any(not isinstance(i, int) for i in e.layers) or list(e.layers) != sorted(set(e.layers)):
        raise ConfigError("architecture.engram.layers", list(e.layers),
                          "expected distinct layer indices in ascending order")

    # Context: positions and entry indices are int32 in the cache; RoPE is defined up to max_position.
    _positive(cfg, "context_window")
    if cfg.context_window > INT32_MAX:
        raise ConfigError("context_window", cfg.context_window,
                          f"expected at most {INT32_MAX}: the cache layout holds positions and entry indices as int32")
    if cfg.context_window > a.rope.max_position:
        raise ConfigError("context_window", cfg.context_window,
                          f"expected at most architecture.rope.max_position ({a.rope.max_position}), "
                          "the longest position the RoPE tables cover")

    kv = cfg.kv_cache
    for name in ("global_kv_dtype", "swa_kv_dtype", "index_kv_dtype"):
        formats.check_dtype(f"kv_cache.{name}", kv[name])
    for name in ("global_kv_rope_dtype", "swa_kv_rope_dtype"):
        if kv[name] is not None:
            formats.check_dtype(f"kv_cache.{name}", kv[name])
    _positive(cfg, "kv_cache.swa_window_size", "kv_cache.global_kv_entry_align_bytes")
    _non_negative(cfg, "kv_cache.persistent_cache.global_kv_ttl_hours",
                  "kv_cache.persistent_cache.swa_kv_ttl_minutes")
    _one_of(cfg, "kv_cache.persistent_cache.swa_kv_location", ("host_dram_pool", "none"))

    # Widths must fill whole quantisation blocks (DESIGN §3.8).
    main_scale = formats.parse_scale("kv_cache.global_kv_scale", kv.global_kv_scale)
    swa_scale = formats.parse_scale("kv_cache.swa_kv_scale", kv.swa_kv_scale)
    index_scale = formats.parse_scale("kv_cache.index_kv_scale", kv.index_kv_scale)
    main_width = a.head_dim if kv.global_kv_rope_dtype is None else a.head_dim - a.rope_head_dim
    if main_scale:
        _divisible("architecture.head_dim", main_width, main_scale.block,
                   f"the main KV scale block of kv_cache.global_kv_scale='{kv.global_kv_scale}'")
    swa_width = a.head_dim if kv.swa_kv_rope_dtype is None else a.head_dim - a.rope_head_dim
    if swa_scale:
        _divisible("architecture.head_dim", swa_width, swa_scale.block,
                   f"the window KV scale block of kv_cache.swa_kv_scale='{kv.swa_kv_scale}'")
    index_dim_path = "csa2.indexer.head_dim" if family(cfg) == schema.V41 else "v4.indexer.head_dim"
    if index_scale:
        _divisible(index_dim_path, _get(cfg, index_dim_path), index_scale.block,
                   f"the indexer key scale block of kv_cache.index_kv_scale='{kv.index_kv_scale}'")


def _validate_csa2(cfg) -> None:
    for stage in ("encoder", "decoder"):
        s = cfg.csa2[stage]
        base = f"csa2.{stage}"
        _positive(cfg, f"{base}.layers", f"{base}.compression_ratio")
        _one_of(cfg, f"{base}.first_two_layers", ("swa_only", "grouped"))
        total = 2 if s.first_two_layers == "swa_only" else 0
        for g, group in enumerate(s.groups):
            gpath = f"{base}.groups.{g}"
            _check_record(gpath, group, schema.GROUP_FIELDS, schema.GROUP_REQUIRED)
            if group["size"] <= 0:
                raise ConfigError(f"{gpath}.size", group["size"], "expected a positive group size")
            if len(group["modes"]) != group["size"]:
                raise ConfigError(f"{gpath}.modes", list(group["modes"]),
                                  f"expected {group['size']} modes, one per layer of the group (size)")
            for mode in group["modes"]:
                if mode not in ("full", "reuse", "reindex"):
                    raise ConfigError(f"{gpath}.modes", list(group["modes"]),
                                      f"unknown mode {mode!r}; expected 'full', 'reuse' or 'reindex'")
            ratio = group.get("compression_ratio", s.compression_ratio)
            if ratio != s.compression_ratio:
                raise ConfigError(f"{gpath}.compression_ratio", ratio,
                                  f"expected the ratio of its stage, {base}.compression_ratio = {s.compression_ratio}")
            total += group["size"]
        if total != s.layers:
            swa = " + 2 window-only layers" if s.first_two_layers == "swa_only" else ""
            raise ConfigError(f"{base}.groups", [dict(g) for g in s.groups],
                              f"group sizes{swa} add up to {total}, expected {base}.layers = {s.layers}")

    ix = cfg.csa2.indexer
    _positive(cfg, "csa2.indexer.query_heads", "csa2.indexer.head_dim", "csa2.indexer.top_k")
    h = ix.hierarchical
    _positive(cfg, "csa2.indexer.hierarchical.max_blocks", "csa2.indexer.hierarchical.positions_per_block")
    if h.candidate_pool_size != h.max_blocks * h.positions_per_block:
        raise ConfigError("csa2.indexer.hierarchical.candidate_pool_size", h.candidate_pool_size,
                          f"expected max_blocks × positions_per_block = {h.max_blocks} × "
                          f"{h.positions_per_block} = {h.max_blocks * h.positions_per_block}")
    if cfg.runtime.score_tile <= 0 or cfg.runtime.score_tile % h.positions_per_block:
        raise ConfigError("runtime.score_tile", cfg.runtime.score_tile,
                          f"expected a positive multiple of csa2.indexer.hierarchical.positions_per_block "
                          f"({h.positions_per_block}): a tile holds whole candidate-pool blocks")
    if h.enabled and ix.top_k > h.candidate_pool_size:
        raise ConfigError("csa2.indexer.top_k", ix.top_k,
                          f"expected at most the candidate pool size ({h.candidate_pool_size}): "
                          "Reindex layers choose their top-k inside the pool")

    if cfg.runtime.prefill_schedule == "ced":
        decoder_modes = [m for g in cfg.csa2.decoder.groups for m in g["modes"]]
        if decoder_modes.count("full") != 1 or decoder_modes[0] != "full":
            raise ConfigError("runtime.prefill_schedule", "ced",
                              "expected a decoder whose only Full layer comes first: its global KV is computed "
                              "from the encoder output, the rest of the decoder only fills window rings")
    window = cfg.kv_cache.swa_window_size
    for key in ("encoder_replay_tokens", "decoder_replay_tokens"):
        value = cfg.swa_bounded_replay[key]
        if not 0 <= value <= window:
            raise ConfigError(f"swa_bounded_replay.{key}", value,
                              f"expected 0..kv_cache.swa_window_size ({window}): replay rebuilds at most one window")


def _validate_v4(cfg) -> None:
    v4 = cfg.v4
    _positive(cfg, "v4.csa_ratio", "v4.hca_ratio", "v4.indexer.query_heads", "v4.indexer.head_dim",
              "v4.indexer.top_k")
    for i, t in enumerate(v4.layer_types):
        if t not in ("window", "csa", "hca"):
            raise ConfigError(f"v4.layer_types.{i}", t, "unknown layer type; expected 'window', 'csa' or 'hca'")
    if cfg.architecture.moe.hash_layers > len(v4.layer_types):
        raise ConfigError("architecture.moe.hash_layers", cfg.architecture.moe.hash_layers,
                          f"expected at most the number of layers ({len(v4.layer_types)})")
    if cfg.quant == "qat":  # V4's own stored formats (DESIGN §4): refuse what its packed cache cannot hold
        kv_store.v4_records(cfg)
        d = v4.indexer.head_dim
        if v4.indexer.hadamard and d & (d - 1):
            raise ConfigError("v4.indexer.head_dim", d, "expected a power of two for the Hadamard rotation "
                              "(v4.indexer.hadamard) of the indexer's keys and queries")
    if v4.indexer.head_dim < cfg.architecture.rope_head_dim:
        raise ConfigError("v4.indexer.head_dim", v4.indexer.head_dim,
                          f"expected at least architecture.rope_head_dim ({cfg.architecture.rope_head_dim}): "
                          "the indexer rotates its last rope_head_dim channels")


def _validate_layout(cfg) -> None:
    if not cfg.model:
        raise ConfigError("model", cfg.model, "expected a non-empty model name")
    _positive(cfg, "kv_layout.layers", "kv_layout.entry_align_bytes")
    if not cfg.kv_layout.parts:
        raise ConfigError("kv_layout.parts", [], "expected at least one stored part")
    for i, part in enumerate(cfg.kv_layout.parts):
        path = f"kv_layout.parts.{i}"
        _check_record(path, part, schema.LAYOUT_PART_FIELDS, schema.LAYOUT_PART_REQUIRED)
        if part.get("role", "main") not in ("main", "index"):
            raise ConfigError(f"{path}.role", part["role"], "expected 'main' or 'index'")
        formats.make_part(path, part["dims"], part["dtype"], part.get("scale", "none"), part.get("count", 1))


def weight_format_overrides(fmt: str | None) -> list[str]:
    """`--set` overrides that give a config the weight format `fmt` (`dsv41.nn.weights.FORMATS`; None: none):
    `shipped` keeps param_dtype for the parameters the release does not quantise; bf16 / f32 set it."""
    if fmt is None:
        return []
    dtypes = {"f32": "float32", "bf16": "bfloat16"}
    if fmt != "shipped" and fmt not in dtypes:
        raise ConfigError("--weight-format", fmt, "expected one of ['shipped', 'bf16', 'f32']")
    return [f'runtime.weight_format="{fmt}"'] + ([f'runtime.param_dtype="{dtypes[fmt]}"'] if fmt in dtypes else [])


def add_weight_format_argument(p) -> None:
    """`--weight-format` on a command that builds a model (`weight_format_overrides`; default: the config's)."""
    p.add_argument("--weight-format", choices=("shipped", "bf16", "f32"), default=None,
                   help="how the weights are held: 'shipped' (the release's FP8 / MXFP4 matrices with their scales, "
                        "dequantised in each matmul; a plain weights file is quantised to them), 'bf16' or 'f32' "
                        "(default: the config's runtime.weight_format)")
