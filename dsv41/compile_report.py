"""Ahead-of-time compile report (DESIGN §9): full-size decode (and prefill) compiled for a TPU topology on a
CPU machine through libtpu, from abstract parameters and cache (ShapeDtypeStruct with shardings, never
allocated): per-chip memory vs the chip's HBM, XLA FLOPs per generated token, collective bytes and
compile time. Engram tables sit in host memory (memory kind pinned_host) and are reported separately.

    dsv41 compile-report --config v41_flash --topology v5p:4x4x4 --batch 64 --context 65536 --weight-format shipped

Needs libtpu (`jax.experimental.topologies`); run with JAX_PLATFORMS=cpu so nothing initialises a TPU.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from dsv41 import config as config_lib
from dsv41 import flop_model, hlo_cost
from dsv41 import model as model_lib
from dsv41 import sharding as sh
from dsv41.nn import moe, policy as policy_lib
from dsv41.cache import abstract_cache
from dsv41.errors import ConfigError

GIB = 1024 ** 3
# HBM per chip by jax device_kind (public TPU specs).
HBM_BYTES = {"TPU v4": 32 * GIB, "TPU v5 lite": 16 * GIB, "TPU v5": 95 * GIB, "TPU v6 lite": 32 * GIB,
             "TPU7x": 192 * GIB}
WEIGHTS = ("shipped", "bf16")  # `--weight-format`: the release's formats (`dsv41.nn.weights`), or bf16
WEIGHT_KERNELS = ("fp8_block_matmul", "mxfp4_grouped_matmul", "mxfp4_batched_matmul")  # `kernels.weight_matmul`
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "ragged-all-to-all")


def topology_devices(topology: str):
    from jax.experimental import topologies
    try:
        return topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    except Exception as e:  # libtpu's own message says what it could not parse
        raise ConfigError("topology", topology, f"expected a TPU topology such as v5p:4x4x4 ({e})") from e


def report_config(cfg, weights: str, kernels: str):
    """The config as compiled: bf16 compute; weights held in the weight format `weights` ("shipped": the release's
    FP8 / MXFP4 matrices with their scales, dequantised inside each matmul, the other parameters bf16)."""
    if weights not in WEIGHTS:
        raise ConfigError("--weight-format", weights, f"expected one of {WEIGHTS}")
    return config_lib.build(cfg.to_dict(), [*config_lib.weight_format_overrides(weights),
                                            "runtime.param_dtype=\"bfloat16\"", "runtime.compute_dtype=\"bfloat16\"",
                                            f"runtime.kernels=\"{kernels}\""])


def abstract_inputs(cfg, mesh, rules, *, batch: int, seq: int, context: int, engram_host: bool):
    """ShapeDtypeStructs with shardings for (params, cache, tokens, counts, engram ids) and the params'
    shardings, the parameters as the config's weight format holds them (`report_config`)."""
    abstract = model_lib.abstract_params(cfg)
    shardings = sh.param_shardings(cfg, mesh, rules, abstract, engram_host=engram_host)

    def place(path, v, s):
        x, sharding = v.get_value(), s.get_value()
        dtype, shape = x.dtype, x.shape
        if engram_host and sh.engram_table_index(path) is not None:  # rows padded to the chips' shares
            shape = (sh.engram_table_sharding(mesh, shape[0])[0], *shape[1:])
        return v.replace(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)), s.replace(sharding)

    pairs = jax.tree_util.tree_map_with_path(lambda p, v, s: place(p, v, s), abstract, shardings,
                                             is_leaf=lambda x: isinstance(x, nnx.Variable))
    is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], nnx.Variable)
    params = jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair)
    pshard = jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair)
    cs = sh.cache_shardings(cfg, mesh, rules, batch=batch, max_len=context)
    cache = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         abstract_cache(cfg, batch, context), cs)
    tok = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=sh.batch_sharding(mesh, rules, (batch, seq), "tokens"))
    counts = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=sh.batch_sharding(mesh, rules, (batch,), "lengths"))
    e = cfg.architecture.engram
    ids = None
    if list(e.layers):
        shape = (batch, seq, len(e.layers), (e.max_ngram - 1) * e.heads_per_ngram)
        ids = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh.batch_sharding(mesh, rules, shape, "engram_ids"))
    return (params, cache, tok, counts, ids), pshard


def _host_bytes_per_host(tree) -> int:
    """The most host memory one host gives the leaves kept there: each chip's shard counted on its own host
    (a table replicated over a host's chips is held once per chip)."""
    per_host = {}
    for x in jax.tree.leaves(tree):
        if x.sharding.memory_kind != "pinned_host":
            continue
        shard = math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
        for d in x.sharding.device_set:
            per_host[d.process_index] = per_host.get(d.process_index, 0) + shard
    return max(per_host.values(), default=0)


def _leaf_bytes(tree, host: bool) -> int:
    total = 0
    for x in jax.tree.leaves(tree):
        on_host = x.sharding.memory_kind == "pinned_host"
        if on_host == host:
            shard = x.sharding.shard_shape(x.shape)
            total += math.prod(shard) * jnp.dtype(x.dtype).itemsize
    return total


def collective_bytes(hlo_text: str) -> dict:
    """Bytes produced per chip by each kind of collective in the compiled (per-device) HLO."""
    out = {k: 0 for k in COLLECTIVES}
    count = {k: 0 for k in COLLECTIVES}
    pattern = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
    for line in hlo_text.splitlines():
        m = pattern.search(line)
        if not m or "-done" in line:
            continue
        kind = m.group(2)
        out[kind] += int(hlo_cost.shape_bytes(m.group(1)))
        count[kind] += 1
    return {k: {"ops": count[k], "bytes": out[k]} for k in COLLECTIVES if count[k]}


_NARROW = ("f8e4m3fn", "f8e5m2", "f4e2m1fn", "s4", "u4", "f8e8m0fnu")  # UE8M0: a held weight's scales
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \((.*)\) -> (.*) \{$")


def weight_copies(hlo_text: str, min_bytes: int = 4096) -> dict:
    """Fusions of the compiled (per-device) HLO that only widen an FP8 / FP4 array (or a held weight: its UE8M0
    scales are among the operands, `dsv41.nn.weights`) into a copy of at least
    `min_bytes` (a convert, with slicing and layout changes, and nothing else: no dot, reduction or call): the
    weight copies a matmul that cannot read the narrow format (a custom kernel) makes each time it runs.
    Returns {"ops": call sites, "bytes": their outputs' bytes} (a loop body's once)."""
    widening, comp, params, ops = set(), None, "", []

    def close():
        if comp and any(t in params for t in _NARROW) and "convert" in ops and not any(
                op in ops for op in ("dot", "convolution", "reduce", "custom-call", "call", "scatter", "gather")):
            widening.add(comp)

    for line in hlo_text.splitlines():
        m = _HEADER.match(line)
        if m:
            close()
            comp, params, ops = m.group(1), m.group(2), []
        elif comp and " = " in line:
            op = re.search(r"\s([a-z][\w\-]*)\(", line.split(" = ", 1)[1])
            if op:
                ops.append(op.group(1))
    close()
    count, total = 0, 0
    call = re.compile(r"=\s*(\w+)\[([\d,]*)\][^ ]*\s+fusion\(.*calls=%([\w.\-]+)")
    for line in hlo_text.splitlines():
        m = call.search(line)
        if m and m.group(3) in widening and hlo_cost.element_bytes(m.group(1)) > 1:
            size = hlo_cost.element_bytes(m.group(1)) * math.prod(int(d) for d in m.group(2).split(",") if d)
            if size >= min_bytes:
                count, total = count + 1, total + size
    return {"ops": count, "bytes": total}


def _expert_form(cfg, mesh, rules, tokens: int, seq: int) -> dict:
    """How the compiled step runs its routed experts (`moe.expert_form` on the mesh's platform)."""
    policy = policy_lib.from_config(cfg, sh.lowering_for(cfg, mesh, rules))
    group = moe.group_tokens(policy.lowering.layout, tokens)
    return {"form": moe.expert_form(policy, seq, group), "group_tokens": group}


def try_compile(lowered):
    """(compiled, None), or (None, XLA's message) for a program that cannot fit the chip: XLA refuses it with
    RESOURCE_EXHAUSTED, which is a report's answer, not a crash."""
    try:
        return lowered.compile(), None
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return None, str(e).splitlines()[0][:300]


def step_program(cfg, mesh, rules, *, batch: int, seq: int, context: int, engram_host: bool):
    """(the jitted step, its abstract arguments) as the report compiles them: `fn.trace(*args).lower()`; the
    weights as `cfg`'s weight format holds them (`report_config`)."""
    args, pshard = abstract_inputs(cfg, mesh, rules, batch=batch, seq=seq, context=context,
                                   engram_host=engram_host)
    fn = sh.step_function(cfg, mesh, rules, tokens_shape=(batch, seq), ids_shape=None if args[4] is None else
                          args[4].shape, max_len=context, params_shardings=pshard,
                          engram_host=engram_host)
    return fn, args


def compile_step(cfg, mesh, rules, *, weights: str, batch: int, seq: int, context: int, engram_host: bool,
                 breakdown: int = 0) -> dict:
    """AOT-compiles one step (seq = 1: decode; seq > 1: a prefill chunk) and measures it. breakdown: list that
    many of the compiled step's costliest named scopes and instructions (`hlo_cost.breakdown`)."""
    fn, args = step_program(cfg, mesh, rules, batch=batch, seq=seq, context=context,
                            engram_host=engram_host)
    t0 = time.perf_counter()
    lowered = fn.trace(*args).lower()
    t1 = time.perf_counter()
    compiled, error = try_compile(lowered)
    if compiled is None:
        return {"seq": seq, "lower_s": round(t1 - t0, 2), "compile_s": round(time.perf_counter() - t1, 2),
                "fits": False, "error": error,
                "memory_per_chip": {"params_on_device": _leaf_bytes(args[0], host=False),
                                    "cache": _leaf_bytes(args[1], host=False),
                                    "engram_host": _leaf_bytes(args[0], host=True)}}
    t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    chips = mesh.devices.size
    hlo = compiled.as_text()
    # The compiled program scans its layer stacks, and XLA's cost analysis counts a loop body once: the
    # FLOPs come from the same step lowered with every loop unrolled (`lowered_flops_per_token`).
    per_token = lowered_flops_per_token(cfg, batch=batch, context=context, weights=weights, seq=seq)
    flops = per_token * batch * seq / chips
    analytic = flop_model.flops_per_token(cfg, context=context, seq=seq, weights=weights)
    hbm = HBM_BYTES.get(mesh.devices.flat[0].device_kind)
    memory = {
        "arguments": int(mem.argument_size_in_bytes),
        "outputs": int(mem.output_size_in_bytes),
        "aliased": int(mem.alias_size_in_bytes),
        "temporaries": int(mem.temp_size_in_bytes),
        "code": int(mem.generated_code_size_in_bytes),
    }
    # Donated cache outputs alias their inputs: live bytes = arguments + outputs - aliased + temporaries.
    memory["total"] = memory["arguments"] + memory["outputs"] - memory["aliased"] + memory["temporaries"]
    memory["hbm"] = hbm
    memory["fits"] = None if hbm is None else memory["total"] <= hbm
    memory["params_on_device"] = _leaf_bytes(args[0], host=False)
    memory["cache"] = _leaf_bytes(args[1], host=False)
    memory["engram_host"] = _leaf_bytes(args[0], host=True)
    memory["engram_host_per_host"] = _host_bytes_per_host(args[0])
    memory["host_arguments"] = int(getattr(mem, "host_argument_size_in_bytes", 0))
    memory["host_temporaries"] = int(getattr(mem, "host_temp_size_in_bytes", 0))
    program = hlo_cost.Program(hlo)
    accessed = program.totals()
    # A step's floor: read every parameter on the chip and its cache once (the decode roofline).
    roofline = memory["params_on_device"] + memory["cache"]
    out = {
        "seq": seq,
        "lower_s": round(t1 - t0, 2),
        "compile_s": round(t2 - t1, 2),
        "memory_per_chip": memory,
        "flops_per_chip": flops,  # the step's FLOPs shared evenly over the chips
        "flops_per_token": per_token,
        # The closed per-layer count of the matmuls (`flop_model`), raw and precision-weighted (BF16 1, FP8 0.5,
        # FP4 0.25); XLA's count adds the elementwise work.
        "analytic_flops_per_token": {"matmul": analytic["total"], "weighted": analytic["weighted"],
                                     "xla_over_analytic": per_token / analytic["total"]},
        "collectives_per_chip": collective_bytes(hlo),
        "weight_copies_per_chip": weight_copies(hlo),
        "experts": _expert_form(cfg, mesh, rules, batch * seq, seq),
        # Pallas kernels in the program (Mosaic custom calls from a pallas_call; XLA's own ragged-dot kernels
        # are Mosaic custom calls too, and not counted)
        "pallas_kernels": sum('custom_call_target="tpu_custom_call"' in line and "pallas_call" in line
                              for line in hlo.splitlines()),
        # of them, the matmuls of weights held as shipped (`dsv41.kernels.weight_matmul`)
        "weight_kernels": sum('custom_call_target="tpu_custom_call"' in line and "pallas_call" in line
                              and any(name in line for name in WEIGHT_KERNELS)
                              for line in hlo.splitlines()),
        # HBM bytes per chip per step read from the compiled program, every loop body times its trip count
        # (XLA's own cost analysis counts each once); loops whose trip count is computed at run time (the
        # filled-length indexer tiles) are counted once.
        "bytes_per_chip": {"accessed": accessed["bytes"], "roofline": roofline,
                           "ratio": accessed["bytes"] / roofline if roofline else None,
                           "loops_counted_once": accessed["unknown_trip_counts"]},
    }
    if breakdown:
        out["breakdown"] = hlo_cost.breakdown(program, top=breakdown)
    return out


def flop_counting_lowering(cfg, *, batch: int, context: int, weights: str, seq: int = 1, held: bool = False):
    """The step (seq = 1: decode, else a prefill chunk) lowered on one CPU device at static shapes, for
    counting its arithmetic (`jax.stages.Lowered`): the XLA reference path (a Pallas kernel is a custom call XLA
    counts as nothing), the layer stacks, Sinkhorn and the indexer's head loop unrolled and the experts as one
    matmul per pick (XLA's cost analysis counts a loop body once and a ragged_dot as dense over its groups).
    Lowering takes seconds where a full-size TPU compile takes minutes, so a context sweep is cheap. The weights
    are lowered plain (bf16), whatever `weights` (the format the analytic count weighs, `flop_model`): XLA counts
    a held weight's dequantisation as FLOPs, which are not the model's arithmetic. held: lower the weights as
    `weights` holds them instead (the program as it runs, dequantisation included; `verify --full-size-contexts`)."""
    mesh = sh.make_mesh({}, devices=jax.devices("cpu")[:1])
    fmt = weights if held else "bf16"
    cfg = config_lib.build(cfg.to_dict(), ['runtime.kernels="reference"', *config_lib.weight_format_overrides(fmt)])
    args, pshard = abstract_inputs(cfg, mesh, "serve", batch=batch, seq=seq, context=context,
                                   engram_host=False)
    fn = sh.step_function(cfg, mesh, "serve", tokens_shape=(batch, seq), ids_shape=None if args[4] is None else
                          args[4].shape, max_len=context, params_shardings=pshard, engram_host=False,
                          flop_counting=True)
    return fn.trace(*args).lower()


def lowered_flops_per_token(cfg, *, batch: int, context: int, weights: str, seq: int = 1) -> float:
    """XLA's FLOPs of one whole step (every chip's work together; seq = 1: decode, else a prefill chunk)
    per new token, from `flop_counting_lowering`: the model's arithmetic, whatever the sharding."""
    cost = flop_counting_lowering(cfg, batch=batch, context=context, weights=weights, seq=seq).cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"]) / (batch * seq)


def context_sweep(cfg, contexts, batch: int, weights: str) -> list[dict]:
    """Decode FLOPs per token by context, relative to the first (4096), for the model as configured
    (Reindex layers score only the candidate pool's entries) and for a variant whose Reindex layers score
    every entry (`csa2.indexer.hierarchical.enabled=false`: the cost of scoring everything, then masking
    to the pool)."""
    everything = config_lib.build(cfg.to_dict(), ["csa2.indexer.hierarchical.enabled=false"])
    rows = []
    for t in contexts:
        rows.append({"context": t, "flops_per_token": lowered_flops_per_token(cfg, batch=batch, context=t,
                                                                              weights=weights),
                     "score_everything_flops_per_token": lowered_flops_per_token(everything, batch=batch, context=t,
                                                                                 weights=weights)})
        print(f"  swept context {t}", file=sys.stderr, flush=True)
    for r in rows:
        r["relative_to_4k"] = r["flops_per_token"] / rows[0]["flops_per_token"]
        r["score_everything_relative_to_4k"] = (r["score_everything_flops_per_token"]
                                                / rows[0]["score_everything_flops_per_token"])
    for r, a in zip(rows, flop_model.weighted_sweep(cfg, [r["context"] for r in rows], weights)):
        r["analytic"] = {k: a[k] for k in ("flops", "weighted", "flops_relative", "weighted_relative")}
    return rows


def compile_report(cfg, topology: str, batch: int, context: int, weights: str = "shipped", *, mesh: dict | None = None,
                   rules="serve", prefill_chunk: int = 0, engram_host: bool = True, kernels: str = "reference",
                   sweep=(), breakdown: int = 0) -> dict:
    """Compiles full-size decode (and a prefill chunk of `prefill_chunk` tokens if > 0) for a TPU topology.

    mesh: axis sizes over the topology's chips (default: every chip on `expert`). sweep: contexts whose
    decode FLOPs are reported relative to 4096 tokens (4096 is added). breakdown: list that many of each
    step's costliest named scopes and instructions. Returns a JSON-ready dict.
    """
    devices = topology_devices(topology)
    shape = mesh or {"expert": len(devices)}
    m = sh.make_mesh(shape, devices=devices)
    cfg = report_config(cfg, weights, kernels)
    out = {"model": cfg.model, "topology": topology, "chips": len(devices), "device_kind": devices[0].device_kind,
           "mesh": dict(shape), "rules": rules if isinstance(rules, str) else "custom", "weights": weights,
           "batch": batch, "context": context, "kernels": kernels, "engram_in_host_memory": engram_host}
    out["decode"] = compile_step(cfg, m, rules, weights=weights, batch=batch, seq=1, context=context,
                                 engram_host=engram_host, breakdown=breakdown)
    if prefill_chunk:
        out["prefill"] = compile_step(cfg, m, rules, weights=weights, batch=batch, seq=prefill_chunk,
                                      context=context, engram_host=engram_host, breakdown=breakdown)
    if sweep:
        out["context_sweep"] = context_sweep(cfg, sorted({4096, *sweep}), batch, weights)
    return out


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "compile-report", help="AOT-compile full-size decode for a TPU topology: per-chip memory, FLOPs, collectives",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  dsv41 compile-report --topology v5p:2x2x2 --batch 32 --context 1000000 --weight-format shipped "
               "--kernels pallas\n"
               "  dsv41 compile-report --config v41_flash --topology v5p:4x4x4 --batch 64 --context 65536 "
               "--weight-format shipped --sweep-context 16384,65536")
    p.add_argument("--config", default="v41_flash", help="config name in configs/ or a path (default v41_flash)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--topology", required=True, help="TPU topology, e.g. v5p:4x4x4, v6e:4x4, v5e:2x4")
    p.add_argument("--batch", type=int, required=True, help="sequences per decode step (a multiple of the mesh)")
    p.add_argument("--context", type=int, required=True,
                   help="cache capacity in tokens (rounded up to a multiple of the compression ratios)")
    p.add_argument("--weight-format", choices=WEIGHTS, default="shipped",
                   help="how the weights are held: 'shipped' (the release's FP8 / MXFP4 with their scales, "
                        "dequantised in each matmul; default) or 'bf16'")
    p.add_argument("--weights", choices=("fp8", "bf16"), default=None, help=argparse.SUPPRESS)  # its old name
    p.add_argument("--mesh", default=None, help="axis sizes, e.g. data=4,expert=16 (default: all chips on expert)")
    p.add_argument("--rules", choices=sorted(sh.PRESETS), default="serve")
    p.add_argument("--prefill-chunk", type=int, default=0, help="also compile a prefill chunk of this many tokens")
    p.add_argument("--kernels", choices=("reference", "pallas"), default="reference",
                   help="attention/indexer path compiled (default: the XLA reference path)")
    p.add_argument("--engram-on-device", action="store_true", help="keep Engram tables in HBM instead of host memory")
    p.add_argument("--sweep-context", default="", help="comma-separated contexts: decode FLOPs relative to 4K, with the pool gather and scoring everything")
    p.add_argument("--breakdown", type=int, nargs="?", const=12, default=0, metavar="N",
                   help="list each step's N costliest named scopes and instructions by bytes and FLOPs (default 12)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    cfg = config_lib.load_config(args.config, args.set)
    try:
        sweep = tuple(int(t) for t in args.sweep_context.split(",") if t.strip())
    except ValueError:
        raise ConfigError("--sweep-context", args.sweep_context, "expected comma-separated integers") from None
    print(f"compiling {cfg.model} decode for {args.topology} (batch {args.batch}, context {args.context}) ...",
          file=sys.stderr, flush=True)
    weights = {"fp8": "shipped", "bf16": "bf16", None: args.weight_format}[args.weights]
    r = compile_report(cfg, args.topology, args.batch, args.context, weights,
                       mesh=sh.parse_mesh(args.mesh) if args.mesh else None, rules=args.rules,
                       prefill_chunk=args.prefill_chunk, engram_host=not args.engram_on_device,
                       kernels=args.kernels, sweep=sweep, breakdown=args.breakdown)
    if args.json:
        print(json.dumps(r))
        return 0
    print(format_report(r))
    return 0


def format_report(r: dict) -> str:
    g = lambda b: f"{b / GIB:.2f} GiB"
    lines = [f"{r['model']} on {r['topology']} ({r['chips']} × {r['device_kind']}), mesh {r['mesh']}, "
             f"rules {r['rules']}, weights {r['weights']}, batch {r['batch']}, context {r['context']}"]
    for kind in ("decode", "prefill"):
        if kind not in r:
            continue
        s, m = r[kind], r[kind]["memory_per_chip"]
        if s.get("fits") is False:
            lines += [f"{kind} (seq {s['seq']}): DOES NOT FIT (XLA refused it after {s['compile_s']} s): {s['error']}",
                      f"  per chip: params {g(m['params_on_device'])}, cache {g(m['cache'])}; "
                      f"Engram tables in host memory: {g(m['engram_host'])} per chip"]
            continue
        hbm = "?" if m["hbm"] is None else g(m["hbm"])
        lines += [f"{kind} (seq {s['seq']}): lowered in {s['lower_s']} s, compiled in {s['compile_s']} s",
                  f"  per chip: arguments {g(m['arguments'])} (params {g(m['params_on_device'])}, "
                  f"cache {g(m['cache'])}), temporaries {g(m['temporaries'])}, total {g(m['total'])} of {hbm} HBM"
                  f"{'' if m['fits'] is None else (' — fits' if m['fits'] else ' — DOES NOT FIT')}",
                  f"  Engram tables in host memory: {g(m['engram_host'])} per chip, {g(m['engram_host_per_host'])} "
                  "per host",
                  f"  XLA FLOPs per token: {s['flops_per_token']:.4g} ({s['flops_per_chip']:.4g} per chip per step), "
                  "counted with one matmul per expert pick",
                  f"  analytic matmul FLOPs per token: {s['analytic_flops_per_token']['matmul']:.4g} (XLA "
                  f"{s['analytic_flops_per_token']['xla_over_analytic']:.3f}× of it), precision-weighted "
                  f"{s['analytic_flops_per_token']['weighted']:.4g}"]
        if "experts" in s:
            e = s["experts"]
            lines.append(f"  routed experts: {e['form']} ({e['group_tokens']} tokens per expert group"
                         + ("; every held expert over them: more arithmetic than counted, fewer bytes)"
                            if e["form"] == "dense" else ")"))
        for k, v in s["collectives_per_chip"].items():
            lines.append(f"  {k}: {v['ops']} ops, {v['bytes'] / 2**20:.1f} MiB per chip")
        b = s["bytes_per_chip"]
        once = f"; {b['loops_counted_once']} loops bound at run time counted once" if b["loops_counted_once"] else ""
        lines.append(f"  HBM bytes per step: {b['accessed'] / 1e9:.2f} GB per chip (loop bodies times their trip counts"
                     f"{once}), {b['ratio']:.2f}× the roofline of {b['roofline'] / 1e9:.2f} GB (params + cache once)")
        w = s.get("weight_copies_per_chip", {"ops": 0})
        lines.append(f"  FP8/FP4 arrays widened into copies of 4 KiB or more: {w['ops']} ops"
                     + (f", {g(w['bytes'])} per chip (loop bodies once)" if w["ops"] else ""))
    for kind in ("decode", "prefill"):
        if r.get(kind, {}).get("breakdown"):
            lines += format_breakdown(kind, r[kind]["breakdown"])
    if r.get("context_sweep"):
        lines.append("decode FLOPs per token by context (lowered on one device; pool gather vs score everything):")
    for p in r.get("context_sweep", []):
        lines.append(f"  context {p['context']:>8}: {p['flops_per_token']:.4g} ({p['relative_to_4k']:.3f}× of 4K); "
                     f"score everything {p['score_everything_flops_per_token']:.4g} "
                     f"({p['score_everything_relative_to_4k']:.3f}× of 4K); analytic {p['analytic']['flops_relative']:.3f}×, "
                     f"weighted {p['analytic']['weighted_relative']:.3f}×")
    return "\n".join(lines)


def format_breakdown(kind: str, b: dict) -> list[str]:
    lines = [f"{kind}: where the bytes and FLOPs go (per chip per step; named scopes, loop bodies × trip counts)"]
    lines += [f"  {r['bytes'] / 1e9:9.3f} GB {r['flops'] / 1e9:11.2f} GFLOP  {r['scope']}"
              for r in b["by_scope"][:len(b["top_bytes"])]]
    for title, key in (("instructions by bytes", "top_bytes"), ("instructions by FLOPs", "top_flops")):
        lines.append(f"  {title}:")
        lines += [f"    {r['bytes'] / 1e9:9.3f} GB {r['flops'] / 1e9:11.2f} GFLOP  ×{r['count']:<4} {r['op']} "
                  f"{r['shape']}  {r['scope']}{'/' + r['primitive'] if r['primitive'] else ''}" for r in b[key]]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="dsv41")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
