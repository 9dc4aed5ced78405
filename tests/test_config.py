import pytest

import dsv41
from dsv41.config import available_configs
from conftest import ROOT

# The user schema of DeepSeek-V4.1-Flash as issue #2 states it, written out independently.
USER_SCHEMA = {
    "model": "DeepSeek-V4.1-Flash",
    "context_window": 1000000,
    "kv_cache": {
        "global_kv_dtype": "fp4_e2m1",
        "global_kv_scale": "e4m3_per_16_channel",
        "swa_kv_dtype": "fp8",
        "swa_window_size": 128,
        "persistent_cache": {"global_kv_ttl_hours": 72, "swa_kv_location": "host_dram_pool", "swa_kv_ttl_minutes": 5},
    },
    "csa2": {
        "encoder": {
            "layers": 20, "first_two_layers": "swa_only", "compression_ratio": 2,
            "groups": [{"size": 6, "modes": ["full"] + ["reuse"] * 5}] * 3,
        },
        "decoder": {
            "layers": 20, "compression_ratio": 1,
            "groups": [{"size": 4, "modes": ["full"] + ["reuse"] * 3}]
            + [{"size": 4, "modes": ["reindex"] + ["reuse"] * 3}] * 4,
        },
        "indexer": {
            "query_heads": 32, "head_dim": 128, "top_k": 512,
            "hierarchical": {"enabled": True, "max_blocks": 2048, "positions_per_block": 8,
                             "candidate_pool_size": 16384},
        },
    },
    "swa_bounded_replay": {"encoder_replay_tokens": 128, "decoder_replay_tokens": 128,
                           "enable_prefix_cache_global_only": True},
}


def _subset(expected, actual, path=""):
    """Every field of `expected` is in `actual` with the same value and nesting."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), path
        for k, v in expected.items():
            assert k in actual, f"{path}.{k} missing"
            _subset(v, actual[k], f"{path}.{k}")
    elif isinstance(expected, list):
        assert len(expected) == len(actual), path
        for i, (e, a) in enumerate(zip(expected, actual)):
            _subset(e, a, f"{path}.{i}")
    else:
        assert expected == actual and type(expected) is type(actual), f"{path}: {actual!r} != {expected!r}"


def test_v41_flash_files_hold_the_user_schema_unchanged(v41_raw):
    import tomllib

    _subset(USER_SCHEMA, v41_raw)
    _subset(USER_SCHEMA, tomllib.loads((ROOT / "configs" / "v41_flash.toml").read_text()))
    assert v41_raw["base_url"].startswith("http://127.0.0.1")


def test_json_and_toml_load_to_the_same_config():
    a = dsv41.load_config("v41_flash.json").to_dict()
    b = dsv41.load_config("v41_flash.toml").to_dict()
    assert a == b
    assert dsv41.load_config("v41_flash").to_dict() == a


def test_model_dimensions_block():
    a = dsv41.load_config("v41_flash").architecture
    assert (a.vocab_size, a.hidden_size, a.num_heads, a.head_dim, a.rope_head_dim) == (129280, 5120, 64, 512, 64)
    assert (a.q_lora_rank, a.o_groups, a.o_lora_rank, a.norm_eps) == (1280, 8, 1024, 1e-20)
    assert (a.moe.num_experts, a.moe.top_k, a.moe.num_shared_experts, a.moe.intermediate_size) == (384, 6, 1, 2304)
    assert (a.moe.route_scale, a.moe.score_func, a.moe.hash_layers) == (1.5, "sqrtsoftplus", 0)
    assert (a.mhc.streams, a.mhc.sinkhorn_iters, a.mhc.eps, a.mhc.variant) == (4, 20, 1e-6, "single_pass")
    assert (a.rope.theta, a.rope.compressed_theta, a.rope.yarn_factor, a.rope.yarn_original_max_position) == (
        10000.0, 160000.0, 16.0, 65536)
    assert list(a.engram.layers) == [1, 14]


@pytest.mark.parametrize("name", ["v41_flash", "v4_flash", "tiny", "small", "tiny_v4", "deepseek_v1_67b", "deepseek_v32"])
def test_shipped_configs_load(name):
    assert name in available_configs()
    cfg = dsv41.load_config(name)
    assert cfg.model


def test_missing_fields_take_the_schema_defaults(write_config):
    cfg = dsv41.load_config(write_config({"model": "defaults only"}))
    assert cfg.context_window == 1000000 and cfg.kv_cache.swa_kv_scale == "ue8m0_per_32_channel"
    assert [r.mode for r in dsv41.layer_plan(cfg)].count("reuse") == 30


def test_overrides_are_applied_and_type_checked():
    cfg = dsv41.load_config("v41_flash", overrides=["csa2.indexer.top_k=64", "kv_cache.persistent_cache.swa_kv_ttl_minutes=2.5"])
    assert cfg.csa2.indexer.top_k == 64 and cfg.kv_cache.persistent_cache.swa_kv_ttl_minutes == 2.5
    cfg = dsv41.load_config("v41_flash", overrides=["kv_cache.persistent_cache.global_kv_ttl_hours=1"])
    assert cfg.kv_cache.persistent_cache.global_kv_ttl_hours == 1.0  # int widened to the float field
    cfg = dsv41.load_config("v41_flash", overrides=["csa2.decoder.groups.1.modes=[\"reindex\",\"reuse\",\"reuse\",\"reuse\"]",
                                                     "model=my model"])
    assert cfg.model == "my model"


@pytest.mark.parametrize("override,fragments", [
    ("csa2.indexer.top_k=many", ["csa2.indexer.top_k", "'many'", "expected int"]),
    ("csa2.indexer.top_k=true", ["csa2.indexer.top_k", "expected int, got bool"]),
    ("csa2.indexer.topk=4", ["csa2.indexer.topk", "unknown field", "top_k"]),
    ("csa2.indexer.top_k", ["key.path=value"]),
    ("csa2.encoder.groups.7.size=2", ["csa2.encoder.groups.7", "below 3"]),
])
def test_bad_overrides_name_the_field(override, fragments):
    with pytest.raises(dsv41.ConfigError) as e:
        dsv41.load_config("v41_flash", overrides=[override])
    for fragment in fragments:
        assert fragment in str(e.value)


def test_an_override_is_validated_like_a_file():
    with pytest.raises(dsv41.ConfigError) as e:
        dsv41.load_config("v41_flash", overrides=["csa2.indexer.top_k=20000"])
    assert "csa2.indexer.top_k" in str(e.value) and "20000" in str(e.value)


def test_python_config_file(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(
        "import ml_collections\n"
        "def get_config():\n"
        "    c = ml_collections.ConfigDict()\n"
        "    c.model = 'from python'\n"
        "    c.csa2 = {'indexer': {'top_k': 256}}\n"
        "    return c\n")
    cfg = dsv41.load_config(str(path))
    assert cfg.model == "from python" and cfg.csa2.indexer.top_k == 256
    bad = tmp_path / "bad.py"
    bad.write_text("CONFIG = {}\n")
    with pytest.raises(dsv41.ConfigError, match="get_config"):
        dsv41.load_config(str(bad))


def test_file_errors_name_the_problem(tmp_path, write_config):
    with pytest.raises(dsv41.ConfigError) as e:
        dsv41.load_config("no_such_config")
    assert "no_such_config" in str(e.value) and "v41_flash" in str(e.value)
    broken = tmp_path / "broken.json"
    broken.write_text("{ not json")
    with pytest.raises(dsv41.ConfigError, match="valid JSON"):
        dsv41.load_config(broken)
    broken = tmp_path / "broken.toml"
    broken.write_text("model = ")
    with pytest.raises(dsv41.ConfigError, match="valid TOML"):
        dsv41.load_config(broken)
    with pytest.raises(dsv41.ConfigError) as e:
        dsv41.load_config(write_config({"model": "x", "kv_cache": {"swa_window": 64}}))
    assert "kv_cache.swa_window" in str(e.value) and "unknown field" in str(e.value)
    with pytest.raises(dsv41.ConfigError) as e:
        dsv41.load_config(write_config({"kv_cache": {"swa_window_size": "128"}}))
    assert "kv_cache.swa_window_size" in str(e.value) and "expected int, got str" in str(e.value)
    with pytest.raises(dsv41.ConfigError) as e:
        dsv41.load_config(write_config({"kv_cache": 5}))
    assert "'kv_cache' = 5" in str(e.value)


def test_family_schemas_are_separate(write_config):
    with pytest.raises(dsv41.ConfigError) as e:
        dsv41.load_config(write_config({"architecture": {"family": "v4"}, "csa2": {}}))
    assert "'csa2'" in str(e.value) and "unknown field" in str(e.value)
    with pytest.raises(dsv41.ConfigError) as e:
        dsv41.load_config(write_config({"architecture": {"family": "v5"}}))
    assert "architecture.family" in str(e.value) and "'v5'" in str(e.value)
    with pytest.raises(dsv41.ConfigError, match="cannot be overridden"):
        dsv41.load_config("v41_flash", overrides=["architecture.family=v4"])


def test_config_is_locked():
    cfg = dsv41.load_config("tiny")
    with pytest.raises(AttributeError):
        cfg.not_a_field = 1
