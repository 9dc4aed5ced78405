"""The released transformers DeepSeek-V4 (`DeepseekV4ForCausalLM`, `model_type` "deepseek_v4") as a dsv41
V4 (compat) config and parameter tree (DESIGN §4, §11).

`raw_config(c)` maps a transformers config dict onto the V4 schema; `RULES` / `IGNORED` name the
state-dict tensors in the format of `transformers_io.params_from_transformers`: (regex, path builder,
transform), where a path builder returning a list of paths splits one packed tensor into several
parameters (the transform then returns one array per path).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import numpy as np

from dsv41.errors import ConfigError
from dsv41.transformers_common import common_architecture, require, transposed

# transformers' attention layer types -> dsv41 V4 layer types (DESIGN §4).
LAYER_TYPES = {
    "sliding_attention": "window",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}


def raw_config(c: Mapping) -> dict:
    """A raw dsv41 config dict (family "v4") from a transformers `DeepseekV4Config.to_dict()`."""
    n = c["num_hidden_layers"]
    types = list(c["layer_types"])
    unknown = [t for t in types if t not in LAYER_TYPES]
    if len(types) != n or unknown:
        raise ConfigError("layer_types", types, f"expected {n} entries (num_hidden_layers) from {list(LAYER_TYPES)}")
    mlp = list(c.get("mlp_layer_types") or ["moe"] * n)
    hash_layers = next((i for i, t in enumerate(mlp) if t != "hash_moe"), len(mlp))
    if len(mlp) != n or any(t != "moe" for t in mlp[hash_layers:]):
        raise ConfigError("mlp_layer_types", mlp,
                          f"expected {n} entries: 'hash_moe' layers first, then 'moe' (dsv41 counts the hash layers)")
    # The reference normalises the routing weights whatever k; the shared MoE keeps a single pick's raw score.
    if c["num_experts_per_tok"] < 2:
        raise ConfigError("num_experts_per_tok", c["num_experts_per_tok"], "expected at least 2 routed experts")
    require(c, "n_shared_experts", (1,), "the released V4 builds one shared expert of moe_intermediate_size")
    rates = c.get("compress_rates") or {}
    arch = common_architecture(c, "v4")
    kv_cache = {"swa_window_size": c["sliding_window"]}
    # transformers keeps no cache format; dsv41 records V4's (the accounting's, and the packed cache's under
    # `quant: qat`; converted, the model runs unquantised as transformers does). Its FP8 scales are per 64 of
    # the non-RoPE channels, main and window KV alike; a toy whose non-RoPE width is not a multiple of 64 gets
    # the largest block that divides it.
    nope = arch["head_dim"] - arch["rope_head_dim"]
    if nope % 64:
        kv_cache["global_kv_scale"] = kv_cache["swa_kv_scale"] = f"ue8m0_per_{math.gcd(64, nope)}_channel"
    return {
        "model": c.get("_name_or_path") or "DeepSeek-V4 (from transformers)",
        "context_window": c["max_position_embeddings"],
        "quant": "none",  # the released V4 runs without fake quantisation
        "kv_cache": kv_cache,
        "v4": {
            "layer_types": [LAYER_TYPES[t] for t in types],
            "csa_ratio": rates.get("compressed_sparse_attention", 4),
            "hca_ratio": rates.get("heavily_compressed_attention", 128),
            # No Hadamard rotation: it only conditions FP4 rounding, which the reference does not do.
            "indexer": {"query_heads": c["index_n_heads"], "head_dim": c["index_head_dim"],
                        "top_k": c["index_topk"], "hadamard": False},
        },
        "architecture": {
            **arch,
            "q_head_norm": True,
            "moe": {**arch["moe"], "hash_layers": hash_layers},
            "mhc": {**arch["mhc"], "variant": "classic"},
            "engram": {"layers": []},
        },
    }


def _experts_t(x: np.ndarray) -> np.ndarray:
    """[E, out, in] -> [E, in, out]."""
    return np.ascontiguousarray(np.swapaxes(x, 1, 2))


def _split_gate_up(x: np.ndarray) -> list[np.ndarray]:
    """Packed experts [E, 2·I, D] (gate rows, then up rows) -> w1, w3 [E, D, I]."""
    half = x.shape[1] // 2
    return [_experts_t(x[:, :half]), _experts_t(x[:, half:])]


# The multi-token-prediction layers are not instantiated by the reference either.
IGNORED = re.compile(r"(^|\.)mtp\.")

_L = r"model\.layers\.(\d+)\."
_A = _L + r"self_attn\."
_C = _A + r"compressor\."
_I = _C + r"indexer\."


def _layer(m, *rest):
    return ("layers", int(m[1]), *rest)


RULES = [
    (r"model\.embed_tokens\.weight", lambda m: ("embed",), None),
    (r"lm_head\.weight", lambda m: ("head", "w"), transposed),
    (r"model\.norm\.weight", lambda m: ("norm", "weight"), None),
    (r"model\.hc_head\.hc_(fn|base|scale)", lambda m: ("hc_head", m[1]), None),
    (_L + r"(attn|ffn)_hc\.(fn|base|scale)", lambda m: _layer(m, f"hc_{m[2]}", m[3]), None),
    (_L + r"input_layernorm\.weight", lambda m: _layer(m, "attn_norm", "weight"), None),
    (_L + r"post_attention_layernorm\.weight", lambda m: _layer(m, "ffn_norm", "weight"), None),
    # attention
    (_A + r"sinks", lambda m: _layer(m, "attn", "attn_sink"), None),
    (_A + r"(q_a|q_b|kv|o_b)_proj\.weight",
     lambda m: _layer(m, "attn", {"q_a": "wq_a", "q_b": "wq_b", "kv": "wkv", "o_b": "wo_b"}[m[2]], "w"), transposed),
    (_A + r"(q_a_norm|kv_norm)\.weight",
     lambda m: _layer(m, "attn", {"q_a_norm": "q_norm", "kv_norm": "kv_norm"}[m[2]], "weight"), None),
    (_A + r"o_a_proj\.weight", lambda m: _layer(m, "attn", "wo_a"), "wo_a"),
    # compressors (CSA and HCA) and the CSA indexer, which owns a compressor of its own
    (_C + r"(indexer\.)?(kv|gate)_proj\.weight",
     lambda m: _layer(m, "attn", *(("indexer",) if m[2] else ()), "compressor", "w" + m[3], "w"), transposed),
    (_C + r"(indexer\.)?position_bias",
     lambda m: _layer(m, "attn", *(("indexer",) if m[2] else ()), "compressor", "position_bias"), None),
    (_C + r"(indexer\.)?kv_norm\.weight",
     lambda m: _layer(m, "attn", *(("indexer",) if m[2] else ()), "compressor", "norm", "weight"), None),
    (_I + r"q_b_proj\.weight", lambda m: _layer(m, "attn", "indexer", "wq_b", "w"), transposed),
    (_I + r"scorer\.weights_proj\.weight", lambda m: _layer(m, "attn", "indexer", "weights_proj", "w"), transposed),
    # MoE: router (top-k with its balance bias, or hash table), packed experts, shared expert
    (_L + r"mlp\.gate\.weight", lambda m: _layer(m, "ffn", "gate"), transposed),
    (_L + r"mlp\.gate\.e_score_correction_bias", lambda m: _layer(m, "ffn", "bias"), None),
    (_L + r"mlp\.gate\.tid2eid", lambda m: _layer(m, "ffn", "tid2eid"), None),
    (_L + r"mlp\.experts\.gate_up_proj", lambda m: [_layer(m, "ffn", "w1"), _layer(m, "ffn", "w3")], _split_gate_up),
    (_L + r"mlp\.experts\.down_proj", lambda m: _layer(m, "ffn", "w2"), _experts_t),
    (_L + r"mlp\.shared_experts\.(gate|up|down)_proj\.weight",
     lambda m: _layer(m, "ffn", "shared", {"gate": "w1", "up": "w3", "down": "w2"}[m[2]], "w"), transposed),
]
