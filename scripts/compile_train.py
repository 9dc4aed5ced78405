"""The full-size train step compiled ahead of time for a TPU topology: memory per chip against sequence length.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 JAX_PLATFORMS=cpu python scripts/compile_train.py \
        --topology v5p:8x8x8 --mesh expert=64,context=8 --batch 64 --seqs 65536,131072
    ... --mesh data=8,expert=8,context=8 --rules train_long --batch 8 --seqs 65536 --set train.frozen=engram

Compiles `train.make_train_step` (the one the CLI runs) with abstract inputs — a TrainState sharded as
`train.state_shardings` says (fp32 master weights and AdamW moments, FSDP over data × expert × context, experts over
`expert`) and a batch of `--batch` rows of each length, rows over data × expert and each row's tokens over `context`
(sequence parallel; `--rules train_long`: rows over data, tokens over expert × context) — and prints XLA's memory
analysis per chip: arguments (the state and the batch), temporaries, and their sum against the chip's HBM. Needs
libtpu (the `tpu` extra); nothing runs on a TPU.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp

from dsv41 import compile_report, config as config_lib, sharding as sh, train
from dsv41.config import load_config

GiB = 2 ** 30


def abstract_batch(cfg, mesh, batch: int, seq: int, rules="train") -> dict:
    sds = lambda shape, dtype, what: jax.ShapeDtypeStruct(shape, dtype, sharding=sh.sequence_sharding(
        mesh, rules, shape, what))
    out = {k: sds((batch, seq), jnp.int32, f"batch[{k!r}]") for k in ("inputs", "targets")}
    out["loss_mask"] = sds((batch, seq), jnp.float32, "batch['loss_mask']")
    e = cfg.architecture.engram
    if list(e.layers):
        shape = (batch, seq, len(e.layers), (e.max_ngram - 1) * e.heads_per_ngram)
        out["engram_ids"] = sds(shape, jnp.int32, "batch['engram_ids']")
    return out


def compile_one(cfg, tc, mesh, batch: int, seq: int, rules="train") -> dict:
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         train.abstract_state(cfg, tc), train.state_shardings(cfg, tc, mesh, rules))
    t0 = time.perf_counter()
    step = train.make_train_step(cfg, tc, mesh=mesh, rules=rules).jitted
    lowered = step.trace(state, abstract_batch(cfg, mesh, batch, seq, rules)).lower()
    t1 = time.perf_counter()
    compiled, error = compile_report.try_compile(lowered)
    if compiled is None:  # XLA's error names the temporaries it asked for
        return {"seq": seq, "fits": False, "error": error, "lower_s": round(t1 - t0, 1),
                "compile_s": round(time.perf_counter() - t1, 1)}
    t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    state_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
                      for x in jax.tree.leaves(state))
    hbm = compile_report.HBM_BYTES.get(mesh.devices.flat[0].device_kind)
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    # Mosaic kernels in the program: XLA:TPU's own, and under qat the training forward's Pallas kernels
    # (`runtime.kernels`; compare with `--set runtime.kernels=reference`).
    mosaic = compiled.as_text().count('custom_call_target="tpu_custom_call"')
    return {"seq": seq, "tokens_per_chip": batch * seq // mesh.devices.size, "mosaic_calls": mosaic,
            "state_per_chip": state_bytes, "arguments": int(mem.argument_size_in_bytes),
            "temporaries": int(mem.temp_size_in_bytes), "total": int(total), "hbm": hbm,
            "fits": None if hbm is None else total <= hbm,
            "lower_s": round(t1 - t0, 1), "compile_s": round(t2 - t1, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="v41_flash")
    p.add_argument("--topology", default="v5p:8x8x8")
    p.add_argument("--mesh", default="expert=64,context=8", help="axis sizes over the topology's chips")
    p.add_argument("--batch", type=int, default=64,
                   help="rows per step (a multiple of data × expert; under --rules train_long, of data)")
    p.add_argument("--rules", choices=train.TRAIN_RULES, default="train",
                   help="train: rows over data × expert, tokens over context; train_long: rows over data, tokens "
                        "over expert × context")
    p.add_argument("--seqs", default="65536,131072", help="tokens per row, comma separated")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config overrides; train.FIELD=VALUE sets the TrainConfig (default remat=block, "
                        "kl_over=selected: the sparse stage)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    sets = dict(config_lib.parse_override(s[len("train."):]) for s in args.set if s.startswith("train."))
    cfg = load_config(args.config, ['runtime.compute_dtype="bfloat16"',
                                    *(s for s in args.set if not s.startswith("train."))])
    tc = train.TrainConfig(remat="block", kl_over="selected").replace(sets)
    mesh = sh.make_mesh(sh.parse_mesh(args.mesh), devices=compile_report.topology_devices(args.topology))
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        r = compile_one(cfg, tc, mesh, args.batch, seq, args.rules)
        rows.append(r)
        if not args.json:
            if r.get("fits") is False and "error" in r:
                print(f"S {seq:>7}: does not fit ({r['error']}); compile {r['compile_s']} s", flush=True)
                continue
            print(f"S {seq:>7}: {r['tokens_per_chip']} tokens/chip; per chip: state {r['state_per_chip'] / GiB:.1f} GiB, "
                  f"arguments {r['arguments'] / GiB:.1f} GiB, temporaries {r['temporaries'] / GiB:.1f} GiB, total "
                  f"{r['total'] / GiB:.1f} GiB of {r['hbm'] / GiB:.0f} GiB; {r['mosaic_calls']} Mosaic calls; lower "
                  f"{r['lower_s']} s, compile {r['compile_s']} s", flush=True)
    if args.json:
        print(json.dumps({"config": args.config, "topology": args.topology, "mesh": args.mesh, "rules": args.rules,
                          "batch": args.batch,
                          "train": {k: getattr(tc, k) for k in ("remat", "kl_over")}, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
