"""KV accounting against the published figures (DESIGN §5), each written as its closed formula."""

import pytest

import dsv41

BF16, FP8, FP4 = 2, 1, 0.5
V1 = 95 * 8 * 128 * 2 * BF16
V32 = 61 * ((512 * FP8 + 4 * 4 + 64 * BF16) + (128 * FP8 + 4))
V4_MAIN = 448 * FP8 + 64 * BF16 + 7 + 1
V4_INDEX = 128 * FP4 + 128 // 32
V4 = 21 * (V4_MAIN + V4_INDEX) / 4 + 20 * V4_MAIN / 128
V41_MAIN = 512 * FP4 + 512 // 16
V41_INDEX = 128 * FP4 + 128 // 32
V41 = 3 * (V41_MAIN + V41_INDEX) / 2 + (V41_MAIN + V41_INDEX) / 1


def test_the_published_figures_follow_from_the_configs():
    assert (V1, V32, V4, V41) == (389_120, 48_068, 3_514.25, 890)  # the report's numbers
    got = {name: dsv41.kv_bytes_per_token(dsv41.load_config(name))["total"]
           for name in ("deepseek_v1_67b", "deepseek_v32", "v4_flash", "v41_flash")}
    assert got == {"deepseek_v1_67b": V1, "deepseek_v32": V32, "v4_flash": V4, "v41_flash": V41}
    assert isinstance(got["v41_flash"], int) and isinstance(got["deepseek_v1_67b"], int)


def test_ratios():
    v41 = dsv41.kv_bytes_per_token(dsv41.load_config("v41_flash"))["total"]
    v1 = dsv41.kv_bytes_per_token(dsv41.load_config("deepseek_v1_67b"))["total"]
    v4 = dsv41.kv_bytes_per_token(dsv41.load_config("v4_flash"))["total"]
    assert round(v1 / v41) == 437
    assert round(v4 / v41, 2) == 3.95


def test_v41_split_sharing_and_window_rings():
    kv = dsv41.kv_bytes_per_token(dsv41.load_config("v41_flash"))
    assert (kv["main"], kv["index"]) == (720, 170)
    assert kv["entry_bytes"] == {"main": 288, "index": 68, "window": 528}
    assert kv["without_sharing"] == 18 * (V41_MAIN + V41_INDEX) / 2 + 20 * (V41_MAIN + V41_INDEX) == 10_324
    assert kv["per_layer"] == {2: 178, 8: 178, 14: 178, 20: 356}
    assert kv["window_ring_bytes_per_sequence"] == 40 * 128 * (512 + 512 // 32) == 2_703_360
    assert kv["gb_per_million_tokens"] == pytest.approx(0.89, abs=1e-12)


def test_figures_move_with_the_formats_and_the_plan():
    """Nothing is a constant: change a format or the plan and the figure follows its formula."""
    fp8 = dsv41.load_config("v41_flash", overrides=["kv_cache.global_kv_dtype=fp8_e4m3"])
    main = 512 + 512 // 16
    assert dsv41.kv_bytes_per_token(fp8)["total"] == 3 * (main + V41_INDEX) / 2 + (main + V41_INDEX)
    no_full_14 = dsv41.load_config(
        "v41_flash", overrides=['csa2.encoder.groups.2.modes=["reuse","reuse","reuse","reuse","reuse","reuse"]'])
    assert dsv41.kv_bytes_per_token(no_full_14)["total"] == 2 * (V41_MAIN + V41_INDEX) / 2 + (V41_MAIN + V41_INDEX)
    window = dsv41.load_config("v41_flash", overrides=["kv_cache.swa_window_size=256"])
    assert dsv41.kv_bytes_per_token(window)["window_ring_bytes_per_sequence"] == 40 * 256 * 528


def test_v4_split():
    kv = dsv41.kv_bytes_per_token(dsv41.load_config("v4_flash"))
    assert kv["entry_bytes"]["main"] == 584 and kv["entry_bytes"]["index"] == 68
    assert kv["index"] == 21 * 68 / 4
    assert kv["without_sharing"] == kv["total"]  # V4 shares nothing across layers
