"""Sharding (DESIGN §9): a mesh with named axes, logical axis names resolved to mesh axes by a rules table.

Every parameter carries logical axis names (`out_sharding` metadata, see `dsv41.nn.linear.param`);
the cache leaves' names are defined here (`CACHE_AXES`). A rules table maps each logical name to a
tuple of mesh axes; resolving one array's names walks its dimensions in order and gives each the mesh
axes of its rule that are still unused in that array (so a weight [experts, embed, mlp] under FSDP
rules gets experts → expert and embed → data, not expert twice). Mesh axes of size 1 are dropped.

Presets:
- `serve`: data-parallel attention, expert-parallel MoE. Activations and the cache are split over
  batch rows on every mesh axis; the single shared KV head (`kv`) is never split, since a tensor-split
  MQA head would have to be copied to every tensor rank anyway. Routed experts are split over
  `expert` and their intermediate width over `tensor`; everything else is replicated.
- `train`: FSDP over data × expert × context (weights split on their model width, Engram tables on
  their row width), experts over `expert`, heads and intermediate widths over `tensor`, rows over data
  × expert and each row's tokens over `context` (sequence parallel: `attend.SequenceLayout`; the
  whole-sequence forward, its gradient and the train step).

The sharded steps are jax.jit of the same bodies as `dsv41.model` / `dsv41.steps` (`forward_body`,
`step_body`) with explicit in/out shardings and the cache donated, traced with the MoE layers
expert-parallel (the model built with the rules' `expert_layout`, `lowering_for`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from dsv41 import model as model_lib
from dsv41 import steps as steps_lib
from dsv41 import xla_options
from dsv41.cache import Cache, CompressedKV, abstract_cache, host_view, with_mirror
from dsv41.errors import ConfigError
from dsv41.nn import moe as moe_lib
from dsv41.nn import policy as policy_lib
from dsv41.nn.attend import SequenceLayout
from dsv41.nn.policy import Lowering
from dsv41.plan import engram_layers

log = logging.getLogger(__name__)

MESH_AXES = ("data", "expert", "tensor", "context")

# The cache leaves' logical axes (the parameters carry theirs; see dsv41.cache for the layouts).
CACHE_AXES = {
    "lengths": ("batch",),
    "window": ("layers", "batch", "window", "kv"),
    "window_scales": ("layers", "batch", "window", "kv_scales"),
    "window_start": ("layers", "batch"),
    "recent_tokens": ("batch", "ngram"),
}
COMPRESSED_AXES = {  # each leaf stacked over its stack's groups (dsv41.cache.store_slots)
    "entries": ("layers", "batch", "cache_seq", "kv"),
    "entry_scales": ("layers", "batch", "cache_seq", "kv_scales"),
    "index_keys": ("layers", "batch", "cache_seq", "index_dim"),
    "index_scales": ("layers", "batch", "cache_seq", "index_scales"),
    "leftover": ("layers", "batch", "group", "kv"),
    "index_leftover": ("layers", "batch", "group", "index_dim"),
}

# Every logical name the model and cache use; () = replicated. A name missing from a table is an error
# (a typo would otherwise replicate silently).
_REPLICATED = ("layers", "window", "kv", "kv_scales", "ngram", "cache_seq", "index_scales", "group",
               "hc_mix", "hc_embed", "heads", "q_heads", "q_lora", "o_groups", "o_in", "o_lora", "o_proj",
               "index_heads", "index_dim", "engram_dim", "engram_in", "embed", "vocab", "mlp", "experts",
               "engram_rows", "batch", "length")
SERVE = {**{name: () for name in _REPLICATED},
         "batch": ("data", "expert", "tensor"),
         "experts": ("expert",),
         "mlp": ("tensor",),
         "vocab": ("tensor",),
         # Engram tables (DESIGN §3.7, ~196B parameters at full size) hold prime row counts; they are not
         # split evenly, so a serving deployment keeps them in host memory (see compile_report).
         "engram_rows": ()}
_FSDP = ("data", "expert", "context")  # the parameters' model widths over every axis that splits tokens
TRAIN = {**{name: () for name in _REPLICATED},
         "batch": ("data", "expert"),
         "experts": ("expert",),
         "embed": _FSDP,
         "q_lora": _FSDP,
         "o_in": _FSDP,
         "o_proj": _FSDP,
         "hc_embed": _FSDP,
         "engram_in": _FSDP,
         "engram_dim": _FSDP,
         "vocab": ("tensor",),
         "mlp": ("tensor",),
         "heads": ("tensor",),
         "q_heads": ("tensor",),
         "o_groups": ("tensor",),
         "index_heads": ("tensor",),
         "length": ("context",)}
# Long rows (`train_long`): the expert axis splits each row's tokens instead of the rows, as MaxText's
# `expert_shard_attention_option: context` does: rows over data only, tokens over expert × context; the routed
# experts still split over `expert` (each expert group gathers the tokens of its row span). A step then needs
# only `data` rows, and each chip holds fewer tokens: V4.1-Flash at 8 rows of 64K on v5p:8x8x8 (data 8 ×
# expert 8 × context 8) asks 59.6 GiB of temporaries a chip, against 140.3 GiB for 64 rows under `train` (README).
TRAIN_LONG = {**TRAIN, "batch": ("data",), "length": ("expert", "context")}
PRESETS = {"serve": SERVE, "train": TRAIN, "train_long": TRAIN_LONG}


def rules_for(rules) -> dict:
    """A rules table from a preset name or a mapping (logical name -> mesh axes)."""
    if isinstance(rules, str):
        if rules not in PRESETS:
            raise ConfigError("rules", rules, f"expected one of {sorted(PRESETS)} or a mapping")
        return PRESETS[rules]
    return dict(rules)


def make_mesh(shape: Mapping[str, int], devices=None) -> Mesh:
    """A mesh with axes data, expert, tensor, context (missing ones get size 1), e.g.
    make_mesh({"data": 2, "expert": 4}) or make_mesh({"data": 2, "context": 4}).

    The axis types are given explicitly (Auto: shardings propagate from the in/out shardings) because
    their default changed between jax releases.
    """
    for name, size in shape.items():
        if name not in MESH_AXES:
            raise ConfigError("mesh", name, f"expected a mesh axis among {MESH_AXES}")
        if not isinstance(size, int) or size < 1:
            raise ConfigError(f"mesh.{name}", size, "expected a positive integer")
    sizes = tuple(shape.get(name, 1) for name in MESH_AXES)
    devices = jax.devices() if devices is None else list(devices)
    if math.prod(sizes) != len(devices):
        raise ConfigError("mesh", dict(shape), f"expected axis sizes whose product is the {len(devices)} devices")
    mesh = jax.make_mesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)
    compile_fresh(mesh)
    return mesh


def parse_mesh(text: str) -> dict[str, int]:
    """'data=2,expert=4' -> {"data": 2, "expert": 4}."""
    out = {}
    for part in filter(None, text.split(",")):
        name, _, size = part.partition("=")
        if not size.isdigit():
            raise ConfigError("mesh", text, "expected axis=size pairs such as 'data=2,expert=4'")
        out[name.strip()] = int(size)
    return out


def logical_spec(axes, shape, mesh: Mesh, rules, *, what: str, strict: bool = False) -> P:
    """PartitionSpec of one array from its logical axis names.

    A mesh axis that does not divide its dimension is skipped (strict=False, parameters: e.g. an odd
    vocabulary stays whole) or is an error (strict=True: batch rows must split evenly).
    """
    rules = rules_for(rules)
    if len(axes) != len(shape):
        raise ValueError(f"{what}: logical axes {axes} for shape {tuple(shape)}: expected one name per dimension")
    used, spec = set(), []
    for name, size in zip(axes, shape):
        if name is not None and name not in rules:
            raise ConfigError(f"{what} logical axis", name, f"expected a name of the rules table {sorted(rules)}")
        picked = []
        for m in rules.get(name, ()) if name is not None else ():
            n = mesh.shape.get(m, 1)
            if m in used or n == 1:
                continue
            if size % (math.prod(mesh.shape[p] for p in picked) * n):
                if strict:
                    raise ConfigError(f"{what} ({name})", size,
                                      f"expected a multiple of {math.prod(mesh.shape[p] for p in picked) * n} "
                                      f"(mesh axes {'×'.join(picked + [m])})")
                continue
            picked.append(m)
        used.update(picked)
        spec.append(None if not picked else picked[0] if len(picked) == 1 else tuple(picked))
    return P(*spec)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _path(path) -> str:
    return "params/" + "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def param_shardings(cfg, mesh: Mesh, rules="serve", abstract=None, *, engram_host: bool = False) -> nnx.State:
    """NamedSharding per parameter (an nnx.State shaped like `init_params(cfg, ...)`), from its logical axes;
    engram_host: the Engram tables in host memory, their rows split over the mesh (`engram_table_sharding`)."""
    abstract = model_lib.abstract_params(cfg) if abstract is None else abstract

    def one(path, v):
        shape = v.get_value().shape
        if engram_host and engram_table_index(path) is not None:
            return v.replace(engram_table_sharding(mesh, shape[0])[1])
        axes = v.get_metadata().get("out_sharding") or (None,) * len(shape)
        return v.replace(NamedSharding(mesh, logical_spec(axes, shape, mesh, rules, what=_path(path))))

    return jax.tree_util.tree_map_with_path(one, abstract, is_leaf=_is_var)


def cache_shardings(cfg, mesh: Mesh, rules="serve", *, batch: int, max_len: int) -> Cache:
    """NamedSharding per cache leaf (a Cache of shardings), from CACHE_AXES / COMPRESSED_AXES."""
    shapes = abstract_cache(cfg, batch, max_len)
    spec = lambda axes, x, what: NamedSharding(mesh, logical_spec(axes, x.shape, mesh, rules, what=what, strict=True))
    compressed = tuple(CompressedKV(**{f: spec(COMPRESSED_AXES[f], getattr(c, f), f"cache.compressed[{i}].{f}")
                                       for f in COMPRESSED_AXES})
                       for i, c in enumerate(shapes.compressed))
    top = {f: (tuple(spec(CACHE_AXES[f], x, f"cache.{f}[{i}]") for i, x in enumerate(getattr(shapes, f)))
               if f in ("window", "window_scales") else spec(CACHE_AXES[f], getattr(shapes, f), f"cache.{f}"))
           for f in CACHE_AXES}
    return Cache(compressed=compressed, **top)


def batch_sharding(mesh: Mesh, rules, shape, what: str) -> NamedSharding:
    """Inputs split over rows only: [B, ...] -> P(batch axes, None, ...)."""
    axes = ("batch",) + (None,) * (len(shape) - 1)
    return NamedSharding(mesh, logical_spec(axes, shape, mesh, rules, what=what, strict=True))


def sequence_sharding(mesh: Mesh, rules, shape, what: str) -> NamedSharding:
    """A whole sequence's inputs [B, S, ...]: rows over the batch axes, tokens over the length axes (the
    rules' sequence parallelism; none under `serve`); [B] over the batch axes."""
    axes = ("batch", "length")[:len(shape)] + (None,) * (len(shape) - 2)
    return NamedSharding(mesh, logical_spec(axes, shape, mesh, rules, what=what, strict=True))


def _live(mesh: Mesh, rules, name: str) -> tuple[str, ...]:
    return tuple(a for a in rules_for(rules).get(name, ()) if mesh.shape.get(a, 1) > 1)


def sequence_layout(mesh: Mesh, rules) -> SequenceLayout | None:
    """The rules' sequence parallelism on `mesh`: tokens over the "length" mesh axes (None when they are all
    of size 1)."""
    seq, rows = _live(mesh, rules, "length"), _live(mesh, rules, "batch")
    if not seq:
        return None
    if set(seq) & set(rows):
        raise ConfigError("rules length", seq, f"expected mesh axes apart from the batch's {rows}")
    return SequenceLayout(mesh, rows, seq)


def expert_layout(cfg, mesh: Mesh, rules="serve", *, sequence: bool = False) -> moe_lib.ExpertLayout:
    """The routed experts' layout under the rules: token rows over the "batch" mesh axes (then, sequence
    parallel, over the "length" axes: the [B·S] tokens of a whole sequence), and the experts and intermediate
    width of the routed weights [experts, embed, mlp] over the mesh axes their parameter sharding gives them
    (the embed split of FSDP rules is gathered on entry to the shard_map)."""
    rules = rules_for(rules)
    a, m = cfg.architecture, cfg.architecture.moe
    spec = logical_spec(("experts", "embed", "mlp"), (m.num_experts, a.hidden_size, m.intermediate_size), mesh,
                        rules, what="routed experts")
    names = lambda s: () if s is None else (s,) if isinstance(s, str) else tuple(s)
    seq = _live(mesh, rules, "length") if sequence else ()
    return moe_lib.ExpertLayout(mesh, _live(mesh, rules, "batch"), names(spec[0]), names(spec[2]), seq)


@dataclasses.dataclass(frozen=True)
class WeightUse:
    """Weights as the whole-sequence forward's matmuls read them (`Lowering.weights`): split only over the mesh
    axes that do not split tokens (tensor parallel), i.e. FSDP weights gathered where they are used — inside
    the layer scan, one layer group's at a time. Left to itself, XLA's partitioner gathered the activations
    instead for some of them (the full-size train step held [B, S, 5120] arrays of every row and token on
    each chip; docs/training_memory.md)."""
    mesh: Mesh
    rules_items: tuple

    def at_use(self, w, axes):
        spec = logical_spec(axes, w.shape, self.mesh, dict(self.rules_items), what="weight at use")
        return jax.lax.with_sharding_constraint(w, NamedSharding(self.mesh, spec))


def weight_use(mesh: Mesh, rules) -> WeightUse:
    """The rules' weights at use: each logical name keeps its mesh axes except those splitting tokens (the
    "batch" and "length" axes)."""
    rules = rules_for(rules)
    tokens = set(_live(mesh, rules, "batch")) | set(_live(mesh, rules, "length"))
    return WeightUse(mesh, rules_key({name: tuple(a for a in axes if a not in tokens) for name, axes in rules.items()}))


def lowering_for(cfg, mesh: Mesh, rules, *, flop_counting: bool = False, sequence: bool = False) -> Lowering:
    """How the steps are traced on `mesh`: the routed experts expert-parallel as the rules lay them out (and
    the Pallas kernels per device); flop_counting: experts per pick and the indexer's head loop unrolled, as
    `policy.FLOP_COUNTING` (what XLA's cost analysis counts as computed); sequence: a whole-sequence forward,
    sequence parallel where the rules split "length" (`sequence_layout`), its weights gathered at use
    (`weight_use`)."""
    base = policy_lib.FLOP_COUNTING if flop_counting else Lowering()
    return dataclasses.replace(base, layout=expert_layout(cfg, mesh, rules, sequence=sequence),
                               sequence=sequence_layout(mesh, rules) if sequence else None,
                               weights=weight_use(mesh, rules) if sequence else None)


def put(x, sharding: NamedSharding):
    """A global array from a host value every process holds in full (works on one host and on many)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def to_host(x) -> np.ndarray:
    """The full value of a (possibly multi-process) global array on every host."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def simulated(mesh: Mesh) -> bool:
    """Whether `mesh` is several XLA:CPU devices of this process (`--xla_force_host_platform_device_count`)."""
    devices = mesh.devices
    return devices.size > 1 and devices.flat[0].platform == "cpu"


def compile_fresh(mesh: Mesh) -> None:
    """Turns JAX's persistent compilation cache off for the rest of the process when `mesh` is simulated
    (`simulated`), and says so once (a warning). `make_mesh` and the sharded programs' builders call it.

    jaxlib 0.10.2's XLA:CPU loses, in a program it loads from the cache, the order it keeps among the
    program's collectives: one device can enter a loop that holds a collective while the others wait in an
    independent collective before it, and the rendezvous aborts the process. Reproduced with `serve --mesh
    data=2,expert=4`'s warm-up on 8 devices (docs/simulated_devices.md): loaded from the cache, 2 runs in 2
    aborted by their 3rd warm-up (7 devices in an all-gather, the 8th in the indexer loop's); compiled, none
    of 110 warm-ups did. (The indexer loop holds no collective now, `indexer.RowSplit`; the scans still do.)"""
    if not simulated(mesh) or not (jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir):
        return
    from dsv41 import compile_cache

    compile_cache.disable()
    log.warning("compile cache off: programs on %d simulated CPU devices are compiled, never loaded from the "
                "cache (XLA:CPU can deadlock in the collectives of a loaded one)", mesh.devices.size)


def one_at_a_time(mesh: Mesh, out):
    """`out`, waited for when `mesh` is several XLA:CPU devices of this process (simulated devices); at once
    elsewhere. Every sharded program here leaves through it, so on such a mesh only one is in flight.

    XLA:CPU runs every device of a program on one thread pool, and a collective holds its thread until all
    the program's devices arrive. Programs in flight (a step and the sampling of its logits, a row's put and
    the next step) can hold enough of the pool that a device still to come finds no thread. On 8 threads,
    1,000 pairs of programs with collectives (the second on the first's output) dispatched without waiting
    aborted 6 runs in 6; waiting after each, none in 8 (tests/test_distributed.py runs that loop through this
    function). The CI aborts of `serve --mesh` had another cause (`compile_fresh`, `indexer.RowSplit`)."""
    if simulated(mesh):
        jax.block_until_ready(out)
    return out


def shard_params(params, cfg, mesh: Mesh, rules="serve", *, engram_host: bool = False):
    """Places existing parameters (e.g. loaded from a checkpoint) as the rules say. engram_host: the Engram
    tables go to host memory instead, each chip's host holding its share of the rows (`engram_table_sharding`;
    the full-size tables, 196B parameters, fit no HBM); `prefill`/`decode` then gather the rows there."""
    if not engram_host:
        return one_at_a_time(mesh, jax.device_put(params, param_shardings(cfg, mesh, rules)))

    shardings = param_shardings(cfg, mesh, rules, engram_host=True)

    def place(path, v, s):
        if engram_table_index(path) is None:
            return v.replace(jax.device_put(v.get_value(), s.get_value()))
        x = v.get_value()
        rows, sharding = engram_table_sharding(mesh, x.shape[0])[0], s.get_value()

        def share(index):  # each chip's rows, built from its slice of the table (no padded copy of the whole)
            lo, hi, _ = index[0].indices(rows)
            part = np.asarray(x[min(lo, x.shape[0]):min(hi, x.shape[0])])
            return np.concatenate([part, np.zeros((hi - lo - part.shape[0], *x.shape[1:]), part.dtype)])

        return v.replace(jax.make_array_from_callback((rows, *x.shape[1:]), sharding, share))

    return one_at_a_time(mesh, jax.tree_util.tree_map_with_path(place, params, shardings, is_leaf=_is_var))


def engram_on_host(params) -> bool:
    """Whether the parameters keep their Engram tables in host memory (`shard_params(..., engram_host=True)`);
    it looks at the `engram` modules only (every prefill and decode call asks)."""
    if "engram" not in params:
        return False
    return any(getattr(getattr(x, "sharding", None), "memory_kind", None) == "pinned_host"
               for x in jax.tree.leaves(params["engram"]))


def engram_table_index(path) -> int | None:
    """k for the parameter path of the k-th Engram module's table (`engram.{k}.table`) or of its row scales
    (`engram.{k}.table_scale`, held as shipped), else None."""
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
    return (int(keys[1]) if len(keys) == 3 and keys[0] == "engram" and keys[2] in ("table", "table_scale")
            else None)


def shard_cache(cache: Cache, cfg, mesh: Mesh, rules="serve") -> Cache:
    b, cap = cache.lengths.shape[0], steps_lib.capacity(cfg, cache)
    return one_at_a_time(mesh, jax.device_put(cache, cache_shardings(cfg, mesh, rules, batch=b,
                                                                     max_len=min(cap, cfg.context_window))))


def rules_key(rules) -> tuple:
    """A rules table (preset name or mapping) as a hashable value, for caches keyed by the rules."""
    return tuple(sorted((k, tuple(v)) for k, v in rules_for(rules).items()))


@functools.lru_cache(maxsize=32)
def _jitted(kind: str, key: str, mesh: Mesh, rules_items: tuple, shapes: tuple):
    """The jitted sharded function of one kind, config, mesh and rules (`rules_key`; shapes: the batch inputs'
    shapes)."""
    compile_fresh(mesh)
    cfg, rules = model_lib.config_from_key(key), dict(rules_items)
    ps = param_shardings(cfg, mesh, rules)
    rep = NamedSharding(mesh, P())
    options = xla_options.compiler_options(mesh.devices.flat[0].platform)
    if kind == "init":
        return jax.jit(lambda k: model_lib.init_params(cfg, k), out_shardings=ps, compiler_options=options)
    tokens_shape, ids_shape = shapes[0], shapes[1]
    if kind in ("forward", "grad"):
        tok = sequence_sharding(mesh, rules, tokens_shape, "tokens")
        ids = None if ids_shape is None else sequence_sharding(mesh, rules, ids_shape, "engram_ids")
        body = functools.partial(model_lib.forward_body, key, lowering_for(cfg, mesh, rules, sequence=True))
        logits = NamedSharding(mesh, logical_spec(("batch", "length", "vocab"),
                                                  (*tokens_shape, cfg.architecture.vocab_size), mesh, rules,
                                                  what="logits"))
        if kind == "forward":
            return jax.jit(lambda p, t, pos, i: body(p, t, pos, i, False),
                           in_shardings=(ps, tok, tok, ids), out_shardings=logits, compiler_options=options)

        def loss(p, t, pos, i):
            return next_token_loss(body(p, t, pos, i, False), t)

        return jax.jit(jax.value_and_grad(loss), in_shardings=(ps, tok, tok, ids), out_shardings=(rep, ps),
                       compiler_options=options)
    return step_function(cfg, mesh, rules, tokens_shape=tokens_shape, ids_shape=ids_shape, max_len=shapes[2],
                         engram_host=kind == "step_engram_host")


def step_function(cfg, mesh: Mesh, rules="serve", *, tokens_shape, ids_shape=None, max_len: int,
                  params_shardings=None, engram_host: bool = False, flop_counting: bool = False):
    """The jitted sharded `dsv41.steps.step_body` (prefill chunk / decode step):
    (params, cache, tokens [B, S], counts [B], engram ids [B, S, L, C] | None) -> (logits [B, V], cache),
    the cache donated and returned in its rule shardings. engram_host: the Engram tables in host memory, split
    over the mesh (`param_shardings(..., engram_host=True)`), their rows gathered there (`gather_engram_rows`).
    params_shardings overrides the parameters' shardings."""
    compile_fresh(mesh)
    key = model_lib.config_key(cfg)
    ps = param_shardings(cfg, mesh, rules, engram_host=engram_host) if params_shardings is None else params_shardings
    b = tokens_shape[0]
    tok = batch_sharding(mesh, rules, tokens_shape, "tokens")
    ids = None if ids_shape is None else batch_sharding(mesh, rules, ids_shape, "engram_ids")
    cs = cache_shardings(cfg, mesh, rules, batch=b, max_len=max_len)
    rows = batch_sharding(mesh, rules, (b,), "lengths")
    logits = NamedSharding(mesh, logical_spec(("batch", "vocab"), (b, cfg.architecture.vocab_size), mesh, rules,
                                              what="logits"))
    step = functools.partial(steps_lib.step_body, key, lowering_for(cfg, mesh, rules, flop_counting=flop_counting))
    tables = len(engram_layers(cfg)) if engram_host else 0
    table_specs = [ps["engram"][k]["table"].get_value().spec for k in range(tables)]

    def body(params, cache, tokens_BS, counts_B, ids_BSLC):
        if engram_host and ids_BSLC is not None:
            params, ids_BSLC = gather_engram_rows(params, ids_BSLC, table_specs, mesh)
        return step(params, cache, tokens_BS, counts_B, ids_BSLC)

    return jax.jit(body, in_shardings=(ps, cs, tok, rows, ids), out_shardings=(logits, cs), donate_argnums=1,
                   compiler_options=xla_options.compiler_options(mesh.devices.flat[0].platform))


def gather_engram_rows(params, ids_BSLC, table_specs=None, mesh: Mesh | None = None):
    """Engram lookups from tables kept in host memory (DESIGN §3.7: ~196B parameters at full size).

    Inside a jitted step: the rows the new tokens hash to are gathered on the host and only they move to
    the device. The Engram layer then reads a table of exactly those rows with ids 0..B·S·C-1 in order,
    which is the same lookup (`take(table, ids)`) without the whole table in device memory.

    table_specs[k]: the k-th table's PartitionSpec on `mesh`. A table whose rows are split over mesh axes
    (`engram_table_sharding`: each chip's host holds 1/n of it, so a host holds its chips' shares, not a copy
    per chip) is read inside a `shard_map`: every chip gathers, from its own share, the rows of every
    chip's ids that fall in it (the ids are all-gathered: B·S·C int32), and a `psum` over those axes leaves each
    chip every row (each row comes from exactly one share, the others add zeros: exact).
    """
    b, s, n, c = ids_BSLC.shape
    tables = {}
    for k in range(n):  # the k-th Engram layer's module: `engram.{k}` (outside the stacks)
        ids = ids_BSLC[:, :, k].reshape(-1)
        spec = P() if table_specs is None else table_specs[k]
        axes = spec[0] if len(spec) else None
        for name in ("table", "table_scale"):  # the values and, held as shipped, their row scales
            if name not in params["engram"][k]:
                continue
            table = params["engram"][k][name][...]
            tables[k, name] = (_host_rows(table, ids) if not axes else
                               _share_rows(table, ids, mesh, (axes,) if isinstance(axes, str) else tuple(axes)))

    def swap(path, v):
        k = engram_table_index(path)
        return v if k is None else v.replace(tables[k, path[-1].key])

    params = jax.tree_util.tree_map_with_path(swap, params, is_leaf=_is_var)
    local = jnp.broadcast_to(jnp.arange(b * s * c, dtype=jnp.int32).reshape(b, s, 1, c), (b, s, n, c))
    return params, local


def _share_rows(table, ids_M, mesh: Mesh, axes: tuple):
    """table[ids] of a table whose rows are split over mesh `axes` (`gather_engram_rows`)."""
    def share(table_R, ids_M):
        held = table_R.shape[0]
        local = ids_M - jax.lax.axis_index(axes) * held
        mine = (local >= 0) & (local < held)
        rows = _host_rows(table_R, jnp.where(mine, local, 0))
        # One-byte rows (FP8 values, UE8M0 scales) summed as their bits in int32: the sum adds one row and zeros.
        one_byte = jnp.dtype(rows.dtype).itemsize == 1
        wide = jax.lax.bitcast_convert_type(rows, jnp.uint8).astype(jnp.int32) if one_byte else rows
        wide = jax.lax.psum(jnp.where(mine[:, None], wide, jnp.zeros((), wide.dtype)), axes)
        return jax.lax.bitcast_convert_type(wide.astype(jnp.uint8), rows.dtype) if one_byte else wide

    return jax.shard_map(share, mesh=mesh, in_specs=(P(axes, None), P()), out_specs=P(), check_vma=False)(table, ids_M)


def _host_rows(table_RD, ids_M):
    """table[ids] for a table in host memory: the ids go to the host, the gather runs there, the rows come
    back to the device."""
    from jax.experimental.compute_on import compute_on
    ids = jax.device_put(ids_M, jax.memory.Space.Host)
    with compute_on("device_host"):
        # in bounds by construction (hash ids < rows): no bound check, whose constants would live on the device
        rows = jax.lax.gather(table_RD, ids[:, None], jax.lax.GatherDimensionNumbers(
            offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,)), (1, table_RD.shape[1]),
            mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    return jax.device_put(rows, jax.memory.Space.Device)


def engram_table_sharding(mesh: Mesh, rows: int) -> tuple[int, NamedSharding]:
    """(rows padded, sharding) of an Engram table kept in host memory: its rows split over every mesh axis of
    more than one chip, padded to a multiple of the chips (tables hold a prime number of rows; hash ids stay
    below it, so the padding is never read). Each host then holds its chips' shares: table × chips per host /
    chips, instead of a whole copy per chip."""
    axes = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
    split = math.prod(mesh.shape[a] for a in axes)
    padded = -(-rows // split) * split
    return padded, NamedSharding(mesh, P(axes or None, None), memory_kind="pinned_host")


def next_token_loss(logits_BSV, tokens_BS) -> jax.Array:
    """Mean next-token cross-entropy (fp32) of teacher-forced logits."""
    logp = jax.nn.log_softmax(logits_BSV[:, :-1].astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens_BS[:, 1:, None], axis=-1))


def init_params(cfg, key: jax.Array, mesh: Mesh, rules="serve") -> nnx.State:
    """init_params with every parameter created directly in its shard (jit with out_shardings)."""
    return one_at_a_time(mesh, _jitted("init", model_lib.config_key(cfg), mesh, rules_key(rules), ())(key))


def init_cache(cfg, mesh: Mesh, rules="serve", *, batch: int, max_len: int) -> Cache:
    """An empty cache created in its shards (the same values as dsv41.init_cache)."""
    from dsv41.cache import init_cache as init
    out = cache_shardings(cfg, mesh, rules, batch=batch, max_len=max_len)
    return one_at_a_time(mesh, jax.jit(lambda: init(cfg, batch, max_len), out_shardings=out)())


def _forward_inputs(cfg, mesh, rules, tokens, engram_ids_BSLC, token_map):
    tokens = np.asarray(tokens, np.int32)
    vocab = cfg.architecture.vocab_size
    if tokens.ndim != 2:
        raise ValueError(f"tokens: shape {tokens.shape}: expected [batch, seq]")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        raise ValueError(f"tokens: ids in [{tokens.min()}, {tokens.max()}]: expected 0..{vocab - 1}")
    if engram_ids_BSLC is None:
        engram_ids_BSLC = model_lib.engram_ids(cfg, tokens, token_map)
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    tok = sequence_sharding(mesh, rules, tokens.shape, "tokens")
    ids = None if engram_ids_BSLC is None else np.asarray(engram_ids_BSLC, np.int32)
    shapes = (tokens.shape, None if ids is None else ids.shape)
    args = (put(tokens, tok), put(positions, tok),
            None if ids is None else put(ids, sequence_sharding(mesh, rules, ids.shape, "engram_ids")))
    return shapes, args


def forward(params, cfg, tokens, mesh: Mesh, rules="serve", *, engram_ids_BSLC=None, token_map=None) -> jax.Array:
    """dsv41.forward on a mesh: logits [B, S, V] fp32 split over rows (B a multiple of the batch mesh axes)."""
    shapes, args = _forward_inputs(cfg, mesh, rules, tokens, engram_ids_BSLC, token_map)
    return one_at_a_time(mesh, _jitted("forward", model_lib.config_key(cfg), mesh, rules_key(rules), shapes)(
        params, *args))


def loss_and_grad(params, cfg, tokens, mesh: Mesh, rules="train", *, engram_ids_BSLC=None, token_map=None):
    """(next-token loss, gradient w.r.t. every parameter) on a mesh; the gradient is sharded like the params."""
    shapes, args = _forward_inputs(cfg, mesh, rules, tokens, engram_ids_BSLC, token_map)
    return one_at_a_time(mesh, _jitted("grad", model_lib.config_key(cfg), mesh, rules_key(rules), shapes)(
        params, *args))


def prefill(params, cfg, cache: Cache, tokens, lengths=None, *, mesh: Mesh, rules="serve", token_map=None):
    """dsv41.prefill on a mesh (the `full` schedule): (logits [B, V] fp32, cache), the cache donated and kept
    in its rule shardings. Host checks as in dsv41.steps.prefill."""
    if cfg.runtime.prefill_schedule != "full":
        raise ConfigError("runtime.prefill_schedule", cfg.runtime.prefill_schedule,
                          "expected 'full' for the sharded steps (the CED schedule is not wrapped yet)")
    view = host_view(cache, read=to_host)
    held = view.lengths
    cap = steps_lib.capacity(cfg, cache)
    tokens, counts = steps_lib.check_tokens(cfg, tokens, lengths, held, cap)
    tokens = tokens.astype(np.int32)
    b = tokens.shape[0]
    ids, recent = steps_lib.engram_inputs(cfg, view.recent_tokens, tokens, counts, held, token_map)
    ids = None if ids is None else np.asarray(ids)
    shapes = (tokens.shape, None if ids is None else ids.shape, min(cap, cfg.context_window))
    kind = "step_engram_host" if ids is not None and engram_on_host(params) else "step"
    step = _jitted(kind, model_lib.config_key(cfg), mesh, rules_key(rules), shapes)
    tok = batch_sharding(mesh, rules, tokens.shape, "tokens")
    logits, cache = step(params, cache, put(tokens, tok), put(counts, batch_sharding(mesh, rules, (b,), "lengths")),
                         None if ids is None else put(ids, batch_sharding(mesh, rules, ids.shape, "engram_ids")))
    if ids is not None:
        cache = dataclasses.replace(cache, recent_tokens=put(recent.astype(np.int32), cache.recent_tokens.sharding))
    one_at_a_time(mesh, (logits, cache))
    return logits, with_mirror(cache, held + counts, recent)


def decode(params, cfg, cache: Cache, next_tokens, *, mesh: Mesh, rules="serve", token_map=None):
    """dsv41.decode on a mesh: next_tokens [B] -> (logits [B, V] fp32, cache)."""
    next_tokens = np.asarray(next_tokens)
    if next_tokens.ndim != 1:
        raise ValueError(f"next_tokens: shape {next_tokens.shape}: expected [batch]")
    return prefill(params, cfg, cache, next_tokens[:, None], mesh=mesh, rules=rules, token_map=token_map)
