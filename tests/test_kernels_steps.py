"""The cached prefill / decode steps with `runtime.kernels = pallas_interpret` (the Pallas kernels in
interpret mode: sparse attention over the stored bytes, indexer scoring, the candidate pool and the
Reindex pool scoring) against the same steps on the XLA reference path, on the port's case A weights.

Tolerance: the kernels accumulate the softmax online, tile by tile, and the indexer scores in another
order, so logits differ by float32 rounding: 1e-5 absolute on logits of std ~1 (reached: ~1e-6)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41
from dsv41 import config as config_lib
from dsv41 import steps
from conftest import load_port_case

TOL = 1e-5


def with_kernels(cfg, mode):
    return config_lib.build(cfg.to_dict(), [f"runtime.kernels={mode}"])


@pytest.mark.slow
def test_prefill_chunk_and_decode_with_kernels_equal_the_reference():
    d, cfg, params, token_map = load_port_case("A")
    ids = d["input_ids"]
    kcfg = with_kernels(cfg, "pallas_interpret")
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
    # The stored bytes are written by the same code either way: identical caches.
    for a, b in zip(jax.tree.leaves(ker), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_bad_kernels_mode_is_refused(write_config):
    with pytest.raises(dsv41.ConfigError) as e:
        dsv41.load_config(write_config({"runtime": {"kernels": "cuda"}}))
    assert "runtime.kernels" in str(e.value) and "'cuda'" in str(e.value) and "pallas_interpret" in str(e.value)
