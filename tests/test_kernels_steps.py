"""The cached prefill / decode steps with `runtime.kernels = pallas_interpret` (the Pallas kernels in
interpret mode, or compiled, `pallas`, on a GPU or TPU: sparse attention over the stored bytes, indexer
scoring, the candidate pool and the Reindex pool scoring) against the same steps on the XLA reference path,
on the port's case A weights.

Tolerance: the kernels accumulate the softmax online, tile by tile, and the indexer scores in another
order, so logits differ by float32 rounding: 1e-5 absolute on logits of std ~1 (reached: ~1e-6)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41
from dsv41 import config as config_lib
from dsv41 import cache as cache_lib
from dsv41 import steps
from conftest import kernels_mode, load_port_case

TOL = 1e-5


def with_kernels(cfg, mode):
    return config_lib.build(cfg.to_dict(), [f"runtime.kernels={mode}"])


@pytest.mark.slow
def test_prefill_chunk_and_decode_with_kernels_equal_the_reference():
    d, cfg, params, token_map = load_port_case("A")
    ids = d["input_ids"]
    kcfg = with_kernels(cfg, kernels_mode())
    ref = dsv41.init_cache(cfg, 1, 256)
    _, ref = steps.prefill(params, cfg, ref, ids[:, :180], token_map=token_map)
    ker = jax.tree.map(jnp.copy, ref)
    # A chunk of 10 (shorter than twice the window: the kernels' chunk path), then two decode steps:
    # every Full, Reindex, Reuse and window-only layer runs through the kernels.
    logits_ref, ref = steps.prefill(params, cfg, ref, ids[:, 180:190], token_map=token_map)
    logits_ker, ker = steps.prefill(params, kcfg, ker, ids[:, 180:190], token_map=token_map)
    errors = [np.abs(np.asarray(logits_ker) - np.asarray(logits_ref)).max()]
    for pos in (190, 191):
        logits_ref, ref = steps.decode(params, cfg, ref, ids[:, pos], token_map=token_map)
        logits_ker, ker = steps.decode(params, kcfg, ker, ids[:, pos], token_map=token_map)
        errors.append(np.abs(np.asarray(logits_ker) - np.asarray(logits_ref)).max())
    assert max(errors) < TOL, errors
    # And against the port's own logits at those positions.
    assert np.abs(np.asarray(logits_ker)[0] - d["logits_prefill"][0, 191]).max() < TOL
    # The stored bytes are written by the same code either way, from inputs that differ by float32
    # rounding (the kernels' attention output feeds the next layer): equal caches up to rounding flips.
    assert_same_cache_up_to_flips(ker, ref)


def assert_same_cache_up_to_flips(got, want, max_fraction=1e-3):
    """Integer state equal; scale bytes equal; FP8 window codes and FP4 entry/key nibbles equal except
    at most `max_fraction` of them, each then a neighbour on its grid (the code one step away, same
    sign); float leftovers equal to TOL. A rounding-level difference before a cast flips a value that
    sat on a rounding threshold to its neighbour (the quantised model is threshold-chaotic)."""
    assert cache_lib.quantised(got) and cache_lib.quantised(want)
    for field in ("lengths", "window_start", "recent_tokens"):
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)), field)
    rings = lambda leaves: np.concatenate([np.asarray(x) for x in leaves])  # every ring leaf, [N, B, W, ·]
    np.testing.assert_array_equal(rings(got.window_scales), rings(want.window_scales))
    leaves = [("window", rings(got.window), rings(want.window), 8)]
    for s, (g, w) in enumerate(zip(got.compressed, want.compressed)):
        np.testing.assert_array_equal(np.asarray(g.entry_scales), np.asarray(w.entry_scales), f"{s} entry_scales")
        np.testing.assert_array_equal(np.asarray(g.index_scales), np.asarray(w.index_scales), f"{s} index_scales")
        for name in ("leftover", "index_leftover"):
            np.testing.assert_allclose(np.asarray(getattr(g, name)), np.asarray(getattr(w, name)), rtol=0, atol=TOL,
                                       err_msg=f"{s} {name}")
        words = lambda x: np.asarray(x).view(np.uint8)  # the entries' bytes, kept as uint16 pairs
        leaves += [(f"{s} entries", words(g.entries), words(w.entries), 4),
                   (f"{s} index_keys", g.index_keys, w.index_keys, 4)]
    for name, g, w, bits in leaves:
        g, w = np.asarray(g).astype(np.int32), np.asarray(w).astype(np.int32)
        codes = [(g, w)] if bits == 8 else [(g & 15, w & 15), (g >> 4, w >> 4)]
        flips = 0
        for cg, cw in codes:
            differ = cg != cw
            sign = 1 << (bits - 1)
            neighbour = (np.abs(cg - cw) == 1) & ((cg & sign) == (cw & sign))
            assert np.all(neighbour[differ]), f"{name}: a code moved by more than one grid step"
            flips += int(differ.sum())
        assert flips <= max_fraction * sum(c.size for c, _ in codes), f"{name}: {flips} flips"


def test_a_bad_kernels_mode_is_refused(write_config):
    with pytest.raises(dsv41.ConfigError) as e:
        dsv41.load_config(write_config({"runtime": {"kernels": "cuda"}}))
    assert "runtime.kernels" in str(e.value) and "'cuda'" in str(e.value) and "pallas_interpret" in str(e.value)
