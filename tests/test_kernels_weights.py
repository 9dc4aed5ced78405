"""The Pallas matmuls that read weights held as shipped (`kernels/weight_matmul.py`, issue 55): in interpret mode
they equal their plain-JAX references bit for bit on packed inputs, and both equal a dequantise-then-dot
(`dsv41.nn.weights.dequantize`, checked against ml_dtypes' grids in test_shipped_weights) within float32 rounding;
with libtpu they compile ahead of time for a TPU slice with V4.1-Flash's expert shapes."""

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41.kernels import weight_matmul as wm
from dsv41.nn import weights


def _bytes(a):
    return jax.lax.bitcast_convert_type(a, jnp.uint8)


def _fp8_weight(k, n, seed):
    w = jax.random.normal(jax.random.key(seed), (k, n)) * 0.05
    values, scales = weights.quantize("fp8", w)
    return values, scales


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("n", [72, 512])
def test_fp8_matmul_equals_its_reference_bit_for_bit(dtype, n):
    """K = 80 (an edge block, decoded in chunks of 32, 32 and 16), N = 72 (an edge block: one whole column tile) or
    512 (two tiles of 256), two row tiles."""
    m, k = 12, 80
    values, scales = _fp8_weight(k, n, 0)
    x = (jax.random.normal(jax.random.key(1), (m, k))).astype(dtype)
    tiles = dict(bm=8, bn=256, chunk=32)  # N = 512: two column tiles
    got = wm.fp8_matmul(x, _bytes(values), _bytes(scales), interpret=True, **tiles)
    ref = wm.fp8_matmul_reference(x, _bytes(values), _bytes(scales), **tiles)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    dense = jnp.dot(x.astype(jnp.float32), weights.dequantize("fp8", values, scales), precision="highest")
    # the same products (bf16 x: exact in float32), float32 sums in another order
    np.testing.assert_allclose(np.asarray(got), np.asarray(dense), rtol=0, atol=8e-6 * float(jnp.abs(dense).max()))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mxfp4_grouped_matmul_equals_its_reference_bit_for_bit(dtype):
    """Four experts of 64 inputs × 40 outputs, groups of 5, 0, 9 and 3 rows and two rows past them (zeros),
    against the reference and `lax.ragged_dot` over the dequantised weights."""
    g, k, n, sizes = 4, 64, 40, np.array([5, 0, 9, 3])
    m = int(sizes.sum()) + 2
    w = jax.random.normal(jax.random.key(2), (g, k, n)) * 0.05
    packed, scales = weights.quantize("mxfp4", w)
    x = jax.random.normal(jax.random.key(3), (m, k)).astype(dtype)
    tiles = dict(bm=8, bk2=512, bn=128)
    gs = jnp.asarray(sizes, jnp.int32)
    got = wm.mxfp4_gmm(x, packed, _bytes(scales), gs, interpret=True, **tiles)
    ref = wm.mxfp4_gmm_reference(x, packed, _bytes(scales), gs, **tiles)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    assert not np.asarray(got[-2:]).any()
    dense = jax.lax.ragged_dot(x.astype(jnp.float32), weights.dequantize("mxfp4", packed, scales), gs,
                               precision="highest")
    scale = float(jnp.abs(dense).max())
    np.testing.assert_allclose(np.asarray(got[:-2]), np.asarray(dense[:-2]), rtol=0, atol=8e-6 * scale)


@pytest.mark.parametrize("shared", [True, False])
def test_mxfp4_batched_matmul_equals_its_reference_bit_for_bit(shared):
    """Three experts of 1088 inputs (K/2 = 544: one whole packed-K tile) × 256 outputs (two column tiles of 128)
    over 5 rows, shared by every expert or each expert's own, against the reference and a batched einsum over
    the dequantised weights; then K/2 = 1024 in two K tiles of 512."""
    for k, bk2 in ((1088, 512), (2048, 512)):
        g, n, m = 3, 256, 5
        w = jax.random.normal(jax.random.key(4), (g, k, n)) * 0.05
        packed, scales = weights.quantize("mxfp4", w)
        x = jax.random.normal(jax.random.key(5), (1 if shared else g, m, k)).astype(jnp.bfloat16)
        tiles = dict(bk2=bk2, bn=128)
        got = wm.mxfp4_bmm(x, packed, _bytes(scales), interpret=True, **tiles)
        ref = wm.mxfp4_bmm_reference(x, packed, _bytes(scales), **tiles)
        assert got.shape == (g, m, n)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
        dense = jnp.einsum("gmk,gkn->gmn", jnp.broadcast_to(x.astype(jnp.float32), (g, m, k)),
                           weights.dequantize("mxfp4", packed, scales), precision="highest")
        np.testing.assert_allclose(np.asarray(got), np.asarray(dense), rtol=0, atol=8e-6 * float(jnp.abs(dense).max()))


@pytest.mark.parametrize("form", ["ragged", "dense"])
def test_routed_experts_through_the_kernels_equal_float64(form):
    """`moe.experts` over MXFP4 experts held as shipped (`weights.Stored`), prefill's ragged form (the grouped
    matmul) and decode's dense form (the batched matmul) with `runtime.kernels=pallas_interpret`, against the
    XLA path (the same weights dequantised in the program) and NumPy in float64 over `weights.dequantize`."""
    from dsv41.nn import moe
    from dsv41.nn.policy import Policy

    g, n, k, d, i, limit = 3, 6, 2, 64, 64, 10.0
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, d)).astype(np.float32)
    gate = rng.uniform(0.1, 1, (n, k)).astype(np.float32)
    idx = rng.integers(0, g + 1, (n, k)).astype(np.int32)          # g: an expert held elsewhere
    held = [weights.Stored(*weights.quantize("mxfp4", jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32)), "mxfp4")
            for s in ((g, d, i), (g, d, i), (g, i, d))]
    w1, w3, w2 = (np.asarray(weights.dequantize("mxfp4", w.values, w.scales), np.float64) for w in held)
    want = np.zeros((n, d))
    for t in range(n):
        for j in range(k):
            e = idx[t, j]
            if e < g:
                a, b = np.minimum(x[t] @ w1[e], limit), np.clip(x[t] @ w3[e], -limit, limit)
                want[t] += gate[t, j] * ((a / (1 + np.exp(-a)) * b) @ w2[e])
    got = {}
    for kernels in ("pallas_interpret", "reference"):
        policy = Policy(jnp.float32, jnp.float32, weight_format="shipped", kernels=kernels)
        run = lambda x, gate, idx: moe.experts(x, gate, idx, *held, limit=limit, policy=policy, form=form)
        args = (jnp.asarray(x), jnp.asarray(gate), jnp.asarray(idx))
        kernel = {"ragged": "mxfp4_grouped_matmul", "dense": "mxfp4_batched_matmul"}[form]
        assert (kernel in str(jax.make_jaxpr(run)(*args))) == (kernels == "pallas_interpret"), kernels
        got[kernels] = np.asarray(run(*args))
    scale = np.abs(want).max()
    np.testing.assert_allclose(got["pallas_interpret"], got["reference"], rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(got["pallas_interpret"], want, rtol=0, atol=1e-5 * scale)


def test_bad_operands_are_refused_by_name():
    values, scales = _fp8_weight(64, 64, 0)
    x = jnp.ones((4, 64))
    with pytest.raises(ValueError, match=r"scales: dtype float8_e8m0fnu: expected uint8 bytes"):
        wm.fp8_matmul(x, _bytes(values), scales, interpret=True)
    with pytest.raises(ValueError, match=r"expected \[64, N\] and \[2, 2\] for x \(4, 64\)"):
        wm.fp8_matmul(x, _bytes(values), _bytes(scales)[:1], interpret=True)
    packed, s4 = weights.quantize("mxfp4", jnp.ones((2, 64, 32)))
    with pytest.raises(ValueError, match=r"group_sizes \(3,\): expected \(2,\)"):
        wm.mxfp4_gmm(x, packed, _bytes(s4), jnp.array([1, 1, 2]), interpret=True)
    with pytest.raises(ValueError, match=r"x \(3, 4, 64\): expected \[1, M, K\] \(the same rows for every expert\) or \[2, M, K\]"):
        wm.mxfp4_bmm(jnp.ones((3, 4, 64)), packed, _bytes(s4), interpret=True)


_AOT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from dsv41.kernels import weight_matmul as wm

    topo = topologies.get_topology_desc(topology_name=sys.argv[1], platform="tpu")
    mesh = Mesh(np.array(topo.devices).reshape(-1), ("data",))
    d = len(topo.devices)
    u8, bf16, i32 = jnp.uint8, jnp.bfloat16, jnp.int32

    def compile_sharded(f, *shapes):
        g = jax.shard_map(f, mesh=mesh, in_specs=tuple(P("data") for _ in shapes), out_specs=P("data"),
                          check_vma=False)
        args = [jax.ShapeDtypeStruct((d * s[0][0], *s[0][1:]), s[1], sharding=NamedSharding(mesh, P("data")))
                for s in shapes]
        c = jax.jit(g).lower(*args).compile()
        mem, cost = c.memory_analysis(), c.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return {"argument_bytes": mem.argument_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
                "flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed"),
                "mosaic": c.as_text().count("tpu_custom_call")}

    D, I, E = 5120, 2304, 48   # V4.1-Flash: hidden, expert width, experts per chip on v5p:2x2x2
    report = {"device_kind": topo.devices[0].device_kind}
    report["fp8_matmul"] = compile_sharded(
        lambda x, w, s: wm.fp8_matmul(x[0], w[0], s[0], out_dtype=bf16)[None],
        ((1, 32, D), bf16), ((1, D, 1280), u8), ((1, D // 32, 1280 // 32), u8))
    report["mxfp4_gmm"] = compile_sharded(
        lambda x, p, s, gs: wm.mxfp4_gmm(x[0], p[0], s[0], gs[0], out_dtype=bf16)[None],
        ((1, 256, D), bf16), ((1, E, D // 2, I), u8), ((1, E, D // 32, I), u8), ((1, E), i32))
    report["mxfp4_bmm"] = compile_sharded(
        lambda x, p, s: wm.mxfp4_bmm(x[0], p[0], s[0], out_dtype=bf16)[None],
        ((1, 1, 32, D), bf16), ((1, E, D // 2, I), u8), ((1, E, D // 32, I), u8))
    report["mxfp4_bmm_down"] = compile_sharded(
        lambda x, p, s: wm.mxfp4_bmm(x[0], p[0], s[0], out_dtype=bf16)[None],
        ((1, E, 32, I), bf16), ((1, E, I // 2, D), u8), ((1, E, I // 32, D), u8))
    print("REPORT" + json.dumps(report))
""")


@pytest.mark.slow
def test_weight_matmuls_compile_ahead_of_time_for_v5p():
    pytest.importorskip("libtpu")
    run = subprocess.run([sys.executable, "-c", _AOT, "v5p:2x2x2"], capture_output=True, text=True, timeout=900)
    lines = [line for line in run.stdout.splitlines() if line.startswith("REPORT")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    report = json.loads(lines[-1][len("REPORT"):])
    for name in ("fp8_matmul", "mxfp4_gmm", "mxfp4_bmm", "mxfp4_bmm_down"):
        stats = report[name]
        assert stats["mosaic"] >= 1 and stats["flops"] > 0 and stats["argument_bytes"] > 0, (name, stats)
    # decode's dense experts move their weights once and the rows a few times (read x, write its even and odd
    # inputs, the kernel reads them), nothing else: the closed count, bf16 x and out, one byte a weight pair/scale
    D, I, E = 5120, 2304, 48
    for name, (x, k, n) in {"mxfp4_bmm": (32 * D, D, I), "mxfp4_bmm_down": (E * 32 * I, I, D)}.items():
        moved = E * k // 2 * n + E * k // 32 * n + 3 * 2 * x + 2 * E * 32 * n
        assert report[name]["bytes_accessed"] <= 1.01 * moved, (name, report[name], moved)
    print(json.dumps(report, indent=1))
