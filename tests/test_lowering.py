"""What changes a trace is part of the jit key (DESIGN §6, STYLE): the `Lowering` a model is built with
(experts per pick or by ragged_dot, the indexer's head loop unrolled or not, the expert layout) is part of
its graphdef and a static argument of the steps, so switching it between two calls of the same public
function gives another compiled program, and switching back gives the first again."""

import jax
import jax.numpy as jnp

import dsv41
from dsv41 import cache as cache_lib
from dsv41 import model, steps
from dsv41.nn.policy import FLOP_COUNTING, Lowering


def test_switching_the_lowering_changes_the_program():
    cfg = dsv41.load_config("tiny")
    params = model.abstract_params(cfg)
    c = jax.eval_shape(lambda: cache_lib.init_cache(cfg, 1, 64))
    args = (params, cfg, c, jax.ShapeDtypeStruct((1, 1), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
    text = lambda lowering: steps.lower(*args, lowering=lowering).as_text()
    plain = text(None)
    counting = text(FLOP_COUNTING)
    assert plain.count("stablehlo.while") > 0 == counting.count("stablehlo.while")   # the head loops unrolled
    assert text(Lowering()) == plain == text(None)                         # nothing leaks between calls
    per_pick, unrolled = text(Lowering(experts_per_pick=True)), text(Lowering(unroll_index_heads=True))
    assert len({plain, counting, per_pick}) == 3                           # each switch alone changes it
    assert unrolled == plain  # a decode step scores every indexer head at once: no head loop to unroll
    assert per_pick.count("stablehlo.while") == plain.count("stablehlo.while")
    assert model.graphdef(model.config_key(cfg), FLOP_COUNTING) != model.graphdef(model.config_key(cfg))


def test_the_indexer_head_loop_is_unrolled_where_it_exists():
    """A prefill chunk's indexer scores too many keys to take every head at once: it loops over groups of
    heads, which `unroll_index_heads` traces unrolled (XLA's cost analysis counts a loop body once)."""
    from dsv41.nn import indexer as ix
    b, s, heads, d, t = 1, 1024, 32, 128, 2048
    assert ix.heads_per_group(b, s, heads, t) < heads
    args = (jax.ShapeDtypeStruct((b, s, heads, d), jnp.float32), jax.ShapeDtypeStruct((b, t, d), jnp.float32),
            jax.ShapeDtypeStruct((b, s, heads), jnp.float32), jax.ShapeDtypeStruct((b, s, t), jnp.bool_))
    jaxpr = lambda unroll: str(jax.make_jaxpr(lambda *a: ix.lightning_scores(*a, unroll))(*args))
    loops = lambda text: text.count("scan[") + text.count("while[")
    assert loops(jaxpr(False)) == 1 and loops(jaxpr(True)) == 0
    assert jaxpr(True).count("dot_general") == heads // ix.heads_per_group(b, s, heads, t)
