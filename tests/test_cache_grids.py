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
        entries = blocks(fp4(np.asarray(store.entries)[0, :t]), e4m3, 16)
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
