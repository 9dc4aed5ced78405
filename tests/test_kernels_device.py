"""The Pallas kernels compiled for the accelerator JAX runs on (Triton on a GPU, Mosaic on a TPU) against their
plain-JAX references on the same device, at V4.1-Flash's own widths (DESIGN §8): 64 heads × 512 with a 128-key
window and 512 picks, the indexer's 32 heads × 128 over a few thousand MXFP4 keys.

The other kernel tests run the same bodies in interpret mode on the CPU; these compile them. On a CPU-only
machine (CI) they are skipped; on a GPU machine:

    JAX_PLATFORMS=cuda python -m pytest -q -m "slow or not slow" tests/test_kernels_device.py \\
        tests/test_kernels_steps.py tests/test_train_kernels.py

(the last two then run the cached steps and the train step through the compiled kernels). fp32 operands are
compared with the reference's matmuls at HIGHEST precision (the kernels' own): XLA's default on a GPU rounds
fp32 matmul operands to TF32, ~1e-3.

Tolerances as the interpret-mode tests': attention fp32 1e-5, bf16 queries 3e-2 (the kernel rounds the
unnormalised probabilities to bf16); quantisation bit for bit; indexer scores 1e-6 of the query's largest, index
sets equal except at near-ties (`assert_same_picks`).

Seen on an H200 with jax 0.11.2 (2026-12-04): the sparse attention's Triton body did not compile at these widths
(all 64 heads in one program asked 384 KB of shared memory, the chip has 227 KB), so `runtime.kernels=auto` runs
the XLA reference there (kernels/dispatch.py). The body now takes 16 heads a program and its 32-key tiles in a
loop on a GPU (docs/gpu.md); the quantisers failed then for want of a Triton `lax.round` and for a 256 KB pair
matrix. All three are mended since and lowered for CUDA on a CPU, not yet run on a GPU.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41 import quant
from dsv41.kernels import candidate_pool as cp
from dsv41.kernels import dispatch
from dsv41.kernels import indexer_scores as isc
from dsv41.kernels import quant_pack as qp
from dsv41.kernels import sparse_attention as sa
from dsv41.nn import indexer as ix
from test_kernels_indexer import assert_same_picks, assert_scores_close, packed_store, queries
from test_kernels_quant import _inputs, _same_bits

BACKEND = {"gpu": "gpu", "tpu": "tpu"}.get(jax.default_backend())
pytestmark = pytest.mark.skipif(BACKEND is None, reason="compiles the kernels for a GPU or TPU (JAX_PLATFORMS=cuda)")

H, K, W, N, TOP_K = 64, 512, 128, 2048, 512       # V4.1-Flash's attention widths
J, D_I = 32, 128                                  # its indexer's


def _jit(f, **static):
    return jax.jit(functools.partial(f, **static))


def _highest(f):
    """f with XLA's matmuls at full fp32 precision (the reference's, on a GPU)."""
    def run(*args, **kwargs):
        with jax.default_matmul_precision("highest"):
            return f(*args, **kwargs)
    return run


def _stores(rng, b, t_window, n):
    quantised = _jit(qp.quantize_pack_reference, fmt=quant.FP8_UE8M0_32)
    window = quantised(jnp.asarray(rng.standard_normal((b, t_window, K)) * 2, jnp.float32))
    entries = _jit(qp.quantize_pack_reference, fmt=quant.FP4_E4M3_16)(
        jnp.asarray(rng.standard_normal((b, n, K)) * 2, jnp.float32))
    return window, entries


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_decode_attention(dtype, tol):
    """4 rows: a wrapped ring with a window start, a short row, an empty row (output exactly 0), a full one;
    picks with −1s, repeated picks and picks past the filled part."""
    rng = np.random.default_rng(0)
    b = 4
    lengths = jnp.asarray([3 * W + 5, 40, 0, 5000], jnp.int32)
    window_ok = sa.ring_valid(lengths, jnp.asarray([2 * W + 60, 0, 0, 0], jnp.int32), W)
    picks = rng.integers(-1, N, (b, TOP_K)).astype(np.int32)
    picks[2] = -1
    picks[1, 100:] = -1
    (wv, ws), (ev, es) = _stores(rng, b, W, N)
    args = (jnp.asarray(rng.standard_normal((b, H, K)), dtype), wv, ws, window_ok, ev, es, jnp.asarray(picks),
            jnp.asarray(rng.standard_normal(H), jnp.float32))
    want = jax.jit(_highest(lambda *a: sa.sparse_decode_attention_reference(*a, K ** -0.5)))(*args)
    got = jax.jit(lambda *a: dispatch.sparse_decode_attention(*a, K ** -0.5, mode="pallas"))(*args)
    assert got.shape == (b, H, K) and got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    assert not np.asarray(got[2], np.float32).any()
    assert np.abs(np.asarray(want, np.float32)).max() > 0.1


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_prefill_chunk_attention(dtype, tol):
    """A chunk of 16 queries a row over [ring | new tokens], each query with its own window mask and picks."""
    rng = np.random.default_rng(1)
    b, s = 2, 16
    t = W + s
    window_ok = jnp.asarray(rng.random((b, s, t)) < 0.6).at[1, 3].set(False)
    picks = jnp.asarray(rng.integers(-1, N, (b, s, TOP_K)), jnp.int32).at[1, 3].set(-1)
    (wv, ws), (ev, es) = _stores(rng, b, t, N)
    args = (jnp.asarray(rng.standard_normal((b, s, H, K)), dtype), wv, ws, window_ok, ev, es, picks,
            jnp.asarray(rng.standard_normal(H), jnp.float32))
    want = jax.jit(_highest(lambda *a: sa.sparse_attention_reference(*a, K ** -0.5)))(*args)
    got = jax.jit(lambda *a: dispatch.sparse_attention_chunk(*a, K ** -0.5, mode="pallas"))(*args)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    assert not np.asarray(got[1, 3], np.float32).any()


def _indexer_case(rng, b, s, t, ratio):
    keys, scales = packed_store(rng, b, t, D_I)
    q, w = queries(rng, b, s, J, d_i=D_I)
    top = ratio * t
    positions = jnp.asarray(np.sort(rng.integers(0, top, (b, s)), axis=-1).astype(np.int32)).at[0, 0].set(0)
    return q, w, keys, scales, positions


def test_indexer_scores_and_top_k():
    """Prefill-shaped: 2 rows × 24 queries over 4,000 keys at ratio 4 (not a multiple of any tile), the first
    query sees nothing; then the top-512."""
    rng = np.random.default_rng(2)
    q, w, keys, scales, positions = _indexer_case(rng, 2, 24, 4000, 4)
    reference = jax.jit(_highest(functools.partial(isc.indexer_scores_reference, ratio=4)))
    want = reference(q, w, keys, scales, positions)
    scores, block_max = _jit(isc.indexer_scores, ratio=4, pool_block=8, backend=BACKEND)(q, w, keys, scales,
                                                                                            positions)
    assert np.all(np.isneginf(np.asarray(scores[0, 0])))
    assert_scores_close(scores, want)
    padded = jnp.pad(scores, [(0, 0), (0, 0), (0, -scores.shape[-1] % 8)], constant_values=-jnp.inf)
    np.testing.assert_array_equal(block_max, padded.reshape(2, 24, -1, 8).max(-1))
    picks = _jit(isc.indexer_top_k, ratio=4, k=TOP_K, backend=BACKEND)(q, w, keys, scales, positions)
    assert_same_picks(picks, ix.top_k_indices(want, TOP_K), want)


def test_candidate_source_and_reindex_pool():
    """The candidate source's picks and pool (64 blocks of 8) in one pass, then a Reindex layer's top-k over
    that pool, each against the reference on the same device."""
    rng = np.random.default_rng(3)
    q, w, keys, scales, positions = _indexer_case(rng, 2, 8, 3000, 2)
    scores = jax.jit(_highest(functools.partial(isc.indexer_scores_reference, ratio=2)))(q, w, keys, scales,
                                                                                          positions)
    picks, pool = _jit(cp.scores_and_pool, ratio=2, top_k=TOP_K, max_blocks=64, block=8, backend=BACKEND)(
        q, w, keys, scales, positions)
    assert_same_picks(picks, ix.top_k_indices(scores, TOP_K), scores)
    want_pool = ix.candidate_block_ids(scores, (positions + 1) // 2, 64, 8)
    newest = np.asarray((positions + 1) // 2 - 1) // 8
    pinned = jnp.where(jnp.arange(-(-3000 // 8)) == jnp.asarray(newest)[..., None], jnp.inf,
                       jnp.pad(scores, [(0, 0), (0, 0), (0, -3000 % 8)], constant_values=-jnp.inf)
                       .reshape(2, 8, -1, 8).max(-1))
    assert_same_picks(pool, want_pool, pinned)

    got_scores, got_entry = _jit(cp.pool_scores, block=8, ratio=2, backend=BACKEND)(
        q, w, keys, scales, want_pool, positions_BS=positions)
    want_scores, want_entry = jax.jit(_highest(functools.partial(cp.pool_scores_reference, block=8, ratio=2)))(
        q, w, keys, scales, want_pool, positions_BS=positions)
    np.testing.assert_array_equal(got_entry, want_entry)
    assert_scores_close(got_scores, want_scores)


@pytest.mark.parametrize("fmt", qp.FORMATS)
def test_quantize_pack_and_unpack_are_bit_exact(fmt):
    x = jnp.concatenate([_inputs(K)] * 8)                      # ~1,600 rows: several 256-row tiles
    want_v, want_s = _jit(qp.quantize_pack_reference, fmt=fmt)(x)
    got_v, got_s = _jit(qp.quantize_pack, fmt=fmt, backend=BACKEND)(x)
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    np.testing.assert_array_equal(np.asarray(got_s), np.asarray(want_s))
    _same_bits(_jit(qp.unpack_dequantize, fmt=fmt, backend=BACKEND)(want_v, want_s),
               _jit(qp.unpack_dequantize_reference, fmt=fmt)(want_v, want_s))
