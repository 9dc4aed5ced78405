"""What the V4.1 port and the released V4 transformers checkpoints share (DESIGN §11): the checks and
`architecture` fields of their configs, and the transpose of their [out, in] weights to dsv41's [in, out].

`transformers_io` (the V4.1 port) and `transformers_v4` (the released V4) both build on these.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from dsv41.errors import ConfigError


def require(c: Mapping, key: str, allowed, why: str):
    """Raises ConfigError unless `c[key]` (default `allowed[0]`) is one of `allowed`; `why` says what dsv41 builds."""
    value = c.get(key, allowed[0])
    if value not in allowed:
        raise ConfigError(key, value, f"expected {allowed[0]!r}: {why}")


def common_architecture(c: Mapping, family: str) -> dict:
    """The `architecture` block fields shared by V4 and V4.1 transformers configs."""
    require(c, "num_key_value_heads", (1,), "one shared KV latent (MQA)")
    require(c, "hidden_act", ("silu",), "SwiGLU experts")
    require(c, "scoring_func", ("sqrtsoftplus",), "sqrt-softplus router scores")
    require(c, "norm_topk_prob", (True,), "normalised top-k routing weights")
    require(c, "attention_bias", (False,), "bias-free projections")
    require(c, "gate_temp", (1.0, 1), "no router temperature")
    rope = c["rope_parameters"]
    main, comp = rope["main"], rope["compress"]
    head_dim = c["head_dim"]
    rope_dim = c.get("qk_rope_head_dim") or int(round(head_dim * main.get("partial_rotary_factor", 1.0)))
    if main.get("rope_type", "default") != "default":
        raise ConfigError("rope_parameters.main.rope_type", main["rope_type"],
                          "expected 'default': the window-only layers' RoPE is plain")
    comp_type = comp.get("rope_type", "default")
    if comp_type not in ("yarn", "default"):
        raise ConfigError("rope_parameters.compress.rope_type", comp_type, "expected 'yarn' or 'default'")
    if comp.get("attention_factor", 1.0) != 1.0:
        raise ConfigError("rope_parameters.compress.attention_factor", comp["attention_factor"],
                          "expected 1.0 (the reference does not scale cos/sin)")
    # Plain RoPE ("default") has no YaRN fields: the schema's stay, unused.
    yarn = {} if comp_type == "default" else {
        "yarn_factor": comp["factor"],
        "yarn_original_max_position": comp["original_max_position_embeddings"],
        "yarn_beta_fast": comp.get("beta_fast") or 32.0,
        "yarn_beta_slow": comp.get("beta_slow") or 1.0,
    }
    return {
        "family": family,
        "vocab_size": c["vocab_size"],
        "hidden_size": c["hidden_size"],
        "num_heads": c["num_attention_heads"],
        "head_dim": head_dim,
        "rope_head_dim": rope_dim,
        "q_lora_rank": c["q_lora_rank"],
        "o_groups": c["o_groups"],
        "o_lora_rank": c["o_lora_rank"],
        "norm_eps": c["rms_norm_eps"],
        "initializer_range": c.get("initializer_range", 0.02),
        "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
        "rope": {
            "theta": main["rope_theta"],
            "compressed_theta": comp["rope_theta"],
            "compressed_rope_type": comp_type,
            **yarn,
            "max_position": c["max_position_embeddings"],
        },
        "moe": {
            "num_experts": c["n_routed_experts"],
            "top_k": c["num_experts_per_tok"],
            "num_shared_experts": c.get("n_shared_experts", 1),
            "intermediate_size": c["moe_intermediate_size"],
            "score_func": "sqrtsoftplus",
            "route_scale": c["routed_scaling_factor"],
            "swiglu_limit": c["swiglu_limit"],
        },
        "mhc": {"streams": c["hc_mult"], "sinkhorn_iters": c["hc_sinkhorn_iters"], "eps": c["hc_eps"]},
    }


def transposed(x):
    """A weight [out, in] as dsv41 stores it, [in, out] (contiguous)."""
    return np.ascontiguousarray(x.T)
