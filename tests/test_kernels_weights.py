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
    print("REPORT" + json.dumps(report))
""")


@pytest.mark.slow
def test_weight_matmuls_compile_ahead_of_time_for_v5p():
    pytest.importorskip("libtpu")
    run = subprocess.run([sys.executable, "-c", _AOT, "v5p:2x2x2"], capture_output=True, text=True, timeout=900)
    lines = [line for line in run.stdout.splitlines() if line.startswith("REPORT")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    report = json.loads(lines[-1][len("REPORT"):])
    for name in ("fp8_matmul", "mxfp4_gmm"):
        stats = report[name]
        assert stats["mosaic"] >= 1 and stats["flops"] > 0 and stats["argument_bytes"] > 0, (name, stats)
    print(json.dumps(report, indent=1))
