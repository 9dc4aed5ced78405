"""The per-layer view of the stacked parameters (DESIGN §9).

The model keeps each layer's parameters in its stack: `stacks.{s}.slots.{j}.…` with a leading layers
axis [G, ...] (`plan.layer_stacks`). Everything outside the model speaks per layer — checkpoint files
(`layers.{i}.attn.wq_a.w`), the official and transformers names, a test reading layer 6's indexer — and
goes through the one map here: layer i = (stack s, group g, slot j) of `plan.layer_slot`.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from dsv41.plan import layer_stacks

LAYERS = "layers"


@functools.lru_cache(maxsize=32)
def _maps(stacks) -> tuple[dict, dict]:
    to_layer, to_stack = {}, {}
    for s, st in enumerate(stacks):
        for g, group in enumerate(st.layers):
            for j, i in enumerate(group):
                to_layer[(s, j, g)] = i
                to_stack[i] = (s, g, j)
    return to_layer, to_stack


def layer_path(path: tuple, g: int, stacks) -> tuple:
    """The per-layer path of group g of a stacked path (other paths unchanged)."""
    if path[:1] != ("stacks",):
        return path
    s, j = path[1], path[3]
    return (LAYERS, _maps(stacks)[0][(s, j, g)], *path[4:])


def per_layer(state: nnx.State, cfg) -> list[tuple[tuple, nnx.Variable]]:
    """[(per-layer path, variable)] of a stacked state: a stacked leaf [G, ...] gives G variables, one per
    layer (slices, their `out_sharding` without the layers axis)."""
    stacks = layer_stacks(cfg)
    out = []
    for path, var in nnx.to_flat_state(state):
        if path[:1] != ("stacks",):
            out.append((path, var))
            continue
        value = var.get_value()
        axes = var.get_metadata().get("out_sharding")
        for g in range(value.shape[0]):
            one = var.replace(value[g] if not isinstance(value, jax.ShapeDtypeStruct)
                              else jax.ShapeDtypeStruct(value.shape[1:], value.dtype))
            if axes:
                one.set_metadata("out_sharding", tuple(axes[1:]))
            out.append((layer_path(path, g, stacks), one))
    return sorted(out, key=lambda pv: _order(pv[0]))


def _order(path):
    return tuple((0, k) if isinstance(k, int) else (1, str(k)) for k in path)


def layer_dict(state: nnx.State, cfg) -> dict[tuple, object]:
    """{per-layer path: array} of a stacked state."""
    return {p: v.get_value() for p, v in per_layer(state, cfg)}


def from_per_layer(values, abstract: nnx.State, cfg, dtype_of=None) -> nnx.State:
    """The stacked state of `abstract`'s structure from `values` {per-layer path: array}: each stacked leaf
    the G layers' arrays stacked (NumPy on the host, then one device array). Every path must be there."""
    stacks = layer_stacks(cfg)
    flat = []
    for path, var in nnx.to_flat_state(abstract):
        like = var.get_value()
        if path[:1] == ("stacks",):
            array = np.stack([np.asarray(values[layer_path(path, g, stacks)]) for g in range(like.shape[0])])
        else:
            array = values[path]
        flat.append((path, var.replace(jax.numpy.asarray(array, dtype=like.dtype))))
    return nnx.from_flat_state(flat)


def _key_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def is_per_layer(tree) -> bool:
    """Whether a saved tree (as orbax restores it without a target) has per-layer paths `layers.{i}.…`."""
    return any("layers" in _key_names(p) and "stacks" not in _key_names(p)
               for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])


def restack(old_tree, abstract_tree, cfg):
    """A tree with per-layer paths (`layers.{i}.…`, as dsv41 saved parameters, optimiser moments and
    buffers before the layer stacks) in the structure of `abstract_tree` (stacked): each stacked leaf is its
    G layers' leaves stacked. Raises ValueError naming a path the old tree lacks."""
    old = {_key_names(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(old_tree)[0]}
    maps = _maps(layer_stacks(cfg))[0]
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_tree)
    out = []
    for path, like in leaves:
        keys = _key_names(path)
        if "stacks" in keys:
            at = keys.index("stacks")
            s, j = int(keys[at + 1]), int(keys[at + 3])
            groups = like.shape[0]
            names = [(*keys[:at], LAYERS, str(maps[(s, j, g)]), *keys[at + 4:]) for g in range(groups)]
        else:
            names = [keys]
        missing = [".".join(n) for n in names if n not in old]
        if missing:
            raise ValueError(f"checkpoint: no {missing[0]}: expected the per-layer tree of this config")
        values = [np.asarray(old[n]) for n in names]
        out.append(np.stack(values) if "stacks" in keys else values[0])
    return jax.tree_util.tree_unflatten(treedef, out)
