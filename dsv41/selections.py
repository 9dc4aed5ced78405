"""Selection replay (DESIGN §10): the routed experts and indexer picks a step used, returned by inference
(`steps.Bound.prefill(..., selections=True)`) and forced on the training forward (`batch["selections"]`), so
that a sampler and its trainer run the same sparse computation and agree on log-probabilities (RL).

A selections value is a dict of three kinds, each {layer number: int32 [B, S, width]} over the same tokens:
  picks     per index source (a Full or Reindex layer; CSA under V4): its top-k entry ids (−1: none), width
            the indexer's top_k;
  pool_ids  per candidate-pool builder: the pool's block ids (ascending, −1: none), width max_blocks;
  experts   per routed MoE layer (not hash-routed): its expert ids, width the MoE's top_k.
Entry ids count the layer's compressed entries from position 0 (entry t covers tokens t·ratio … t·ratio +
ratio − 1), as the cache stores them. `concat` joins the selections of consecutive steps along S.

Forcing keeps the gradients the model has: the gate's weights are the router's scores at the forced experts,
the attention reads the forced entries; only the choices (top-k, pool, top-k experts) are taken as given.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dsv41 import schema
from dsv41.plan import layer_plan

KINDS = ("picks", "pool_ids", "experts")


def widths(cfg) -> dict[str, dict[int, int]]:
    """{kind: {layer: width}}: the layers a selections value of this config holds, and the last axis of each."""
    a = cfg.architecture
    plan = layer_plan(cfg)
    ixc = cfg.v4.indexer if a.family == schema.V4 else cfg.csa2.indexer
    pools = {r.candidate_source for r in plan if r.candidate_source is not None}
    return {"picks": {r.index: ixc.top_k for r in plan if r.index_source == r.index},
            "pool_ids": {i: ixc.hierarchical.max_blocks for i in sorted(pools)} if a.family != schema.V4 else {},
            "experts": {r.index: a.moe.top_k for r in plan if r.index >= a.moe.hash_layers}}


def check(cfg, selections, positions_BS) -> dict:
    """`selections` as NumPy int32 arrays, after checking it against the config and the tokens it covers
    (positions [B, S], row b's token s at positions[b, s]): every kind and layer present, each [B, S, width],
    picks and pool blocks that exist (−1 or an entry/block visible at the token's position: none from its
    future), experts in [0, num_experts). Raises ValueError naming selections[kind][layer]."""
    if not isinstance(selections, dict):
        raise ValueError(f"selections: {type(selections).__name__}: expected a dict with the keys {KINDS}")
    positions = np.asarray(positions_BS)
    b, s = positions.shape
    want = widths(cfg)
    extra = sorted(set(selections) - set(KINDS))
    if extra:
        raise ValueError(f"selections: keys {extra}: expected only {KINDS}")
    plan = layer_plan(cfg)
    out = {}
    for kind in KINDS:
        given = selections.get(kind, {})
        layers = want[kind]
        if set(given) != set(layers):
            raise ValueError(f"selections[{kind!r}]: layers {sorted(given)}: expected {sorted(layers)}")
        out[kind] = {}
        for layer, width in layers.items():
            name = f"selections[{kind!r}][{layer}]"
            arr = np.asarray(given[layer])
            if arr.shape != (b, s, width) or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"{name}: {arr.dtype}{list(arr.shape)}: expected integers [{b}, {s}, {width}]")
            arr = arr.astype(np.int32)
            if kind == "experts":
                bad = (arr < 0) | (arr >= cfg.architecture.moe.num_experts)
                expected = f"expert ids in [0, {cfg.architecture.moe.num_experts})"
            else:
                visible = (positions + 1) // plan[layer].ratio  # entries a token may read
                if kind == "pool_ids":
                    block = cfg.csa2.indexer.hierarchical.positions_per_block
                    visible = -(-visible // block)
                bad = (arr < -1) | (arr >= visible[..., None])
                expected = "−1 or an id below the token's visible count (no entry from its future)"
            if bad.any():
                at = tuple(int(i) for i in np.argwhere(bad)[0])
                raise ValueError(f"{name}: {int(arr[at])} at {list(at)}: expected {expected}")
            out[kind][layer] = arr
    return out


def flat(record: dict) -> dict:
    """{leaf name: array} of one layer's nested record of sown values (the names are unique within a layer)."""
    out = {}
    for key, value in record.items():
        out.update(flat(value) if isinstance(value, dict) else {key: value})
    return out


def concat(parts: list[dict]) -> dict:
    """The selections of consecutive steps (each over [B, S_i] tokens of the same rows) as one over Σ S_i."""
    if not parts:
        raise ValueError("selections.concat: no parts: expected at least one selections value")
    return {kind: {layer: np.concatenate([np.asarray(p[kind][layer]) for p in parts], axis=1)
                   for layer in parts[0][kind]} for kind in KINDS}


def stacked(selections: dict, num_layers: int) -> dict:
    """{kind: (values [n, B, S, width], rows int32 [num_layers])} of a (checked) selections value: a kind's
    layers stacked in layer order, rows[i] = its row of layer i (−1: none), so a layer scanned under a traced
    number finds its own (`of_layer`)."""
    out = {}
    for kind in KINDS:
        layers = sorted(selections.get(kind, {}))
        if not layers:
            continue
        rows = np.full((num_layers,), -1, np.int32)
        rows[layers] = np.arange(len(layers), dtype=np.int32)
        out[kind] = (jnp.stack([selections[kind][i] for i in layers]), rows)
    return out


def of_layer(forced: dict | None, kind: str, layer, layers: tuple):
    """Layer `layer`'s forced [B, S, width] of `kind` (None when none is forced for it). layer: an int, or a
    traced number taking one of `layers` (a scanned slot's): those layers hold the kind all or none."""
    if not forced or kind not in forced:
        return None
    values, rows = forced[kind]
    if isinstance(layer, int):
        return None if rows[layer] < 0 else values[int(rows[layer])]
    have = {int(rows[i]) >= 0 for i in layers}
    if have != {True}:
        if have == {False}:
            return None
        raise ValueError(f"selections[{kind!r}]: layers {sorted(layers)} of one stacked slot: expected all or none")
    return values[jnp.asarray(rows)[layer]]
