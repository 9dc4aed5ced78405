"""Which layer stacks and which parts of a layer make a full-size step's TPU program: the step compiled for ONE
chip of a topology, with only some of the plan's stacks run and some parts of a layer stubbed out, printing the
XLA compile time, the fusions, libtpu's backend-pass time and the program's bundle count.

    JAX_PLATFORMS=cpu python scripts/compile_census.py --seq 256 --stacks 0            # the window-only layers
    JAX_PLATFORMS=cpu python scripts/compile_census.py --seq 256 --stacks 0 --stub moe,attention
    JAX_PLATFORMS=cpu python scripts/compile_census.py --seq 1 --stacks 2,4            # layer 20 + the Reindex groups

One chip, so that a part's share is not mixed with the partitioner's collectives: the batch is the rows one chip of
the full-size serving mesh holds (`--batch`, default 4: 32 rows over 8 chips) and the experts the chip's share
(`--experts`, default 32 of 256); the program then compiles about as long as the 8-chip one (docs/compile_time.md).
The stacks not named are skipped (`LayerStack.run` returns its input), so a stack that reads a layer outside it
needs that layer's stack too (the Reindex groups read layer 20: `--stacks 2,4`, then subtract `--stacks 2`).
Stubs replace a part by a cheap function of the same shapes: `moe` (the FFN), `mixes` (mHC's mixing
coefficients), `expand` (mHC's expand to a plain residual add), `attention` (the whole cached attention layer),
`core` (only the softmax over window keys and picks), `engram`. The XLA path only (compile-report's default
`--kernels reference`: the Pallas kernels need the topology's mesh). Needs libtpu (the `tpu` extra). The numbers
are not a model's outputs: this is a diagnostic for where compile time goes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["DSV41_COMPILE_CACHE"] = "off"
os.environ.update(TPU_STDERR_LOG_LEVEL="0", TPU_MIN_LOG_LEVEL="0")  # libtpu logs its stages; read when it loads
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax.numpy as jnp  # noqa: E402

import dsv41  # noqa: E402
from compile_fusions import captured_stderr, fusions_per_computation, stages  # noqa: E402
from dsv41 import compile_report as cr, plan as plan_lib, sharding as sh  # noqa: E402
from dsv41.nn import attention, mhc, moe  # noqa: E402
from dsv41.nn import model as model_lib  # noqa: E402

STUBS = ("moe", "mixes", "expand", "attention", "core", "engram")


def only_stacks(firsts: set[int]):
    """Runs only the stacks whose first layer is in `firsts` (the others return what they were given)."""
    run = model_lib.LayerStack.run

    def gated(self, layer_fn, carry, published, **kwargs):
        if self.spec.first not in firsts:
            return carry, published, None
        return run(self, layer_fn, carry, published, **kwargs)

    model_lib.LayerStack.run = gated


def stub(parts):
    if "moe" in parts:
        moe.MoE.__call__ = lambda self, x, *a, **k: x * 0.5
    if "mixes" in parts:
        def mixes(self, x):
            ones = (x.sum(-1) * 0 + 1).astype(jnp.float32)
            return ones, ones, jnp.broadcast_to(ones[..., None], (*ones.shape, x.shape[-2]))
        mhc.HyperConnection.mixes = mixes
    if "expand" in parts:
        mhc.expand = lambda y, x, post, comb: (x.astype(jnp.float32) + post[..., None] * y.astype(
            jnp.float32)[..., None, :]).astype(x.dtype)
    if "attention" in parts:
        attention.Attention.step = lambda self, x, *a, stores=None, **k: (x * 0.5, (a[3], a[6], None))
    if "core" in parts:
        attention.attend_step = lambda q, *a, **k: q
    if "engram" in parts:
        model_lib.Transformer.engram_step = lambda self, at, x, ids: x


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="v41_flash")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--seq", type=int, default=1, help="new tokens per row: 1 = decode, more = a prefill chunk")
    p.add_argument("--batch", type=int, default=4, help="rows on the chip")
    p.add_argument("--experts", type=int, default=32, help="routed experts on the chip")
    p.add_argument("--context", type=int, default=1_000_000)
    p.add_argument("--topology", default="v5p:2x2x2", help="the chip's kind (its first device is compiled for)")
    p.add_argument("--stacks", default="", help="comma-separated indices into the plan's layer stacks (default all)")
    p.add_argument("--stub", default="", help=f"comma-separated parts to stub out: {', '.join(STUBS)}")
    args = p.parse_args(argv)
    overrides = [*args.set, f"architecture.moe.num_experts={args.experts}"]
    cfg = cr.report_config(dsv41.load_config(args.config, overrides=overrides), "fp8", "reference")
    stacks = plan_lib.layer_stacks(cfg)
    if args.stacks:
        chosen = [int(s) for s in args.stacks.split(",")]
        bad = [s for s in chosen if not 0 <= s < len(stacks)]
        if bad:
            p.error(f"--stacks: {bad}: expected indices in 0..{len(stacks) - 1}")
        only_stacks({stacks[s].first for s in chosen})
    parts = [s for s in args.stub.split(",") if s]
    if set(parts) - set(STUBS):
        p.error(f"--stub: {sorted(set(parts) - set(STUBS))}: expected some of {', '.join(STUBS)}")
    stub(parts)
    for s, st in enumerate(stacks):
        print(f"  stack {s}: layers {st.layers[0]} x {st.groups} groups")
    devices = cr.topology_devices(args.topology)[:1]
    mesh = sh.make_mesh({"expert": 1}, devices=devices)
    fn, inputs = cr.step_program(cfg, mesh, "serve", weights="fp8", batch=args.batch, seq=args.seq,
                                 context=args.context, engram_host=True)
    lowered = fn.trace(*inputs).lower()
    log: list[str] = []
    t = time.perf_counter()
    with captured_stderr(log):
        compiled = lowered.compile()
    seconds = time.perf_counter() - t
    fusions = sum(fusions_per_computation(compiled.as_text()).values())
    wanted = ("BACKEND", "bundles")
    print(f"stacks {args.stacks or 'all'} stubs {args.stub or '-'} batch {args.batch} seq {args.seq}: XLA compile "
          f"{seconds:.1f} s, {fusions} fusions; "
          + ", ".join(s for s in stages("".join(log)) if s.startswith(wanted)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
