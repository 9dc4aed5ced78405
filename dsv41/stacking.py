"""The per-layer view of the stacked parameters (DESIGN §9).

The model keeps each layer's parameters in its stack: `stacks.{s}.slots.{j}.…` with a leading layers
axis [G, ...] (`plan.layer_stacks`). Everything outside the model speaks per layer — checkpoint files
(`layers.{i}.attn.wq_a.w`), the official and transformers names, a test reading layer 6's indexer — and
goes through the one map here: layer i = (stack s, group g, slot j, run position r) of `plan.layer_slot`;
a slot holding a run of identical layers keeps its leaves [G, R, ...] (`plan.Stack.grid`; slot 0 of a
stack with a lead holds G - 1 groups, `plan.Stack.row`). The Engram
modules sit outside the stacks, `engram.{k}.…` for the k-th Engram layer (`layers.{i}.engram.…`).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from dsv41.plan import engram_layers, layer_stacks

LAYERS = "layers"
ENGRAM = "engram"


@functools.lru_cache(maxsize=32)
def _grids(stacks) -> dict[tuple[int, int], np.ndarray]:
    """{(stack, slot): the layer numbers [G] or [G, R] its leaves' leading axes hold}."""
    return {(s, j): np.asarray(st.grid(j)) for s, st in enumerate(stacks) for j in range(st.slots)}


def layer_path(path: tuple, at: tuple, stacks, engram: tuple = ()) -> tuple:
    """The per-layer path of the leaf at index `at` ((g,) or (g, r)) of a stacked path, or of an Engram
    module's leaf (`engram.{k}.…`, engram: `engram_layers`); other paths unchanged."""
    if path[:1] == (ENGRAM,) and engram:
        return (LAYERS, engram[path[1]], ENGRAM, *path[2:])
    if path[:1] != ("stacks",):
        return path
    s, j = path[1], path[3]
    return (LAYERS, int(_grids(stacks)[(s, j)][at]), *path[4:])


def stacked_axes(path: tuple, stacks) -> int:
    """How many leading layers axes a path's leaves have: 0 (not stacked), 1 ([G]) or 2 ([G, R])."""
    if path[:1] != ("stacks",):
        return 0
    return _grids(stacks)[(path[1], path[3])].ndim


def per_layer(state: nnx.State, cfg) -> list[tuple[tuple, nnx.Variable]]:
    """[(per-layer path, variable)] of a stacked state: a stacked leaf [G, ...] (or [G, R, ...]) gives one
    variable per layer (slices, their `out_sharding` without the layers axes)."""
    stacks, engram = layer_stacks(cfg), engram_layers(cfg)
    out = []
    for path, var in nnx.to_flat_state(state):
        n = stacked_axes(path, stacks)
        if not n:
            out.append((layer_path(path, (), stacks, engram), var))
            continue
        value = var.get_value()
        axes = var.get_metadata().get("out_sharding")
        for at in np.ndindex(*value.shape[:n]):
            one = var.replace(value[at] if not isinstance(value, jax.ShapeDtypeStruct)
                              else jax.ShapeDtypeStruct(value.shape[n:], value.dtype))
            if axes:
                one.set_metadata("out_sharding", tuple(axes[n:]))
            out.append((layer_path(path, at, stacks), one))
    return sorted(out, key=lambda pv: _order(pv[0]))


def _order(path):
    return tuple((0, k) if isinstance(k, int) else (1, str(k)) for k in path)


def layer_dict(state: nnx.State, cfg) -> dict[tuple, object]:
    """{per-layer path: array} of a stacked state."""
    return {p: v.get_value() for p, v in per_layer(state, cfg)}


def from_per_layer(values, abstract: nnx.State, cfg, dtype_of=None) -> nnx.State:
    """The stacked state of `abstract`'s structure from `values` {per-layer path: array}: each stacked leaf
    the G layers' arrays stacked (NumPy on the host, then one device array). Every path must be there."""
    stacks, engram = layer_stacks(cfg), engram_layers(cfg)
    flat = []
    for path, var in nnx.to_flat_state(abstract):
        like = var.get_value()
        n = stacked_axes(path, stacks)
        if n:
            grid = like.shape[:n]
            array = np.stack([np.asarray(values[layer_path(path, at, stacks)]) for at in np.ndindex(*grid)])
            array = array.reshape(*grid, *array.shape[1:])
        else:
            array = values[layer_path(path, (), stacks, engram)]
        flat.append((path, var.replace(jax.numpy.asarray(array, dtype=like.dtype))))
    return nnx.from_flat_state(flat)


def _key_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def is_per_layer(tree) -> bool:
    """Whether a saved tree (as orbax restores it without a target) has per-layer paths `layers.{i}.…`."""
    return any("layers" in _key_names(p) and "stacks" not in _key_names(p)
               for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])


def _per_layer_keys(keys: tuple, grids: dict, engram: tuple) -> tuple:
    """(grid, names) of a stacked tree's key path: the per-layer key paths its leaf holds, in the order of
    `grid` (the layer numbers [G] or [G, R] of a stacked leaf; None for a leaf of one layer or of none).
    KeyError: a stack slot `grids` does not have."""
    if "stacks" in keys:
        at = keys.index("stacks")
        grid = grids[(int(keys[at + 1]), int(keys[at + 3]))]
        return grid, [(*keys[:at], LAYERS, str(layer), *keys[at + 4:]) for layer in grid.flat]
    if ENGRAM in keys and engram:
        at = keys.index(ENGRAM)
        return None, [(*keys[:at], LAYERS, str(engram[int(keys[at + 1])]), ENGRAM, *keys[at + 2:])]
    return None, [keys]


def unstacked(tree, cfg, stacks) -> dict | None:
    """{per-layer key names: leaf} of a saved tree stacked in the layout `stacks` (`plan.layer_stacks(cfg,
    leads=False)`: how dsv41 stacked layers before `plan.Stack.lead`), None when a stacked leaf's leading
    axes are not that layout's."""
    grids, engram = _grids(stacks), engram_layers(cfg)
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        try:
            grid, names = _per_layer_keys(_key_names(path), grids, engram)
        except KeyError:
            return None
        if grid is None:
            out[names[0]] = leaf
            continue
        if tuple(np.shape(leaf)[:grid.ndim]) != grid.shape:
            return None
        leaf = np.asarray(leaf)
        out.update(zip(names, (leaf[index] for index in np.ndindex(*grid.shape))))
    return out


def restack(old_tree, abstract_tree, cfg):
    """A tree with per-layer paths (`layers.{i}.…`, as dsv41 saved parameters, optimiser moments and
    buffers before the layer stacks; or such {key names: leaf}, `unstacked`) in the structure of
    `abstract_tree` (stacked): each stacked leaf is its G layers' leaves stacked. Raises ValueError naming a
    path the old tree lacks."""
    old = old_tree if isinstance(old_tree, dict) and all(isinstance(k, tuple) for k in old_tree) else {
        _key_names(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(old_tree)[0]}
    grids, engram = _grids(layer_stacks(cfg)), engram_layers(cfg)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_tree)
    out = []
    for path, like in leaves:
        grid, names = _per_layer_keys(_key_names(path), grids, engram)
        missing = [".".join(n) for n in names if n not in old]
        if missing:
            raise ValueError(f"checkpoint: no {missing[0]}: expected the per-layer tree of this config")
        values = [np.asarray(old[n]) for n in names]
        out.append(values[0] if grid is None else np.stack(values).reshape(*grid.shape, *values[0].shape))
    return jax.tree_util.tree_unflatten(treedef, out)
