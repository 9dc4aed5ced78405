"""Configs and weights from transformers-style checkpoints (DESIGN §11).

Two namings are understood:
- the V4.1 port (`model_type` "deepseek_v41_text"/"deepseek_v41"; parameter names as in the official
  checkpoint, e.g. `model.layers.3.attn.wq_b.weight`, `model.layers.0.ffn.experts.5.w1.weight`);
- the released transformers V4 (`DeepseekV4ForCausalLM`, `model_type` "deepseek_v4").
A converted config keeps the numerics of its source: the V4.1 port quantises (quant "qat"), the
released V4 does not (quant "none").
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41 import stacking
from dsv41 import config as config_lib
from dsv41 import transformers_v4
from dsv41.errors import ConfigError
from dsv41.transformers_common import common_architecture, transposed

V41_TYPES = ("deepseek_v41_text", "deepseek_v41")
V4_TYPES = ("deepseek_v4",)


# ------------------------------------------------------------------------------------------------
# Configs


def config_from_transformers(config_dict: Mapping):
    """A dsv41 config from a transformers config dict (V4.1 port or released V4)."""
    c = dict(config_dict)
    if "text_config" in c and isinstance(c["text_config"], Mapping):
        c = dict(c["text_config"])
    model_type = c.get("model_type")
    if model_type in V41_TYPES:
        return config_lib.build(_v41_raw(c))
    if model_type in V4_TYPES:
        return config_lib.build(transformers_v4.raw_config(c))
    raise ConfigError("model_type", model_type, f"expected one of {list(V41_TYPES + V4_TYPES)}")


def _v41_groups(ratios, kv_sources, index_sources, start, stop):
    groups = []
    for i in range(start, stop):
        mode = "full" if i in kv_sources else "reindex" if i in index_sources else "reuse"
        if mode != "reuse" or not groups:
            groups.append({"size": 0, "modes": []})
        groups[-1]["size"] += 1
        groups[-1]["modes"].append(mode)
    return groups


def _v41_raw(c: Mapping) -> dict:
    ratios = list(c["compress_ratios"])
    n = c["num_hidden_layers"]
    if len(ratios) != n:
        raise ConfigError("compress_ratios", ratios, f"expected {n} entries (num_hidden_layers)")
    window_only = [i for i, r in enumerate(ratios) if r == 0]
    if window_only not in ([], [0, 1]):
        raise ConfigError("compress_ratios", ratios, "expected window-only (ratio 0) layers only at 0 and 1")
    decoder_ratio = ratios[-1]
    split = ratios.index(decoder_ratio, len(window_only))
    encoder_ratio = ratios[len(window_only)] if split > len(window_only) else decoder_ratio
    kv_sources, index_sources = set(c["kv_source_layer_ids"]), set(c["index_source_layer_ids"])
    if split == len(window_only):  # no separate encoder ratio: a single stage is the decoder
        raise ConfigError("compress_ratios", ratios, "expected an encoder ratio before the decoder's (CED)")
    window = c["sliding_window"]
    candidate = c.get("candidate_source_layer_id", -1)
    engram_layers = list(c.get("engram_layer_ids") or [])
    return {
        "model": c.get("_name_or_path") or "DeepSeek-V4.1 (from transformers)",
        "context_window": c["max_position_embeddings"],
        "quant": "qat",  # the port fake-quantises at every site, always
        "kv_cache": {"swa_window_size": window},
        "csa2": {
            "encoder": {"layers": split, "first_two_layers": "swa_only" if window_only else "grouped",
                        "compression_ratio": encoder_ratio,
                        "groups": _v41_groups(ratios, kv_sources, index_sources, len(window_only), split)},
            "decoder": {"layers": n - split, "compression_ratio": decoder_ratio,
                        "groups": _v41_groups(ratios, kv_sources, index_sources, split, n)},
            "indexer": {
                "query_heads": c["index_n_heads"], "head_dim": c["index_head_dim"], "top_k": c["index_topk"],
                "hierarchical": {
                    "enabled": candidate >= 0,
                    "max_blocks": c.get("candidate_topk_blocks", 2048),
                    "positions_per_block": c.get("candidate_block_size", 8),
                    "candidate_pool_size": c.get("candidate_topk_blocks", 2048) * c.get("candidate_block_size", 8),
                },
            },
        },
        "swa_bounded_replay": {"encoder_replay_tokens": min(128, window), "decoder_replay_tokens": min(128, window)},
        "architecture": {
            **common_architecture(c, "v41"),
            "mhc": {**common_architecture(c, "v41")["mhc"], "variant": "single_pass"},
            "engram": {
                "layers": engram_layers,
                "max_ngram": c.get("engram_max_ngram_size", 4),
                "heads_per_ngram": c.get("engram_n_heads", 8),
                "row_dim": c.get("engram_head_dim", 256),
                "compressed_vocab_size": c.get("engram_compressed_vocab_size", 99092),
                "prime_floor": c.get("engram_vocab_size", 16_000_000),
                "pad_id": c.get("engram_pad_id", 2),
            },
        },
    }


# ------------------------------------------------------------------------------------------------
# Weights


def to_numpy(t) -> np.ndarray:
    """A torch tensor or array-like as a NumPy array (float8/bfloat16 tensors widened to float32)."""
    if hasattr(t, "detach"):
        t = t.detach().cpu()
        if t.dtype.is_floating_point and t.dtype.itemsize < 4:
            t = t.float()
        return t.numpy()
    return np.asarray(t)


# Checkpoint tensors dsv41 deliberately does not load: the vision path and the DSpark drafter are out
# of scope (DESIGN §2), as in the port.
V41_IGNORED = re.compile(r"(^|\.)mtp\.|^vision\.|^aligner\.|^image_(start|end|newline)$|\.ffn\.gate\.bias_vl$")

_L = r"model\.layers\.(\d+)\."
V41_RULES = [
    (r"model\.embed\.weight", lambda m: ("embed",), None),
    (r"lm_head\.weight", lambda m: ("head", "w"), transposed),
    (r"model\.norm\.weight", lambda m: ("norm", "weight"), None),
    (_L + r"hc_(attn|ffn)_(fn|base|scale)", lambda m: ("layers", int(m[1]), f"hc_{m[2]}", m[3]), None),
    (_L + r"(attn_norm|ffn_norm)\.weight", lambda m: ("layers", int(m[1]), m[2], "weight"), None),
    (_L + r"attn\.attn_sink", lambda m: ("layers", int(m[1]), "attn", "attn_sink"), None),
    (_L + r"attn\.(wq_a|wq_b|wkv|wo_b)\.weight", lambda m: ("layers", int(m[1]), "attn", m[2], "w"), transposed),
    (_L + r"attn\.(q_norm|kv_norm)\.weight", lambda m: ("layers", int(m[1]), "attn", m[2], "weight"), None),
    (_L + r"attn\.wo_a\.weight", lambda m: ("layers", int(m[1]), "attn", "wo_a"), "wo_a"),
    (_L + r"attn\.compressor\.(wkv|wgate)\.weight", lambda m: ("layers", int(m[1]), "attn", "compressor", m[2], "w"), transposed),
    (_L + r"attn\.compressor\.norm\.weight", lambda m: ("layers", int(m[1]), "attn", "compressor", "norm", "weight"), None),
    (_L + r"attn\.indexer\.(wq_b|weights_proj|wk)\.weight", lambda m: ("layers", int(m[1]), "attn", "indexer", m[2], "w"), transposed),
    (_L + r"attn\.indexer\.k_norm\.weight", lambda m: ("layers", int(m[1]), "attn", "indexer", "k_norm", "weight"), None),
    (_L + r"ffn\.gate\.weight", lambda m: ("layers", int(m[1]), "ffn", "gate"), transposed),
    (_L + r"ffn\.gate\.bias", lambda m: ("layers", int(m[1]), "ffn", "bias"), None),
    (_L + r"ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight", lambda m: ("layers", int(m[1]), "ffn", m[3]), "expert"),
    (_L + r"ffn\.shared_experts\.(w1|w2|w3)\.weight", lambda m: ("layers", int(m[1]), "ffn", "shared", m[2], "w"), transposed),
    (_L + r"engram\.(q_weight|k_weight)", lambda m: ("layers", int(m[1]), "engram", m[2]), None),
    (_L + r"engram\.embed\.weight", lambda m: ("layers", int(m[1]), "engram", "table"), "engram_table"),
    (_L + r"engram\.embed\.scale", None, "engram_scale"),
    (_L + r"engram\.wkv\.weight", lambda m: ("layers", int(m[1]), "engram", "wkv", "w"), transposed),
]


_HELD_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e8m0fnu, jnp.uint8))


def _scale_path(path: tuple) -> tuple:
    """The path of the scales of the weight at `path` (`dsv41.nn.weights`: `X` -> `X_scale`)."""
    return (*path[:-1], f"{path[-1]}_scale")


def _grouped_scales(name: str, scale, groups: int, rows: int):
    """The official `wo_a` scales [⌈G·O/32⌉, ⌈I/32⌉] (32×32 blocks of its [G·O, I] rows) as dsv41's per group
    [G, ⌈I/32⌉, ⌈O/32⌉]: (scales, None), or (None, what is wrong) where a group's block would span two of the
    release's blocks with different scales."""
    block, dtype = 32, np.asarray(scale).dtype
    per_row = np.repeat(np.asarray(scale).view(np.uint8), block, axis=0)[: groups * rows].reshape(groups, rows, -1)
    ours = per_row[:, ::block]
    if not np.array_equal(np.repeat(ours, block, axis=1)[:, :rows], per_row):
        return None, (f"{name.removesuffix('weight')}scale: {tuple(np.shape(scale))}: the release's 32-row blocks "
                      f"do not fall within its {groups} groups of {rows} rows, expected one scale per 32 rows of a group")
    return np.ascontiguousarray(ours.transpose(0, 2, 1)).view(dtype), None


class CheckpointError(ValueError):
    """A checkpoint that does not fit the config: every unknown, missing and misshaped tensor listed."""


def params_from_transformers(state_dict: Mapping, cfg, scales: Mapping | None = None) -> nnx.State:
    """dsv41 parameters from a transformers-style state dict (torch tensors or arrays) for `cfg`.

    scales: {name in state_dict: UE8M0 scales} of the weights held as shipped (`dsv41.nn.weights`, the config's
    weight format `shipped`): each goes beside its weight (`X` -> `X_scale`), laid out as the weight is."""
    from dsv41 import model as model_lib

    if cfg.architecture.family == "v4":
        rules, ignored = transformers_v4.RULES, transformers_v4.IGNORED
    else:
        rules, ignored = V41_RULES, V41_IGNORED
    abstract = model_lib.abstract_params(cfg)
    expected = dict(stacking.per_layer(abstract, cfg))  # per layer: the names speak of layers
    values: dict[tuple, np.ndarray] = {}
    experts: dict[tuple, dict[int, np.ndarray]] = {}
    unknown, misshaped = [], []
    compiled = [(re.compile(p + "$"), target, how) for p, target, how in rules]
    for name, tensor in state_dict.items():
        if ignored.search(name):
            continue
        for pattern, target, how in compiled:
            m = pattern.match(name)
            if m:
                break
        else:
            unknown.append(name)
            continue
        if how == "engram_scale":
            continue  # float tables are exact without it (the port ignores it too); fp8 tables are dequantised at convert time
        array = to_numpy(tensor)
        path = target(m)
        if isinstance(path, list):  # one packed tensor holding several parameters (V4's gate_up_proj)
            if any(p not in expected for p in path):
                unknown.append(name)
            else:
                values.update(zip(path, how(array)))
            continue
        if path not in expected and how != "expert":
            unknown.append(name)
            continue
        scale = None if scales is None else scales.get(name)
        if how == "expert":
            experts.setdefault(path, {})[int(m[2])] = transposed(array)
            if scale is not None:
                experts.setdefault(_scale_path(path), {})[int(m[2])] = transposed(scale)
            continue
        if how == "wo_a":
            g = cfg.architecture.o_groups
            if scale is not None:
                scale, problem = _grouped_scales(name, scale, g, array.shape[0] // g)
                if problem:
                    misshaped.append(problem)
                    continue
            array = array.reshape(g, -1, array.shape[-1]).transpose(0, 2, 1)
        elif callable(how):
            array, scale = how(array), None if scale is None else how(scale)
        values[path] = array
        if scale is not None:
            values[_scale_path(path)] = scale
    for path, per_expert in experts.items():
        if path not in expected:
            unknown.append(".".join(map(str, path)))
            continue
        n = expected[path].get_value().shape[0]
        gaps = [e for e in range(n) if e not in per_expert]
        if gaps:
            misshaped.append(f"{'.'.join(map(str, path))}: experts {gaps} missing of {n}")
            continue
        values[path] = np.stack([per_expert[e] for e in range(n)])
    missing = [".".join(map(str, p)) for p in expected if p not in values]
    for path, array in values.items():
        like = expected[path].get_value()
        if tuple(array.shape) != tuple(like.shape):
            misshaped.append(f"{'.'.join(map(str, path))}: got {tuple(array.shape)}, expected {tuple(like.shape)}")
        elif jnp.dtype(like.dtype) in _HELD_DTYPES and np.dtype(array.dtype) != jnp.dtype(like.dtype):
            # a weight held as shipped takes its shipped bytes only: nothing quantised or widened on the way
            misshaped.append(f"{'.'.join(map(str, path))}: got dtype {np.dtype(array.dtype)}, expected "
                             f"{jnp.dtype(like.dtype)} (weight format 'shipped'; a wider format loads any)")
    if unknown or missing or misshaped:
        raise CheckpointError(
            "checkpoint does not match the config:"
            + (f"\n  unknown tensors ({len(unknown)}): {sorted(unknown)}" if unknown else "")
            + (f"\n  missing parameters ({len(missing)}): {sorted(missing)}" if missing else "")
            + (f"\n  misshaped ({len(misshaped)}): {misshaped}" if misshaped else ""))
    return stacking.from_per_layer(values, abstract, cfg)
