"""compile_report: AOT-compile a small decode for a TPU topology through libtpu (skipped without libtpu)."""

from __future__ import annotations

import math

import pytest

from dsv41 import compile_report as cr


def test_collective_bytes_reads_hlo_shapes():
    hlo = "\n".join([
        "  %all-reduce.1 = f32[8,128]{1,0} all-reduce(f32[8,128]{1,0} %x), replica_groups={}",
        "  %ag = (bf16[4,64]{1,0}, bf16[4,64]{1,0}) all-gather-start(bf16[1,64]{1,0} %y), dimensions={0}",
        "  %agd = bf16[4,64]{1,0} all-gather-done((bf16[4,64]{1,0}, bf16[4,64]{1,0}) %ag)",
        "  %add = f32[8]{0} add(f32[8]{0} %a, f32[8]{0} %b)",
    ])
    out = cr.collective_bytes(hlo)
    assert out["all-reduce"] == {"ops": 1, "bytes": 8 * 128 * 4}
    assert out["all-gather"] == {"ops": 1, "bytes": 2 * 4 * 64 * 2}   # the start's tuple, the done not again
    assert set(out) == {"all-reduce", "all-gather"}


def _in_subprocess(check: str):
    """Runs a check below in a fresh process: libtpu (and the Mosaic compiler the kernels bring) stays out
    of the pytest process, whose later tests compile for the CPU."""
    pytest.importorskip("libtpu")
    from conftest import run_on_devices
    assert run_on_devices(__file__, check, devices=1, timeout=900) == {"ok": True}


@pytest.mark.slow
def test_decode_compiles_for_v5p_with_engram_in_host_memory():
    _in_subprocess("engram")


def _engram_check():
    import dsv41
    from dsv41 import config as config_lib
    from test_sharding import small_config
    d = small_config().to_dict()
    d["architecture"]["engram"] = {"layers": [1], "max_ngram": 3, "heads_per_ngram": 2, "row_dim": 16,
                                   "compressed_vocab_size": 256, "prime_floor": 100, "pad_id": 2}
    cfg = config_lib.build(d)
    r = cr.compile_report(cfg, "v5p:2x2x1", 8, 64, "fp8")
    assert (r["chips"], r["mesh"]) == (4, {"expert": 4})
    m = r["decode"]["memory_per_chip"]
    rows = dsv41.engram_hash.EngramLayout.from_config(cr.report_config(cfg, "fp8", "reference")).rows_per_layer[0]
    assert m["engram_host"] == rows * 16 * 2               # one bf16 table, whole on each chip's host
    assert m["total"] >= m["arguments"] > 0 and m["fits"]
    assert r["decode"]["flops_per_token"] > 0 and r["decode"]["compile_s"] > 0
    # Experts split over 4 chips: each holds a quarter of the routed experts' fp8 bytes and all of the rest
    # (fp8: one byte per matrix entry except the bf16 embedding; vectors bf16/fp32 as the model keeps them).
    import jax
    import numpy as np
    a = cfg.architecture
    # routed w1/w3/w2 and the router gate (fp8) and its balance bias (fp32) all carry the experts axis
    experts = len(dsv41.layer_plan(cfg)) * a.moe.num_experts * (3 * a.hidden_size * a.moe.intermediate_size
                                                                + a.hidden_size + 4)
    whole = 0
    for path, x in jax.tree_util.tree_leaves_with_path(dsv41.model.abstract_params(cr.report_config(cfg, "fp8", "reference"))):
        name = jax.tree_util.keystr(path)
        if "engram" in name and "table" in name:
            continue
        fp8 = x.dtype == np.dtype("bfloat16") and x.ndim >= 2 and "embed'" not in name.split("]")[0]
        whole += x.size * (1 if fp8 else x.dtype.itemsize)
    assert m["params_on_device"] == whole - experts * 3 // 4
    assert math.isclose(r["decode"]["flops_per_token"] * 8, r["decode"]["flops_per_chip"] * 4)


def test_context_sweep_reindex_pool_saves_what_scoring_everything_costs():
    """The sweep's two variants differ by the Reindex layers' indexer scoring: scoring every entry grows by
    at least 2 · ΔT/ratio · heads · dim FLOPs per Reindex layer (the q·k products alone, a closed formula),
    the pool gather by none of that."""
    import dsv41
    from test_sharding import small_config
    from dsv41 import config as config_lib
    cfg = config_lib.build(small_config().to_dict(), ["context_window=1024", "architecture.rope.max_position=1024"])
    rows = cr.context_sweep(cfg, [256, 1024], batch=2, weights="bf16")
    reindex = [r for r in dsv41.layer_plan(cfg) if r.mode == "reindex"]
    assert reindex and rows[0]["relative_to_4k"] == 1.0
    ix = cfg.csa2.indexer
    scoring = sum(2 * (1024 - 256) // r.ratio * ix.query_heads * ix.head_dim for r in reindex)
    grow_pool = rows[1]["flops_per_token"] - rows[0]["flops_per_token"]
    grow_all = rows[1]["score_everything_flops_per_token"] - rows[0]["score_everything_flops_per_token"]
    assert grow_all - grow_pool >= scoring, (grow_all, grow_pool, scoring)
    assert rows[1]["score_everything_relative_to_4k"] > rows[1]["relative_to_4k"] > 1.0


@pytest.mark.slow
def test_decode_with_pallas_kernels_compiles_for_v5p():
    """runtime.kernels=pallas in an ahead-of-time TPU compile on this CPU machine: the kernels follow the
    mesh's platform (not JAX's CPU backend) and run per device inside shard_maps; the program holds them."""
    _in_subprocess("pallas")


def _pallas_check():
    from test_sharding import small_config
    r = cr.compile_report(small_config(), "v5p:2x2x1", 8, 128, "fp8", kernels="pallas")
    d = r["decode"]
    assert d["memory_per_chip"]["fits"] and d["flops_per_token"] > 0
    assert d["pallas_kernels"] >= 8, d["pallas_kernels"]   # 5 attention, 2 indexer/pool, 1 Reindex pool


if __name__ == "__main__":
    import json
    import sys
    {"engram": _engram_check, "pallas": _pallas_check}[sys.argv[1]]()
    print(json.dumps({"ok": True}))
