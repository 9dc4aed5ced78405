"""Runs of identical layers inside a scanned group (`plan.Stack.runs`): V4.1-Flash's `[full, reuse×5]` and
`[reindex, reuse×3]` groups keep their Reuse layers in one parameter slot [G, R, ...], run as an inner
`lax.scan`, its Engram layers (1, 14) join the scans and its Reuse layers 21-23 join the decoder's scan
as a group led by Full layer 20 (`plan.Stack.lead`), so 6 of its 40 layers are traced. Checked on a cut-down tiny model with two
`[full, reuse, reuse]` groups (`quant: none`): the cached steps equal the teacher-forced forward, the
per-layer view of the parameters round-trips, and the MoE bias update reaches every layer of a run; its decoder
(`[full, reuse]`, then `[reindex, reuse]` × 2) runs its first Reuse layer as a led group 0, so the gradients
also go through that `lax.cond`.
V4 compat's runs are checked against transformers in test_v4_oracle (case `runs`)."""

import jax
import numpy as np
import pytest

import dsv41
from dsv41 import cache as cache_lib
from dsv41 import config as config_lib
from dsv41 import model as model_lib
from dsv41 import stacking, steps, train
from dsv41.nn.moe import BalanceBias

TOL = 1e-5  # the cached and the teacher-forced paths differ in summation order only (as test_cache_float)


def runs_config():
    d = dsv41.load_config("tiny", ["quant=none"]).to_dict()
    d["csa2"]["encoder"].update(layers=8, groups=[{"size": 3, "modes": ["full", "reuse", "reuse"]}] * 2)
    d["csa2"]["decoder"].update(layers=6, groups=[{"size": 2, "modes": ["full", "reuse"]}]
                                + [{"size": 2, "modes": ["reindex", "reuse"]}] * 2)
    d["architecture"]["mhc"]["sinkhorn_iters"] = 3
    return config_lib.build(d)


def test_the_v41_flash_reuse_layers_share_one_slot_per_group():
    cfg = dsv41.load_config("v41_flash")
    plan = dsv41.layer_plan(cfg)
    stacks = dsv41.plan.layer_stacks(cfg)
    assert [(st.groups, st.runs, st.lead) for st in stacks] == [
        (2, (1,), False), (3, (1, 5), False), (1, (1,), False), (5, (1, 3), True)]
    # Layers 21-23 are the decoder scan's group 0, which has no Reindex layer: Full layer 20 leads it.
    assert stacks[3].layers[0] == (20, 21, 22, 23) and stacks[3].grid(0) == (24, 28, 32, 36)
    assert dsv41.plan.layer_slot(cfg, 20)[0] == 2 and dsv41.plan.layer_slot(cfg, 22) == (3, 0, 1, 1)
    assert sum(st.slots for st in stacks) == 6
    assert all(stacks[dsv41.plan.layer_slot(cfg, i)[0]].groups > 1 for i in (1, 14))  # Engram layers scanned
    for st in stacks:
        for j in range(st.slots):
            layers = np.ravel(st.grid(j))
            assert len({plan[i].mode for i in layers}) == 1
            if st.runs[j] > 1:  # a run: Reuse layers that store nothing and feed nobody
                assert {plan[i].mode for i in layers} == {"reuse"}
    # Every layer sits in exactly one (stack, group, slot, run position).
    seen = {dsv41.plan.layer_slot(cfg, i) for i in range(len(plan))}
    assert len(seen) == len(plan) == 40


@pytest.fixture(scope="module")
def model():
    cfg = runs_config()
    stacks = dsv41.plan.layer_stacks(cfg)
    # The decoder's Reuse layer 9 is the group 0 of the Reindex scan, led by Full layer 8 (`plan.Stack.lead`).
    assert [(st.groups, st.runs, st.lead) for st in stacks] == [
        (2, (1,), False), (2, (1, 2), False), (1, (1,), False), (3, (1, 1), True)]
    params = dsv41.init_params(cfg, jax.random.key(0))
    return cfg, params


def test_run_parameters_are_stacked_per_layer_and_round_trip(model):
    cfg, params = model
    leaf = params["stacks"][1]["slots"][1]["attn"]["wq_a"]["w"]
    assert leaf.shape[:2] == (2, 2)  # [G, R, ...]
    per = stacking.layer_dict(params, cfg)
    # layer 2 + 3g + 1 + r holds leaf[g, r]; the four Reuse layers are four different arrays.
    for g in range(2):
        for r in range(2):
            np.testing.assert_array_equal(per[("layers", 2 + 3 * g + 1 + r, "attn", "wq_a", "w")], leaf[g, r])
    assert len({per[("layers", i, "attn", "wq_a", "w")].tobytes() for i in (3, 4, 6, 7)}) == 4
    # The led stack: slot 0 holds the Reindex layers 10, 12 (no group 0), slot 1 the Reuse layers 9, 11, 13.
    reindex, reuse = (params["stacks"][3]["slots"][j]["attn"]["wq_a"]["w"] for j in (0, 1))
    assert reindex.shape[0] == 2 and reuse.shape[0] == 3
    for i, leaf_i in ((10, reindex[0]), (12, reindex[1]), (9, reuse[0]), (11, reuse[1]), (13, reuse[2])):
        np.testing.assert_array_equal(per[("layers", i, "attn", "wq_a", "w")], leaf_i)
    back = stacking.from_per_layer(per, params, cfg)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_bias_update_reaches_every_layer_of_a_run(model):
    cfg, params = model
    from flax import nnx

    e = cfg.architecture.moe.num_experts
    buffers = nnx.state(model_lib.build_model(cfg, nnx.Rngs(0)), BalanceBias)
    load = {i: np.eye(e)[i % e] * (i + 1) for i in range(len(dsv41.layer_plan(cfg)))}
    new, _ = train.update_balance(cfg, buffers, {i: jax.numpy.asarray(v) for i, v in load.items()}, 1.0)
    got = {path[1]: np.asarray(v.get_value()) for path, v in stacking.per_layer(new, cfg)
           if path[0] == "layers"}
    before = {path[1]: np.asarray(v.get_value()) for path, v in stacking.per_layer(buffers, cfg)
              if path[0] == "layers"}
    for i, counts in load.items():
        if i in got:  # bias += sign(mean - load): the one loaded expert goes down, the others up
            np.testing.assert_array_equal(got[i] - before[i], np.sign(counts.mean() - counts))
    assert {3, 4, 6, 7} <= set(got)


def test_cached_steps_equal_the_forward(model):
    cfg, params = model
    ids = np.random.default_rng(0).integers(0, cfg.architecture.vocab_size, (2, 44))
    ref = np.asarray(dsv41.forward(params, cfg, ids))
    c = cache_lib.init_cache(cfg, 2, 64)
    first = (40, 29)
    chunk = np.where(np.arange(40) < np.array(first)[:, None], ids[:, :40], 0)
    logits, c = steps.prefill(params, cfg, c, chunk, lengths=first)
    errors = [np.abs(np.asarray(logits) - ref[[0, 1], [first[0] - 1, first[1] - 1]]).max()]
    held = np.array(first)
    for _ in range(3):
        logits, c = steps.decode(params, cfg, c, ids[[0, 1], held])
        errors.append(np.abs(np.asarray(logits) - ref[[0, 1], held]).max())
        held = held + 1
    assert max(errors) < TOL * max(1.0, np.abs(ref).std()), errors


@pytest.mark.slow
def test_gradients_through_the_runs_equal_the_unrolled_layers(model):
    """The training loss's value and gradients (the indexer KL included) with the runs scanned (each
    group rematerialised, as training runs them) against every layer unrolled (`Lowering(unroll_layers=True)`): the same arithmetic, so equal
    to float32 reassociation (quant none: no near-tied quantisation threshold to flip)."""
    import jax.numpy as jnp
    from flax import nnx

    from dsv41.nn.policy import Lowering

    cfg, variables = model
    params, buffers = train.split_variables(variables)
    key = model_lib.config_key(cfg)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.architecture.vocab_size, (2, 24)))
    positions = jnp.broadcast_to(jnp.arange(24), (2, 24))

    def loss(params, unrolled, remat):
        m = nnx.merge(model_lib.graphdef(key, Lowering(unroll_layers=True) if unrolled else None), params, buffers)
        logits, rows = train._forward_records(m, tokens, positions, remat)
        kl, _ = train.indexer_kl(m, rows, positions, "selectable")
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0]) + kl

    want_v, want_g = jax.jit(jax.value_and_grad(loss), static_argnums=(1, 2))(params, True, "none")
    got_v, got_g = jax.jit(jax.value_and_grad(loss), static_argnums=(1, 2))(params, False, "block")
    np.testing.assert_allclose(float(got_v), float(want_v), rtol=1e-6)
    run = params["stacks"][1]["slots"][1]["attn"]["wq_a"]["w"]
    g_run = got_g["stacks"][1]["slots"][1]["attn"]["wq_a"]["w"]
    assert g_run.shape == run.shape and all(float(jnp.abs(g_run[g, r]).max()) > 0 for g in range(2) for r in range(2))
    for a, b in zip(jax.tree.leaves(want_g), jax.tree.leaves(got_g)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(b - a) <= 1e-5 * np.linalg.norm(a) + 1e-9, (np.linalg.norm(b - a), np.linalg.norm(a))
