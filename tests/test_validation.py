"""One test per validation rule: a bad config file fails at load with the field, the value and the rule."""

import copy
import json

import pytest

import dsv41
from conftest import ROOT


def _load_error(write_config, raw) -> str:
    with pytest.raises(dsv41.ConfigError) as e:
        dsv41.load_config(write_config(raw))
    return str(e.value)


def _assert_names(msg: str, field: str, value: str, *rule: str):
    assert f"'{field}'" in msg, msg
    assert value in msg, msg
    for fragment in rule:
        assert fragment in msg, msg


def test_groups_must_add_up_to_the_stage_layers(v41_raw, write_config):
    v41_raw["csa2"]["encoder"]["layers"] = 21
    msg = _load_error(write_config, v41_raw)
    _assert_names(msg, "csa2.encoder.groups", "'size': 6", "window-only", "add up to 20",
                  "expected csa2.encoder.layers = 21")
    v41_raw["csa2"]["encoder"]["layers"] = 20
    v41_raw["csa2"]["decoder"]["groups"].append({"size": 4, "modes": ["reindex", "reuse", "reuse", "reuse"]})
    msg = _load_error(write_config, v41_raw)
    _assert_names(msg, "csa2.decoder.groups", "'reindex'", "add up to 24", "expected csa2.decoder.layers = 20")


def test_group_modes_must_match_the_group_size(v41_raw, write_config):
    v41_raw["csa2"]["encoder"]["groups"][1]["modes"] = ["full", "reuse"]
    _assert_names(_load_error(write_config, v41_raw), "csa2.encoder.groups.1.modes", "['full', 'reuse']",
                  "expected 6 modes")


@pytest.mark.parametrize("stage,first", [("encoder", "reuse"), ("decoder", "reindex"), ("decoder", "reuse")])
def test_reuse_or_reindex_before_any_full_layer(v41_raw, write_config, stage, first):
    v41_raw["csa2"][stage]["groups"][0]["modes"][0] = first
    layer = {"encoder": 2, "decoder": 20}[stage]
    _assert_names(_load_error(write_config, v41_raw), f"csa2.{stage}.groups.0.modes", f"'{first}'",
                  f"layer {layer} is '{first}' before any 'full' layer of the {stage}")


def test_a_group_ratio_must_equal_its_stage_ratio(v41_raw, write_config):
    v41_raw["csa2"]["decoder"]["groups"][2]["compression_ratio"] = 2
    _assert_names(_load_error(write_config, v41_raw), "csa2.decoder.groups.2.compression_ratio", "= 2",
                  "expected the ratio of its stage", "csa2.decoder.compression_ratio = 1")


def test_unknown_mode(v41_raw, write_config):
    v41_raw["csa2"]["decoder"]["groups"][3]["modes"][0] = "rescore"
    _assert_names(_load_error(write_config, v41_raw), "csa2.decoder.groups.3.modes", "'rescore'",
                  "unknown mode", "'full', 'reuse' or 'reindex'")


@pytest.mark.parametrize("field", ["global_kv_dtype", "swa_kv_dtype"])
def test_unknown_dtype(v41_raw, write_config, field):
    v41_raw["kv_cache"][field] = "fp3_e1m1"
    _assert_names(_load_error(write_config, v41_raw), f"kv_cache.{field}", "'fp3_e1m1'",
                  "expected an element format", "fp4_e2m1")


def test_unknown_scale(v41_raw, write_config):
    v41_raw["kv_cache"]["global_kv_scale"] = "e5m2_per_16_channel"
    _assert_names(_load_error(write_config, v41_raw), "kv_cache.global_kv_scale", "'e5m2_per_16_channel'",
                  "<scale>_per_<N>_channel", "ue8m0")


def test_candidate_pool_size_must_be_blocks_times_positions(v41_raw, write_config):
    v41_raw["csa2"]["indexer"]["hierarchical"]["candidate_pool_size"] = 16000
    _assert_names(_load_error(write_config, v41_raw), "csa2.indexer.hierarchical.candidate_pool_size", "16000",
                  "max_blocks × positions_per_block = 2048 × 8 = 16384")


def test_top_k_must_fit_in_the_pool(v41_raw, write_config):
    v41_raw["csa2"]["indexer"]["hierarchical"].update(max_blocks=32, candidate_pool_size=256)
    _assert_names(_load_error(write_config, v41_raw), "csa2.indexer.top_k", "512",
                  "at most the candidate pool size (256)")


@pytest.mark.parametrize("head_dim,block,what", [(520, 16, "main KV"), (528, 32, "window KV")])
def test_kv_width_must_fill_quantisation_blocks(v41_raw, write_config, head_dim, block, what):
    v41_raw["architecture"]["head_dim"] = head_dim
    _assert_names(_load_error(write_config, v41_raw), "architecture.head_dim", str(head_dim),
                  f"multiple of {block}", what)


def test_indexer_width_must_fill_quantisation_blocks(v41_raw, write_config):
    v41_raw["csa2"]["indexer"]["head_dim"] = 48
    _assert_names(_load_error(write_config, v41_raw), "csa2.indexer.head_dim", "48", "multiple of 32",
                  "indexer key")


@pytest.mark.parametrize("window", [0, -128])
def test_window_must_be_positive(v41_raw, write_config, window):
    v41_raw["kv_cache"]["swa_window_size"] = window
    _assert_names(_load_error(write_config, v41_raw), "kv_cache.swa_window_size", str(window), "positive")


@pytest.mark.parametrize("field", ["encoder_replay_tokens", "decoder_replay_tokens"])
def test_replay_tokens_at_most_the_window(v41_raw, write_config, field):
    v41_raw["swa_bounded_replay"][field] = 129
    _assert_names(_load_error(write_config, v41_raw), f"swa_bounded_replay.{field}", "129",
                  "kv_cache.swa_window_size (128)")


def test_context_window_beyond_int32_positions(v41_raw, write_config):
    v41_raw["context_window"] = 3_000_000_000
    v41_raw["architecture"]["rope"]["max_position"] = 4_000_000_000
    _assert_names(_load_error(write_config, v41_raw), "context_window", "3000000000", "int32")


def test_context_window_beyond_the_rope_range(v41_raw, write_config):
    v41_raw["context_window"] = 2_000_000
    _assert_names(_load_error(write_config, v41_raw), "context_window", "2000000",
                  "architecture.rope.max_position (1048576)")


def test_context_window_must_be_positive(v41_raw, write_config):
    v41_raw["context_window"] = 0
    _assert_names(_load_error(write_config, v41_raw), "context_window", "0", "positive")


def test_reindex_layers_need_one_candidate_source(v41_raw, write_config):
    v41_raw["csa2"]["decoder"]["groups"][2]["modes"][0] = "full"
    _assert_names(_load_error(write_config, v41_raw), "csa2", "[24, 32, 36]", "different Full layers [20, 28]")


def test_engram_layers_must_exist(v41_raw, write_config):
    v41_raw["architecture"]["engram"]["layers"] = [1, 40]
    _assert_names(_load_error(write_config, v41_raw), "architecture.engram.layers", "[1, 40]",
                  "layer 40 does not exist")


def test_rope_dims_and_groups(v41_raw, write_config):
    raw = copy.deepcopy(v41_raw)
    raw["architecture"]["rope_head_dim"] = 63
    _assert_names(_load_error(write_config, raw), "architecture.rope_head_dim", "63", "even number")
    raw = copy.deepcopy(v41_raw)
    raw["architecture"]["o_groups"] = 7
    _assert_names(_load_error(write_config, raw), "architecture.o_groups", "7", "divisor of num_heads (64)")
    raw = copy.deepcopy(v41_raw)
    raw["architecture"]["moe"]["top_k"] = 400
    _assert_names(_load_error(write_config, raw), "architecture.moe.top_k", "400", "num_experts (384)")


def test_persistent_cache_location(v41_raw, write_config):
    v41_raw["kv_cache"]["persistent_cache"]["swa_kv_location"] = "disk"
    _assert_names(_load_error(write_config, v41_raw), "kv_cache.persistent_cache.swa_kv_location", "'disk'",
                  "host_dram_pool")


def test_v4_layer_types(write_config):
    raw = json.loads((ROOT / "configs" / "v4_flash.json").read_text())
    raw["v4"]["layer_types"][5] = "mla"
    _assert_names(_load_error(write_config, raw), "v4.layer_types.5", "'mla'", "'window', 'csa' or 'hca'")


def test_layout_parts(write_config):
    raw = json.loads((ROOT / "configs" / "deepseek_v32.json").read_text())
    raw["kv_layout"]["parts"][0]["scale"] = "fp32_per_100_channel"
    _assert_names(_load_error(write_config, raw), "kv_layout.parts.0.dims", "512", "multiple of", "100")


def test_group_records(v41_raw, write_config):
    raw = copy.deepcopy(v41_raw)
    raw["csa2"]["encoder"]["groups"][0]["repeat"] = 3
    _assert_names(_load_error(write_config, raw), "csa2.encoder.groups.0.repeat", "3", "unknown field")
    raw = copy.deepcopy(v41_raw)
    del raw["csa2"]["encoder"]["groups"][0]["modes"]
    _assert_names(_load_error(write_config, raw), "csa2.encoder.groups.0.modes", "None", "missing")
    raw = copy.deepcopy(v41_raw)
    raw["csa2"]["encoder"]["groups"][0]["size"] = "6"
    _assert_names(_load_error(write_config, raw), "csa2.encoder.groups.0.size", "'6'", "expected int")


def test_prefix_cache_blocks_must_close_every_compressor_group(v41_raw, write_config):
    v41_raw["kv_cache"]["persistent_cache"]["block_tokens"] = 255
    _assert_names(_load_error(write_config, v41_raw), "kv_cache.persistent_cache.block_tokens", "= 255",
                  "expected a positive multiple of 2", "compression ratios [1, 2]")


def test_tied_embeddings_are_refused(v41_raw, write_config):
    v41_raw["architecture"]["tie_embeddings"] = True
    _assert_names(_load_error(write_config, v41_raw), "architecture.tie_embeddings", "True", "expected false",
                  "separate embedding and output head")


def test_compressed_rope_type(v41_raw, write_config):
    v41_raw["architecture"]["rope"]["compressed_rope_type"] = "linear"
    _assert_names(_load_error(write_config, v41_raw), "architecture.rope.compressed_rope_type", "'linear'",
                  "expected one of ['yarn', 'default']")
