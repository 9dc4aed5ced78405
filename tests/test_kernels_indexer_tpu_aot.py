"""The indexer kernels' Mosaic bodies compile for real TPUs, ahead of time on this CPU machine (DESIGN §8).

Needs libtpu (`pip install -e ".[tpu]"`, e.g. /work/venv-tpu); skipped without it. The compile runs in a
subprocess: libtpu takes a process-wide lock and a TPU topology in the pytest process would change the
backend the other tests run on. Each kernel is wrapped in `jax.shard_map` over the topology's devices
(one row per device), as a Pallas TPU kernel must be on a multi-device mesh.

Besides compiling, it checks what would silently cost bandwidth on hardware: the compiled program holds
no copy of the uint8 key store (a relayout of the whole store per call), and its temporaries stay small.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

TOPOLOGIES = ["v5p:2x2x2", "v6e:2x2"]

SCRIPT = textwrap.dedent('''
    import functools, json, re, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec as P
    from dsv41.kernels import candidate_pool as cp, indexer_scores as isc

    topo = topologies.get_topology_desc(topology_name=sys.argv[1], platform="tpu")
    mesh = jax.sharding.Mesh(np.array(topo.devices).reshape(-1), ("x",))
    rows, J, D, T = len(topo.devices), 32, 128, 65536      # one row per chip, 64K entries each

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("x")))

    def compile_sharded(fn, *args):
        sharded = jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
        compiled = jax.jit(sharded).lower(*args).compile()
        hlo = compiled.as_text()
        mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
        return dict(temp_bytes=mem.temp_size_in_bytes, argument_bytes=mem.argument_size_in_bytes,
                    output_bytes=mem.output_size_in_bytes, flops=cost.get("flops"),
                    bytes_accessed=cost.get("bytes accessed"),
                    store_copies=len(re.findall(r"= u8\\[[^\\]]*\\][^ ]* copy\\(", hlo)),
                    mosaic="tpu_custom_call" in hlo)

    store = (arg((rows, T, D // 2), jnp.uint8), arg((rows, T, D // 32), jnp.uint8))
    out = {}
    for s, dtype in [(1, jnp.bfloat16), (16, jnp.float32)]:
        out[f"indexer_scores S={s} {jnp.dtype(dtype).name} +pool"] = compile_sharded(
            lambda q, w, k, sc, p: isc.indexer_scores(q, w, k, sc, p, 1, pool_block=8),
            arg((rows, s, J, D), dtype), arg((rows, s, J), jnp.float32), *store, arg((rows, s), jnp.int32))
    out["pool_scores S=1 bfloat16 2048 blocks"] = compile_sharded(
        lambda q, w, k, sc, ids, p: cp.pool_scores(q, w, k, sc, ids, 8, p, 1),
        arg((rows, 1, J, D), jnp.bfloat16), arg((rows, 1, J), jnp.float32), *store,
        arg((rows, 1, 2048), jnp.int32), arg((rows, 1), jnp.int32))
    # A store that ends inside a 128-entry tile (a 1M-token cache: 1,000,000 decoder entries): its last tile
    # comes from a padded copy of that tile alone, never from a copy of the store.
    ragged = (arg((rows, T + 64, D // 2), jnp.uint8), arg((rows, T + 64, D // 32), jnp.uint8))
    out["pool_scores S=1 bfloat16 2048 blocks, T + 64 entries"] = compile_sharded(
        lambda q, w, k, sc, ids, p: cp.pool_scores(q, w, k, sc, ids, 8, p, 1),
        arg((rows, 1, J, D), jnp.bfloat16), arg((rows, 1, J), jnp.float32), *ragged,
        arg((rows, 1, 2048), jnp.int32), arg((rows, 1), jnp.int32))
    print("RESULT " + json.dumps(out))
''')


def _compile(topology: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, topology], capture_output=True, text=True,
                          env=env, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_indexer_kernels_compile_for_tpu(topology):
    results = _compile(topology)
    print(topology, json.dumps(results, indent=1))
    assert len(results) == 4
    for name, r in results.items():
        assert r["mosaic"], name
        assert r["store_copies"] == 0, (name, "the key store is relaid out on every call")
        # Per chip: a 64K-entry store is 4.4 MiB; the kernels' temporaries are the outputs' size at most.
        assert r["temp_bytes"] < 8 * 2**20, (name, r["temp_bytes"])
        assert r["flops"] >= 2 * 65536 * 32 * 128 or name.startswith("pool"), (name, r["flops"])
