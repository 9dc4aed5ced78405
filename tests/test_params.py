"""Parameter counts against closed formulas of the published dimensions (DESIGN §2)."""

import json
import subprocess
import sys

import pytest
from flax import nnx

import dsv41
from dsv41 import model, params, stacking


def v41_formula(cfg):
    """Per-component counts written out from the dimensions, layer by layer from the plan's modes."""
    a, ix = cfg.architecture, cfg.csa2.indexer
    D, q, H, K, G, R, V = a.hidden_size, a.q_lora_rank, a.num_heads, a.head_dim, a.o_groups, a.o_lora_rank, a.vocab_size
    E, I, N = a.moe.num_experts, a.moe.intermediate_size, a.mhc.streams
    J, dI = ix.query_heads, ix.head_dim
    out = dict.fromkeys(params.COMPONENTS, 0)
    out["embeddings"] = 2 * V * D
    out["norms"] = D
    for r in dsv41.layer_plan(cfg):
        out["attention"] += D * q + q + q * H * K + D * K + K + H * K * R + G * R * D + H
        out["norms"] += 2 * D
        out["mhc"] += 2 * ((2 + N) * N * N * D + (2 + N) * N + 3)
        out["router"] += D * E + E
        out["moe_routed"] += 3 * E * D * I
        out["moe_shared"] += 3 * D * I * a.moe.num_shared_experts
        if r.mode == "full":
            out["compressor"] += D * K * (2 if r.ratio > 1 else 1) + K
            out["indexer"] += q * J * dI + D * J + K * dI + dI
        elif r.mode == "reindex":
            out["indexer"] += q * J * dI + D * J
        if r.engram:
            cols = (a.engram.max_ngram - 1) * a.engram.heads_per_ngram
            out["engram_other"] += cols * a.engram.row_dim * (N + 1) * D + 2 * N * D
    return {k: v for k, v in out.items() if v}


@pytest.mark.parametrize("name", ["v41_flash", "tiny", "small"])
def test_counts_match_the_closed_formula(name):
    cfg = dsv41.load_config(name)
    counts = params.count_params(cfg)["components"]
    expected = v41_formula(cfg)
    assert {k: v for k, v in counts.items() if k != "engram_tables"} == expected


def test_full_size_against_the_published_figures():
    counts = params.count_params(dsv41.load_config("v41_flash"))
    assert counts["engram_tables"] == (384_006_168 + 384_016_682) * 256
    assert abs(counts["backbone"] / 552e9 - 1) < 0.005
    assert abs(counts["engram_tables"] / 196e9 - 1) < 0.005
    assert abs(counts["active_per_token"] / 16e9 - 1) < 0.05  # "~16B per generated token"


def test_reuse_layers_own_no_kv_or_indexer_parameters():
    cfg = dsv41.load_config("v41_flash")
    owned = {}
    for path, _ in stacking.per_layer(model.abstract_params(cfg), cfg):
        if path[0] == "layers" and path[2] == "attn" and path[3] in ("compressor", "indexer"):
            owned.setdefault(path[1], set()).add(path[3] if path[3] == "compressor" else "/".join(map(str, path[3:5])))
    for r in dsv41.layer_plan(cfg):
        got = owned.get(r.index, set())
        if r.mode in ("reuse", "window"):
            assert got == set(), r
        elif r.mode == "reindex":
            assert got == {"indexer/weights_proj", "indexer/wq_b"}, r
        else:
            assert got == {"compressor", "indexer/weights_proj", "indexer/wq_b", "indexer/wk", "indexer/k_norm"}, r


def test_params_command_json():
    out = subprocess.run([sys.executable, "-m", "dsv41", "params", "--config", "v41_flash", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["engram_tables"] == (384_006_168 + 384_016_682) * 256
    assert report["published"] == {"backbone": 552e9, "engram_tables": 196e9}
