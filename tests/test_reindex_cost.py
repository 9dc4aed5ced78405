"""Reindex layers score only the gathered candidate pool: their decode cost does not grow with the
context (XLA's cost analysis of the decode step's FLOP-counting lowering, as `dsv41 compile-report` counts
FLOPs, at reduced width), while the candidate source (layer 20's counterpart, which scores every entry) grows
linearly. The lowered module is analysed, not compiled: the same operations, in seconds instead of a compile
per variant."""

import jax
import jax.numpy as jnp

import dsv41
from dsv41 import cache as cache_lib
from dsv41 import model, steps
from dsv41.nn.policy import FLOP_COUNTING

LONG = ["context_window=131072", "architecture.rope.max_position=131072",
        # The encoder (the same in every variant, so it cancels) cut to its two window-only layers.
        "csa2.encoder.layers=2", "csa2.encoder.groups=[]",
        # Only FLOPs are compared here (no picks): fewer indexer heads, each traced apart by the FLOP lowering.
        "csa2.indexer.query_heads=8"]
DECODER = {
    2: '[{"size":2,"modes":["full","reuse"]},{"size":2,"modes":["reindex","reuse"]},{"size":2,"modes":["reindex","reuse"]}]',
    1: '[{"size":2,"modes":["full","reuse"]},{"size":2,"modes":["reindex","reuse"]},{"size":2,"modes":["reuse","reuse"]}]',
    0: '[{"size":6,"modes":["full","reuse","reuse","reuse","reuse","reuse"]}]',
}


def decode_flops(reindex_layers: int, context: int) -> float:
    cfg = dsv41.load_config("tiny", overrides=LONG + [f"csa2.decoder.groups={DECODER[reindex_layers]}"])
    params = model.abstract_params(cfg)
    cache = jax.eval_shape(lambda: cache_lib.init_cache(cfg, 1, context))
    # XLA's cost analysis counts a loop body once: the FLOP-counting lowering unrolls the layer stacks and
    # scores the whole capacity at static shapes (the context measured).
    lowered = steps.lower(params, cfg, cache, jax.ShapeDtypeStruct((1, 1), jnp.int32),
                          jax.ShapeDtypeStruct((1,), jnp.int32), lowering=FLOP_COUNTING)
    cost = lowered.cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def test_reindex_flops_are_flat_and_the_source_grows():
    flops = {(n, t): decode_flops(n, t) for n in (0, 1, 2) for t in (4096, 131072)}
    reindex = {t: flops[2, t] - flops[1, t] for t in (4096, 131072)}  # one Reindex layer
    assert reindex[4096] > 0
    assert abs(reindex[131072] / reindex[4096] - 1) < 0.01, reindex
    # The pool (built by the candidate source over all its entries) and the whole step grow with the context.
    pool = {t: flops[1, t] - flops[0, t] - reindex[t] for t in (4096, 131072)}
    assert pool[131072] > 4 * pool[4096], pool
    assert flops[0, 131072] > 10 * flops[0, 4096]
