"""Parameter counts by component, from shapes only (`jax.eval_shape`: no memory at full size)."""

from __future__ import annotations

import math

from flax import nnx

from dsv41.plan import layer_plan

# Published sizes (DESIGN §1-2) to report our counts against.
PUBLISHED = {
    "DeepSeek-V4.1-Flash": {"backbone": 552e9, "engram_tables": 196e9},
    "DeepSeek-V4-Flash": {"total": 284e9},
}

COMPONENTS = ("embeddings", "attention", "compressor", "indexer", "mhc", "norms", "router", "moe_shared",
              "moe_routed", "engram_tables", "engram_other", "other")


def component(path: tuple) -> str:
    """The component a parameter path belongs to."""
    names = [p for p in path if isinstance(p, str)]
    if names[0] in ("embed", "head"):
        return "embeddings"
    if names[0] == "norm" or (len(names) == 3 and names[1].endswith("_norm")):  # final, attn_ and ffn_ norms
        return "norms"
    if "engram" in names:
        return "engram_tables" if names[-1] == "table" else "engram_other"
    if any(n.startswith("hc_") for n in names):
        return "mhc"
    if "compressor" in names:
        return "compressor"
    if "indexer" in names:
        return "indexer"
    if "attn" in names:
        return "attention"
    if "ffn" in names:
        if "shared" in names:
            return "moe_shared"
        if names[-1] in ("w1", "w2", "w3"):
            return "moe_routed"
        return "router"
    return "other"


def count_params(cfg) -> dict:
    """{"components": {name: count}, "total", "backbone" (all but Engram tables), "active_per_token"}.

    active_per_token: parameters one generated token multiplies with — everything but the Engram
    tables (a few rows are gathered), the embedding table (one row) and the routed experts it was not
    sent to (top_k of num_experts).
    """
    from dsv41 import model as model_lib

    abstract = model_lib.abstract_params(cfg)
    counts = {c: 0 for c in COMPONENTS}
    for path, var in nnx.to_flat_state(abstract):
        names = tuple(k for k in path if isinstance(k, str))
        per_layer = ("layers", *names[2:]) if names[:2] == ("stacks", "slots") else names  # a stack's paths
        counts[component(per_layer)] += math.prod(var.get_value().shape)
    total = sum(counts.values())
    moe = cfg.architecture.moe
    a = cfg.architecture
    active = (total - counts["engram_tables"] - a.vocab_size * a.hidden_size
              - counts["moe_routed"] * (1 - moe.top_k / moe.num_experts))
    return {
        "model": cfg.model,
        "layers": len(layer_plan(cfg)),
        "components": {k: v for k, v in counts.items() if v},
        "total": total,
        "backbone": total - counts["engram_tables"],
        "engram_tables": counts["engram_tables"],
        "active_per_token": int(active),
        "published": PUBLISHED.get(cfg.model, {}),
    }
