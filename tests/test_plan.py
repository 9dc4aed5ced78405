import json

import dsv41
from dsv41 import plan as plan_mod
from conftest import DATA


def test_v41_flash_plan():
    p = dsv41.layer_plan(dsv41.load_config("v41_flash"))
    assert len(p) == 40
    by_mode = lambda m: [r.index for r in p if r.mode == m]
    assert by_mode("window") == [0, 1]
    assert by_mode("full") == [2, 8, 14, 20]
    assert by_mode("reindex") == [24, 28, 32, 36]
    assert by_mode("reuse") == [i for i in range(2, 40) if i not in (2, 8, 14, 20, 24, 28, 32, 36)]
    assert len(by_mode("reuse")) == 30
    assert [r.ratio for r in p] == [0, 0] + [2] * 18 + [1] * 20  # DESIGN §2
    assert [r.stage for r in p] == ["encoder"] * 20 + ["decoder"] * 20
    for r in p:
        if r.mode == "window":
            assert r.kv_source is None and r.index_source is None
            continue
        # kv_source: the latest Full layer; index_source: the latest Full or Reindex layer (DESIGN §2.1)
        assert r.kv_source == max(i for i in (2, 8, 14, 20) if i <= r.index)
        assert r.index_source == max(i for i in (2, 8, 14, 20, 24, 28, 32, 36) if i <= r.index)
        assert r.candidate_source == (20 if r.mode == "reindex" else None)
        assert r.rope == "compressed"
    assert [r.index for r in p if r.engram] == [1, 14]
    assert [r.index for r in p if r.stores_entries] == [2, 8, 14, 20]
    assert [r.index for r in p if r.stores_index_keys] == [2, 8, 14, 20]


def test_v4_flash_plan():
    p = dsv41.layer_plan(dsv41.load_config("v4_flash"))
    assert len(p) == 43
    assert [r.index for r in p if r.mode == "window"] == [0, 1]
    assert [r.index for r in p if r.mode == "csa"] == list(range(2, 43, 2))
    assert [r.index for r in p if r.mode == "hca"] == list(range(3, 42, 2))
    assert all(r.ratio == {"window": 0, "csa": 4, "hca": 128}[r.mode] for r in p)
    assert all(r.kv_source == (None if r.mode == "window" else r.index) for r in p)
    assert all(r.index_source == (r.index if r.mode == "csa" else None) for r in p)
    assert plan_mod.counts(p) == {"window": 2, "csa": 21, "hca": 20}


def test_tiny_plan_matches_the_v41_port():
    """The tiny config is the toy model of the oracle vectors: its plan equals the port's own plan."""
    port = json.loads((DATA / "v41_port_caseA_config.json").read_text())
    p = dsv41.layer_plan(dsv41.load_config("tiny"))
    assert [r.ratio for r in p] == port["compress_ratios"]
    assert [r.index for r in p if r.stores_entries] == port["kv_source_layer_ids"]
    assert [r.index for r in p if r.mode in ("full", "reindex")] == port["index_source_layer_ids"]
    assert {r.candidate_source for r in p if r.mode == "reindex"} == {port["candidate_source_layer_id"]}
    cfg = dsv41.load_config("tiny")
    h = cfg.csa2.indexer.hierarchical
    assert (h.max_blocks, h.positions_per_block) == (port["candidate_topk_blocks"], port["candidate_block_size"])
    assert (cfg.csa2.indexer.query_heads, cfg.csa2.indexer.head_dim, cfg.csa2.indexer.top_k) == (
        port["index_n_heads"], port["index_head_dim"], port["index_topk"])
    a = cfg.architecture
    assert (a.hidden_size, a.num_heads, a.head_dim, a.rope_head_dim, a.q_lora_rank, a.o_groups, a.o_lora_rank) == (
        port["hidden_size"], port["num_attention_heads"], port["head_dim"], port["qk_rope_head_dim"],
        port["q_lora_rank"], port["o_groups"], port["o_lora_rank"])
    assert cfg.kv_cache.swa_window_size == port["sliding_window"]
    yarn = port["rope_parameters"]["compress"]
    assert (a.rope.yarn_factor, a.rope.yarn_original_max_position, a.rope.compressed_theta) == (
        yarn["factor"], yarn["original_max_position_embeddings"], yarn["rope_theta"])


def test_plan_is_data_for_any_grouping(write_config, v41_raw):
    v41_raw["csa2"]["decoder"]["groups"] = [
        {"size": 2, "modes": ["full", "reindex"]}, {"size": 18, "modes": ["reuse"] * 18}]
    p = dsv41.layer_plan(dsv41.load_config(write_config(v41_raw)))
    assert (p[20].mode, p[21].mode, p[22].mode) == ("full", "reindex", "reuse")
    assert all(r.index_source == 21 and r.kv_source == 20 for r in p[22:])
