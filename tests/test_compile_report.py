"""compile_report: AOT-compile a small decode for a TPU topology through libtpu (skipped without libtpu)."""

from __future__ import annotations

import math
import re

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


def test_weight_copies_finds_fusions_that_only_widen_a_narrow_array():
    """A fusion whose computation converts an FP8 parameter (sliced, bitcast) into a bf16 copy counts, once per
    call site with its output's bytes; a dot fusion that reads FP8 weights, a convert of a bf16 array and a
    copy under the threshold do not."""
    hlo = "\n".join([
        "%widen (p0: f8e4m3fn[2,48,64,32], p1: s32[]) -> bf16[48,64,32] {",
        "  %p0 = f8e4m3fn[2,48,64,32]{3,2,1,0} parameter(0)",
        "  %ds = f8e4m3fn[1,48,64,32]{3,2,1,0} dynamic-slice(%p0, %p1), dynamic_slice_sizes={1,48,64,32}",
        "  %cv = bf16[1,48,64,32]{3,2,1,0} convert(%ds)",
        "  ROOT %bc = bf16[48,64,32]{2,1,0} bitcast(%cv)",
        "}",
        "%matmul (p0: bf16[8,64], p1: f8e4m3fn[64,32]) -> f32[8,32] {",
        "  %cv = bf16[64,32]{1,0} convert(%p1)",
        "  ROOT %d = f32[8,32]{1,0} dot(%p0, %cv), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        "}",
        "%wide_bf16 (p0: bf16[64,32]) -> f32[64,32] {",
        "  ROOT %cv = f32[64,32]{1,0} convert(%p0)",
        "}",
        "ENTRY %main (w: f8e4m3fn[2,48,64,32], i: s32[]) -> f32[8,32] {",
        "  %a = bf16[48,64,32]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%widen",
        "  %b = bf16[48,64,32]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%widen",
        "  %c = f32[8,32]{1,0} fusion(%x, %y), kind=kOutput, calls=%matmul",
        "  %e = f32[64,32]{1,0} fusion(%z), kind=kLoop, calls=%wide_bf16",
        "}",
    ])
    copy = 48 * 64 * 32 * 2
    assert cr.weight_copies(hlo) == {"ops": 2, "bytes": 2 * copy}
    assert cr.weight_copies(hlo, min_bytes=copy + 1) == {"ops": 0, "bytes": 0}


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
    d["architecture"]["engram"] = {"layers": [1], "max_ngram": 3, "heads_per_ngram": 2, "row_dim": 256,
                                   "compressed_vocab_size": 256, "prime_floor": 100, "pad_id": 2}
    cfg = config_lib.build(d)
    r = cr.compile_report(cfg, "v5p:2x2x2", 8, 64, "shipped", breakdown=6)
    chips = 8
    assert (r["chips"], r["mesh"]) == (chips, {"expert": chips})
    m = r["decode"]["memory_per_chip"]
    # A step reads every parameter on its chip at least once; the roofline is params + cache.
    b = r["decode"]["bytes_per_chip"]
    assert b["roofline"] == m["params_on_device"] + m["cache"]
    assert b["accessed"] >= m["params_on_device"] and math.isclose(b["ratio"], b["accessed"] / b["roofline"])
    scopes = [row["scope"] for row in r["decode"]["breakdown"]["by_scope"]]
    assert any(sc.endswith("moe") or "/moe/" in sc for sc in scopes), scopes   # the named scopes label the ops
    assert len(r["decode"]["breakdown"]["top_bytes"]) == 6
    # XLA counts every matmul the closed formula does, and the elementwise work beside them.
    a = r["decode"]["analytic_flops_per_token"]
    assert 1.0 <= a["xla_over_analytic"] < 1.5 and a["weighted"] < a["matmul"], a
    rows = dsv41.engram_hash.EngramLayout.from_config(cr.report_config(cfg, "shipped", "reference")).rows_per_layer[0]
    # One FP8 table as released (rows of 256 as at full size, and a UE8M0 scale per 32: 264 bytes a row; libtpu
    # 0.0.x aborts laying out a host table of one scale a row), its prime number of rows padded to a multiple of
    # the chips and split over them: each chip's host holds 1/8; v5p:2x2x2 is two hosts of 4 chips, so each
    # holds half.
    padded = -(-rows // chips) * chips
    assert padded > rows and m["engram_host"] == padded // chips * 264
    assert m["engram_host_per_host"] == 4 * m["engram_host"] == padded * 264 // 2
    assert m["total"] >= m["arguments"] > 0 and m["fits"]
    assert r["decode"]["flops_per_token"] > 0 and r["decode"]["compile_s"] > 0
    # Experts split over 8 chips: each holds an eighth of the routed experts' bytes and all of the rest, in the
    # release's formats (test_shipped_weights' formula: FP8 R·C + ⌈R/32⌉·⌈C/32⌉ scales, MXFP4 R·C/2 + R/32·C,
    # the other parameters bf16 / fp32 as the bf16 model keeps them).
    import jax
    import numpy as np
    from test_shipped_weights import FP8, MXFP4
    plain = cr.report_config(cfg, "bf16", "reference")
    whole, experts = 0, 0
    for path, x in jax.tree_util.tree_leaves_with_path(dsv41.model.abstract_params(plain)):
        name = re.sub(r"\.+value$", "", ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path))
        if "engram" in name and "table" in name:
            continue
        *lead, rows_, cols = x.shape if x.ndim >= 2 else (1, 1, 1)
        n = math.prod(lead)
        size = (n * (rows_ * cols + math.ceil(rows_ / 32) * math.ceil(cols / 32)) if FP8.search(name) else
                n * (rows_ * cols // 2 + rows_ // 32 * cols) if MXFP4.search(name) else x.size * x.dtype.itemsize)
        whole += size
        # routed w1/w3/w2, the router gate and its balance bias carry the experts axis
        experts += size if MXFP4.search(name) or name.endswith("ffn.gate") or name.endswith("ffn.bias") else 0
    assert m["params_on_device"] == whole - experts * (chips - 1) // chips
    assert math.isclose(r["decode"]["flops_per_token"] * 8, r["decode"]["flops_per_chip"] * chips)


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
    # The closed per-layer count beside it grows too, and its Full layers' scoring at least by the formula.
    assert rows[1]["analytic"]["flops_relative"] > 1.0 and rows[0]["analytic"]["weighted_relative"] == 1.0


@pytest.mark.slow
def test_decode_with_pallas_kernels_compiles_for_v5p():
    """runtime.kernels=pallas in an ahead-of-time TPU compile on this CPU machine: the kernels follow the
    mesh's platform (not JAX's CPU backend) and run per device inside shard_maps; the program holds them."""
    _in_subprocess("pallas")


def _pallas_check():
    from test_sharding import small_config
    r = cr.compile_report(small_config(), "v5p:2x2x1", 8, 128, "shipped", kernels="pallas")
    d = r["decode"]
    assert d["memory_per_chip"]["fits"] and d["flops_per_token"] > 0
    # One sparse-attention kernel per traced layer body (the window-only scan, layers 2, 3 and 4) and the
    # indexer scores of the Full layers 2 and 3 and the Reindex layer 4's pool (XLA's ragged-dot kernels,
    # Mosaic custom calls too, are not counted; decode has none, below).
    # Beside them the matmuls of the weights held as shipped (FP8 blocks, MXFP4 experts) run as Pallas kernels.
    assert d["weight_kernels"] > 0 and d["pallas_kernels"] == 7 + d["weight_kernels"], d
    # Decode runs the experts dense (few tokens per expert group): no bf16 copy of a held weight, where
    # ragged_dot's TPU kernel had 12 here (2 experts x 3 matrices x 2 stacks per chip, 8 KiB each).
    assert d["weight_copies_per_chip"] == {"ops": 0, "bytes": 0}
    assert d["experts"] == {"form": "dense", "group_tokens": 8}    # batch 8, every chip on `expert`


if __name__ == "__main__":
    import json
    import sys
    {"engram": _engram_check, "pallas": _pallas_check}[sys.argv[1]]()
    print(json.dumps({"ok": True}))


@pytest.mark.slow  # full-size V4.1-Flash decode compiled for v5p:2x2x2 (about 2 minutes, 2.5 GB)
def test_the_readme_compile_report_block_runs_as_written(tmp_path):
    """The README's `dsv41 compile-report` line as written, in a fresh process, and the per-chip memory and HBM
    ratio it quotes are the ones printed (libtpu pinned by constraints.txt: the compile is deterministic)."""
    pytest.importorskip("libtpu")
    import readme

    out = readme.run_bash(readme.block("Compile for TPU (ahead of time, on this machine)"), readme.workdir(tmp_path),
                          timeout=1200)
    assert out.returncode == 0, readme.failure(out)
    memory = ("arguments 45.99 GiB (params 42.66 GiB, cache 3.33 GiB), temporaries 2.11 GiB, total 48.10 GiB of "
              "95.00 GiB HBM — fits")
    text = " ".join((readme.ROOT / "README.md").read_text().split())
    assert memory in text and "roofline (3.20× today" in text and "48.10 of 95 GiB per chip" in text
    assert f"per chip: {memory}" in out.stdout, out.stdout
    assert "3.20× the roofline" in out.stdout and "widened into copies of 4 KiB or more: 6 ops, 0.00 GiB" in out.stdout, \
        out.stdout
