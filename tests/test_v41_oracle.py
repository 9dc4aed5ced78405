"""DeepSeek-V4.1 against the public port's vectors (tests/data/v41_port_case{A,B}.npz, from
../shared/oracle; README there). Compared in the README's order: Engram ids exactly, then the
selections except where the stored margin is tiny, then the logits row by row."""

import jax
import numpy as np
import pytest

import dsv41
from dsv41 import model
from conftest import load_port_case

LOGIT_TOL = 1e-5


@pytest.fixture(scope="module", params=["A", "B"])
def case(request):
    d, cfg, params, token_map = load_port_case(request.param)
    ids = model.engram_ids(cfg, d["input_ids"], token_map)
    logits, inter = model.forward_with_intermediates(params, cfg, d["input_ids"], engram_ids_BSLC=ids)
    return {"d": d, "cfg": cfg, "ids": ids, "logits": np.asarray(logits),
            "inter": jax.tree.map(np.asarray, inter)}


def recorded(case, layer, *path):
    node = case["inter"][layer]
    for p in path:
        node = node[p]
    return node


def test_converted_config_is_the_tiny_config(case):
    tiny = dsv41.load_config("tiny")
    cfg = case["cfg"]
    assert [dataclass_fields(r) for r in dsv41.layer_plan(cfg)] == [dataclass_fields(r) for r in dsv41.layer_plan(tiny)] \
        or list(cfg.architecture.engram.layers) == [1, 4]
    assert cfg.csa2.to_dict() == tiny.csa2.to_dict()
    for block in ("rope", "moe", "mhc"):
        assert cfg.architecture[block].to_dict() == tiny.architecture[block].to_dict()
    assert cfg.quant == "qat"


def dataclass_fields(r):
    return (r.index, r.stage, r.mode, r.ratio, r.kv_source, r.index_source, r.candidate_source)


def test_engram_hash_ids_exact(case):
    d = case["d"]
    if "engram_hash_ids" not in d:
        assert case["ids"] is None
        return
    np.testing.assert_array_equal(case["ids"], d["engram_hash_ids"])


def test_indexer_selections(case):
    d = case["d"]
    compared = 0
    for k, layer in enumerate(d["diag_index_layers"]):
        ours = recorded(case, int(layer), "attn", "picks")[0]  # [S, top_k], sorted, -1 padded
        gap = d["diag_index_gap"][k]
        clear = np.isnan(gap) | (gap > 1e-6)  # NaN: fewer than top_k + 1 finite scores, no tie possible
        np.testing.assert_array_equal(ours[clear], d["diag_index_topk"][k][clear], err_msg=f"layer {layer}")
        compared += int(clear.sum())
    assert compared >= 0.99 * d["diag_index_topk"].shape[0] * d["diag_index_topk"].shape[1]


def test_candidate_blocks(case):
    d = case["d"]
    blocks = recorded(case, 6, "attn", "pool_blocks")[0]  # [S, n_blocks] bool
    width = d["diag_candidate_blocks"].shape[1]
    ours = np.full((blocks.shape[0], width), -1)
    for s, row in enumerate(blocks):
        kept = np.flatnonzero(row)
        ours[s, : len(kept)] = kept
    theirs = np.sort(np.where(d["diag_candidate_blocks"] < 0, 10**9, d["diag_candidate_blocks"]), axis=1)
    theirs = np.where(theirs == 10**9, -1, theirs)
    gap = d["diag_candidate_gap"]
    clear = np.isnan(gap) | (gap > 1e-5)
    assert clear.all()  # the README: all candidate margins are above 1e-5
    np.testing.assert_array_equal(ours, theirs)


def test_router_picks(case):
    d = case["d"]
    for layer in range(d["diag_router_experts"].shape[0]):
        ours = np.sort(recorded(case, layer, "ffn", "experts")[0], axis=-1)
        clear = d["diag_router_gap"][layer] > 1e-5
        np.testing.assert_array_equal(ours[clear], d["diag_router_experts"][layer][clear], err_msg=f"layer {layer}")


def test_attention_inputs(case):
    d = case["d"]
    for layer in range(d["diag_attn_norm_input"].shape[0]):
        ours = recorded(case, layer, "attn_input")[0]
        np.testing.assert_allclose(ours, d["diag_attn_norm_input"][layer], atol=1e-5, rtol=0, err_msg=f"layer {layer}")


def test_logits_row_by_row(case):
    err = np.abs(case["logits"][0] - case["d"]["logits_prefill"][0]).max(axis=-1)
    bad = np.flatnonzero(err > LOGIT_TOL)
    assert bad.size == 0, f"rows {bad[:10]} exceed {LOGIT_TOL} (max {err.max():.2e})"
