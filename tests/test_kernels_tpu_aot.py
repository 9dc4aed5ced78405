"""The TPU (Mosaic) variants of the kernels compile ahead of time for two TPU generations (DESIGN §8, §9).

`jax.experimental.topologies` gives the devices of a TPU slice on a CPU machine when libtpu is installed
(the `tpu` extra); each kernel is wrapped in `jax.shard_map` over the slice (a Pallas TPU kernel cannot be
partitioned by XLA) and compiled; the compiled program must report its memory and its cost. Full-size
shapes: K = 512, 64 heads, window 128, top-512 picks. The compilation runs in a subprocess: initialising
libtpu in the test process would make every later CPU test probe for TPU hardware first.
"""

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("libtpu")

TOPOLOGIES = ("v5e:2x2", "v5p:2x2x2")

_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from dsv41.kernels import quant_pack as qp, sparse_attention as sa

    topo = topologies.get_topology_desc(topology_name=sys.argv[1], platform="tpu")
    mesh = Mesh(np.array(topo.devices).reshape(-1), ("data",))
    d = len(topo.devices)

    def compile_sharded(f, *shapes):
        g = jax.shard_map(f, mesh=mesh, in_specs=tuple(P("data") for _ in shapes), out_specs=P("data"),
                          check_vma=False)
        args = [jax.ShapeDtypeStruct((d * s[0][0], *s[0][1:]), s[1], sharding=NamedSharding(mesh, P("data")))
                for s in shapes]
        c = jax.jit(g).lower(*args).compile()
        mem, cost = c.memory_analysis(), c.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return {"argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
                "temp_bytes": mem.temp_size_in_bytes, "code_bytes": mem.generated_code_size_in_bytes,
                "flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed")}

    u8, f32, i32 = jnp.uint8, jnp.float32, jnp.int32
    B, H, K, W, N, k = 2, 64, 512, 128, 4096, 512
    report = {"device_kind": topo.devices[0].device_kind, "devices": d}
    for fmt in qp.FORMATS:
        report["quantize_pack_" + fmt] = compile_sharded(
            lambda x, fmt=fmt: qp.quantize_pack(x, fmt, backend="tpu"), ((1024, K), f32))
        kv = K // 2 if fmt != "fp8_ue8m0_32" else K
        report["unpack_dequantize_" + fmt] = compile_sharded(
            lambda v, s, fmt=fmt: qp.unpack_dequantize(v, s, fmt, backend="tpu"),
            ((1024, kv), u8), ((1024, K // qp.quant.BLOCK[fmt]), u8))

    def decode(q, wv, ws, ok, ev, es, picks, sink):
        return sa.sparse_decode_attention(q, wv, ws, ok, ev, es, picks, sink[0], K ** -0.5, backend="tpu")

    report["sparse_decode_attention"] = compile_sharded(
        decode, ((B, H, K), jnp.bfloat16), ((B, W, K), u8), ((B, W, K // 32), u8), ((B, W), jnp.bool_),
        ((B, N, K // 2), u8), ((B, N, K // 16), u8), ((B, k), i32), ((1, H), f32))

    # The training forward's attention (issue 22): the chunk kernel's forward and the reference's gradients, for
    # 512 queries of a row against their window band (512 + 128 keys) and top-512 picks, differentiated.
    S, Tw = 512, 512 + W

    def train_attention(q, win, ok, ent, eb, es, picks, sink):
        def loss(q, win, ent):
            out = sa.sparse_attention_train(q, win, ok, ent, eb, es, picks, sink[0], K ** -0.5,
                                            kernel=lambda *a: sa.sparse_attention(*a, backend="tpu"))
            return jnp.sum(out.astype(f32))
        dq, dwin, dent = jax.grad(loss, argnums=(0, 1, 2))(q, win, ent)
        return dq.astype(f32) + jnp.sum(dwin) + jnp.sum(dent)

    bf16 = jnp.bfloat16
    report["sparse_attention_train"] = compile_sharded(
        train_attention, ((B, S, H, K), bf16), ((B, Tw, K), bf16), ((B, S, Tw), jnp.bool_), ((B, N, K), bf16),
        ((B, N, K // 2), u8), ((B, N, K // 16), u8), ((B, S, k), i32), ((1, H), f32))
    print("REPORT" + json.dumps(report))
""")


@pytest.mark.slow
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_tpu_kernels_compile_ahead_of_time(topology):
    run = subprocess.run([sys.executable, "-c", _SCRIPT, topology], capture_output=True, text=True, timeout=900)
    lines = [line for line in run.stdout.splitlines() if line.startswith("REPORT")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    report = json.loads(lines[-1][len("REPORT"):])
    kernels = [name for name in report if name not in ("device_kind", "devices")]
    assert len(kernels) == 8
    for name in kernels:
        stats = report[name]
        assert stats["argument_bytes"] > 0 and stats["output_bytes"] > 0, (name, stats)
        assert stats["flops"] > 0 and stats["bytes_accessed"] > 0, (name, stats)
    print(topology, json.dumps(report, indent=1))
