"""With quant "qat" every value the model stores lies on the exact E2M1 / E4M3 / UE8M0 grids: the
cache's bytes, decoded with ml_dtypes in float64 (independently of dsv41.quant), equal bit for bit
the fake-quantised values the full-sequence forward computes."""

import json

import ml_dtypes
import numpy as np
import pytest

from dsv41 import cache as cache_lib
from dsv41 import model, steps, transformers_io
from conftest import DATA

pytestmark = pytest.mark.slow  # the 12-layer tiny model's forward and cached steps compile

N = 100  # prompt tokens: window wrapped, 50 ratio-2 entries, 100 ratio-1 entries


@pytest.fixture(scope="module")
def both():
    d = np.load(DATA / "v41_port_caseA.npz", allow_pickle=False)
    cfg = transformers_io.config_from_transformers(json.loads(str(d["config_json"][0])))
    params = transformers_io.params_from_transformers({n: d[n] for n in d["param_names"]}, cfg)
    _, inter = model.forward_with_intermediates(params, cfg, d["input_ids"][:, :N])
    cache = cache_lib.init_cache(cfg, 1, 128)
    _, cache = steps.prefill(params, cfg, cache, d["input_ids"][:, :N])
    return cfg, inter, cache


@pytest.fixture(scope="module")
def fp8_main():
    """The same model with FP8 main entries (`kv_cache.global_kv_dtype: fp8`)."""
    from dsv41 import config as config_lib

    d = np.load(DATA / "v41_port_caseA.npz", allow_pickle=False)
    port = transformers_io.config_from_transformers(json.loads(str(d["config_json"][0])))
    cfg = config_lib.build(port.to_dict(), ["kv_cache.global_kv_dtype=fp8"])
    params = transformers_io.params_from_transformers({n: d[n] for n in d["param_names"]}, cfg)
    _, inter = model.forward_with_intermediates(params, cfg, d["input_ids"][:, :N])
    cache = cache_lib.init_cache(cfg, 1, 128)
    _, cache = steps.prefill(params, cfg, cache, d["input_ids"][:, :N])
    return cfg, inter, cache


def stored_bytes(entries):
    """The main entries' bytes: the cache keeps them in pairs as little-endian uint16 words."""
    assert entries.dtype == np.uint16, entries.dtype
    return np.ascontiguousarray(np.asarray(entries)).view("<u1")


def fp4(packed):
    """uint8 [..., D/2] -> float64 [..., D]: the even element is the low nibble."""
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1).astype(np.uint8)
    return codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def blocks(values, scales, block):
    return (values.reshape(*scales.shape, block) * scales[..., None]).reshape(values.shape)


def recorded(inter, layer, name):
    return np.asarray(inter[layer]["attn"][name])[0]


def test_main_entries_and_indexer_keys(both):
    cfg, inter, cache = both
    for layer, store in cache_lib.layer_stores(cfg, cache).items():
        ratio = dict((r.index, r.ratio) for r in cache_lib.layer_plan(cfg))[layer]
        t = N // ratio
        e4m3 = np.asarray(store.entry_scales)[0, :t].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        entries = blocks(fp4(stored_bytes(store.entries)[0, :t]), e4m3, 16)
        np.testing.assert_array_equal(entries.astype(np.float32), recorded(inter, layer, "entries"))
        ue8m0 = np.asarray(store.index_scales)[0, :t].view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
        keys = blocks(fp4(np.asarray(store.index_keys)[0, :t]), ue8m0, 32)
        np.testing.assert_array_equal(keys.astype(np.float32), recorded(inter, layer, "index_keys"))
        assert np.all(np.log2(ue8m0) == np.round(np.log2(ue8m0)))  # UE8M0: powers of two


def test_window_rings(both):
    cfg, inter, cache = both
    w = cfg.kv_cache.swa_window_size
    positions = np.arange(N - w, N)
    rings = np.stack([np.asarray(x) for x in cache_lib.layer_rings(cfg, cache.window)])  # [L, B, W, K]
    ring_scales = np.stack([np.asarray(x) for x in cache_lib.layer_rings(cfg, cache.window_scales)])
    for layer in range(len(cache_lib.layer_plan(cfg))):
        vals = rings[layer, 0, positions % w].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        scales = ring_scales[layer, 0, positions % w].view(ml_dtypes.float8_e8m0fnu)
        ring = blocks(vals, scales.astype(np.float64), 32)
        np.testing.assert_array_equal(ring.astype(np.float32), recorded(inter, layer, "window_kv")[positions])


def test_fp8_main_entries(fp8_main):
    """FP8 main KV: E4M3 codes (one a byte) with an E4M3 scale per 16, decoded with ml_dtypes. The first Full
    layer (no selection before it) equals the forward's fake-quantised entries bit for bit; a later layer's
    input passes through top-k picks, where a rounding-level difference between the forward and the cached
    path may flip a pick for one query (with FP8 entries this flips a few rows of the decoder's Full layer
    here), so there every entry is checked to lie on the grid. The cache's bytes equal the accounting."""
    cfg, inter, cache = fp8_main
    first = min(cache_lib.full_layers(cfg))
    for layer, store in cache_lib.layer_stores(cfg, cache).items():
        ratio = dict((r.index, r.ratio) for r in cache_lib.layer_plan(cfg))[layer]
        t = N // ratio
        assert stored_bytes(store.entries).shape[-1] == cfg.architecture.head_dim  # one byte an element
        e4m3 = np.asarray(store.entry_scales)[0, :t].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        codes = stored_bytes(store.entries)[0, :t].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        assert np.isfinite(codes).all() and (e4m3 >= 2.0**-9).all() and (np.abs(codes) <= 448).all()
        if layer == first:
            np.testing.assert_array_equal(blocks(codes, e4m3, 16).astype(np.float32),
                                          recorded(inter, layer, "entries"))
    per_token = cache_lib.accounting.kv_bytes_per_token(cfg)
    k = cfg.architecture.head_dim
    assert per_token["entry_bytes"]["main"] == k + k // 16
    assert cache_lib.nbytes(cache) == cache_lib.expected_bytes(cfg, 1, 128)["total"]
