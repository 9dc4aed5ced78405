"""The expert-parallel MoE (`dsv41.nn.moe.experts_parallel`) equals the single-device MoE, forward and gradient.

The comparison runs in a subprocess with 8 simulated CPU devices (XLA_FLAGS must be set before JAX starts):
one MoE layer of configs/tiny.json (8 experts, top-2, shared expert) on meshes that split the experts, their
width, both or neither, under the serve and train rules, with token counts that do and do not divide the
token shards (padding). The reference is the same layer built without a layout (`Lowering.layout`), on one device.
Tolerance: 1e-5 relative to each result's largest reference value (fp32 sums in another order; observed
up to 1.4e-6 with the intermediate width split).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

TOL = 1e-5
CASES = [({"data": 8}, "serve", 0), ({"data": 2, "expert": 4}, "serve", 0),
         ({"data": 2, "tensor": 2, "expert": 2}, "serve", 0), ({"data": 2, "tensor": 2, "expert": 2}, "train", 0),
         ({"tensor": 2, "expert": 4}, "train", 0),
         ({"data": 2, "expert": 4}, "serve", 6)]   # 6 experts: the expert axis does not divide them


def _layer(experts: int = 0, layout=None):
    import jax.numpy as jnp
    from flax import nnx

    import dsv41
    from dsv41.nn.moe import MoE
    from dsv41.nn.policy import Lowering, Policy
    overrides = [f"architecture.moe.num_experts={experts}"] if experts else []
    cfg = dsv41.load_config("tiny", overrides)
    a, m = cfg.architecture, cfg.architecture.moe
    layer = MoE(a.hidden_size, m.num_experts, m.top_k, m.intermediate_size, m.num_shared_experts, m.route_scale,
                m.swiglu_limit, policy=Policy(jnp.float32, jnp.float32, lowering=Lowering(layout=layout)),
                rngs=nnx.Rngs(0))
    return cfg, layer


def _checks() -> dict:
    """Runs in the 8-device subprocess; returns the measured differences."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding

    from dsv41 import sharding as sh
    from dsv41.errors import ConfigError
    from dsv41.nn import moe as moe_lib

    assert jax.device_count() == 8, jax.devices()
    out = {"cases": []}
    refs = {}
    for shape, rules, experts in CASES:
        cfg, layer = _layer(experts)
        graph, state = nnx.split(layer)
        mesh = sh.make_mesh(shape)
        layout = sh.expert_layout(cfg, mesh, rules)
        par_graph = nnx.graphdef(_layer(experts, layout)[1])   # the same layer built expert-parallel
        for rows in (32, 21):   # 21 tokens: not a multiple of the token shards
            key = jax.random.key(rows)
            x = jax.random.normal(key, (1, rows, cfg.architecture.hidden_size), jnp.float32)
            probe = jax.random.normal(jax.random.fold_in(key, 1), x.shape, jnp.float32)

            def loss(state, x, graph=graph):
                y = nnx.capture(nnx.merge(graph, state), nnx.Intermediate)(x)[0]
                return jnp.sum(y * probe), y

            grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)

            def parallel(state, x):
                return grad(state, x, par_graph)

            if (experts, rows) not in refs:
                refs[experts, rows] = jax.jit(grad)(state, x)
            ref = refs[experts, rows]
            placed = jax.tree.map(lambda v: v.replace(jax.device_put(v.get_value(), NamedSharding(
                mesh, sh.logical_spec(v.get_metadata()["out_sharding"], v.get_value().shape, mesh, rules,
                                      what="moe")))), state, is_leaf=lambda v: isinstance(v, nnx.Variable))
            got = jax.jit(parallel)(placed, x)
            # per leaf (loss, output, each gradient), relative to the leaf's largest reference value
            diff = max(float(np.abs(np.asarray(g) - np.asarray(r)).max() / np.abs(np.asarray(r)).max())
                       for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)) if np.abs(np.asarray(r)).max() > 0)
            w1_grad = np.asarray(got[1][0]["w1"][...])
            out["cases"].append({
                "shape": shape, "rules": rules, "experts": experts, "rows": rows,
                "layout": [list(layout.token_axes), list(layout.expert_axes), list(layout.tensor_axes)],
                "diff": diff,
                # every expert received picks, so every expert's weights have a gradient
                "experts_with_grad": int((np.abs(w1_grad).reshape(w1_grad.shape[0], -1).max(axis=1) > 0).sum()),
                "shard_maps": str(jax.jit(parallel).trace(placed, x).jaxpr).count("shard_map["),
            })

    # A hand-made layout whose expert axis does not divide the experts.
    mesh = sh.make_mesh({"data": 2, "expert": 4})
    bad = moe_lib.ExpertLayout(mesh, ("data", "expert"), ("expert",), ())
    cfg, layer = _layer(6, bad)
    try:
        nnx.capture(layer, nnx.Intermediate)(jnp.zeros((1, 8, cfg.architecture.hidden_size)))
        out["error"] = None
    except ConfigError as e:
        out["error"] = str(e)
    return out


def _run(mode: str, timeout: int = 600) -> dict:
    from conftest import run_on_devices
    return run_on_devices(__file__, mode, timeout=timeout)


@pytest.fixture(scope="module")
def results():
    return _run("checks")


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)))
def test_expert_parallel_equals_single_device(results, index):
    shape, rules, experts = CASES[index]
    cases = [r for r in results["cases"] if (r["shape"], r["rules"], r["experts"]) == (shape, rules, experts)]
    assert [r["rows"] for r in cases] == [32, 21]
    for r in cases:
        assert r["diff"] < TOL, r                  # loss, output and every gradient (experts, router, input)
        assert r["experts_with_grad"] == (experts or 8), r
        assert r["shard_maps"] == 2, r            # the routed experts and their transpose ran in shard_maps


@pytest.mark.slow
def test_layouts_follow_rules(results):
    layouts = {(json.dumps(r["shape"]), r["rules"], r["experts"]): r["layout"] for r in results["cases"]}
    get = lambda shape, rules, experts=0: layouts[(json.dumps(shape), rules, experts)]
    assert get({"data": 8}, "serve") == [["data"], [], []]
    assert get({"data": 2, "expert": 4}, "serve") == [["data", "expert"], ["expert"], []]
    assert get({"data": 2, "tensor": 2, "expert": 2}, "serve") == [["data", "expert", "tensor"], ["expert"], ["tensor"]]
    assert get({"data": 2, "tensor": 2, "expert": 2}, "train") == [["data", "expert"], ["expert"], ["tensor"]]
    assert get({"data": 2, "expert": 4}, "serve", 6) == [["data", "expert"], [], []]   # experts replicated


@pytest.mark.slow
def test_indivisible_expert_axis_is_an_error(results):
    assert results["error"] is not None and "expert_axes" in results["error"] and "6 experts" in results["error"]


def test_layout_errors_name_the_field():
    import jax
    from dsv41 import sharding as sh
    from dsv41.errors import ConfigError
    from dsv41.nn.moe import ExpertLayout
    mesh = sh.make_mesh({}, devices=jax.devices()[:1])
    with pytest.raises(ConfigError, match="token_axes.*'batch'"):
        ExpertLayout(mesh, ("batch",), (), ())
    with pytest.raises(ConfigError, match="distinct mesh axes"):
        ExpertLayout(mesh, ("data",), ("expert",), ("expert",))


def test_one_device_mesh_runs_the_single_device_code():
    import jax
    import numpy as np
    from flax import nnx
    from dsv41 import sharding as sh
    cfg, layer = _layer()
    graph, state = nnx.split(layer)
    mesh = sh.make_mesh({}, devices=jax.devices()[:1])
    one = nnx.graphdef(_layer(0, sh.expert_layout(cfg, mesh, "serve"))[1])
    x = jax.random.normal(jax.random.key(0), (2, 5, cfg.architecture.hidden_size))
    plain = lambda x: nnx.capture(nnx.merge(graph, state), nnx.Intermediate)(x)[0]
    run = lambda x: nnx.capture(nnx.merge(one, state), nnx.Intermediate)(x)[0]

    assert "shard_map" not in str(jax.make_jaxpr(run)(x))
    np.testing.assert_array_equal(np.asarray(jax.jit(run)(x)), np.asarray(jax.jit(plain)(x)))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print(json.dumps({"checks": _checks}[sys.argv[1]]()))


def test_expert_forms_equal_float64_numpy():
    """Every form of the routed experts — ragged_dot (TPU/GPU), dense over the held experts (CPU) and one
    matmul per pick (FLOP counting) — equals a float64 NumPy sum over each token's picks; a pick naming an
    expert held elsewhere (id == G) contributes nothing. On CPU a one-token step takes the dense form, on
    every platform one whose expert group holds few tokens."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsv41.nn import moe
    from dsv41.nn.policy import FLOP_COUNTING, Policy
    rng = np.random.default_rng(0)
    n, k, g, d, i, limit = 7, 2, 4, 16, 8, 10.0
    x = rng.normal(size=(n, d)).astype(np.float32)
    w = rng.uniform(0.1, 1, (n, k)).astype(np.float32)
    idx = rng.integers(0, g + 1, (n, k)).astype(np.int32)     # g: held elsewhere
    w1, w3 = (rng.normal(size=(g, d, i)).astype(np.float32) * 0.3 for _ in range(2))
    w2 = rng.normal(size=(g, i, d)).astype(np.float32) * 0.3
    want = np.zeros((n, d))
    for t in range(n):
        for j in range(k):
            e = idx[t, j]
            if e == g:
                continue
            a, b = x[t].astype(np.float64) @ w1[e], x[t].astype(np.float64) @ w3[e]
            a, b = np.minimum(a, limit), np.clip(b, -limit, limit)
            want[t] += w[t, j] * ((a / (1 + np.exp(-a)) * b) @ w2[e])
    policy = Policy(jnp.float32, jnp.float32)
    cpu = jax.default_backend() == "cpu"
    assert [moe.expert_form(policy, s) for s in (1, 2, None)] == ["dense" if cpu else "ragged", "ragged", "ragged"]
    # A one-token step whose expert group holds at most DENSE_DECODE_TOKENS tokens is dense on every platform.
    few, many = moe.DENSE_DECODE_TOKENS, moe.DENSE_DECODE_TOKENS + 1
    assert [moe.expert_form(policy, 1, few), moe.expert_form(policy, 1, many), moe.expert_form(policy, 2, few)] == [
        "dense", "dense" if cpu else "ragged", "ragged"]
    assert moe.expert_form(Policy(jnp.float32, jnp.float32, lowering=FLOP_COUNTING)) == "per_pick"
    for form in ("ragged", "dense", "per_pick"):
        with jax.default_matmul_precision("highest"):
            got = np.asarray(moe.experts(jnp.asarray(x), jnp.asarray(w), jnp.asarray(idx), w1, w3, w2, limit=limit,
                                         policy=policy, form=form))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=form)
