"""The indexer kernels (kernels/indexer_scores.py, kernels/candidate_pool.py) in interpret mode against
their plain-JAX references, both kernel bodies (Mosaic TPU, Triton GPU).

Tolerances: scores are fp32 on both sides from the same FP4 products; only the accumulation order over
dI and heads differs, so |kernel − reference| <= 1e-6 · max|I| of the query (measured: 0 to 2e-7).
Index sets (top-k, pool blocks) must be equal except at near-ties: an entry in one set and not the other
must score within 1e-5 · max|I| of the reference's k-th best (checked explicitly, `assert_same_picks`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41.kernels import candidate_pool as cp
from dsv41.kernels import indexer_scores as isc
from dsv41.nn import indexer as ix

BACKENDS = ["tpu", "gpu"]
TILE_T = {"tpu": 128, "gpu": 64}   # tiny tiles: several key tiles, the last one partial
D_I = 64                           # two UE8M0 scales per key, 32 packed bytes
SCORE_RTOL, TIE_RTOL = 1e-6, 1e-5


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])


def packed_store(rng, b: int, t: int, d_i: int = D_I):
    """(uint8 keys [B, T, dI/2], uint8 scales [B, T, dI/32]): random bytes are valid MXFP4 keys (every
    nibble is an E2M1 code); scale bytes 124..130 are 2^-3..2^3."""
    keys = rng.integers(0, 256, (b, t, d_i // 2), dtype=np.uint8)
    return jnp.asarray(keys), jnp.asarray(rng.integers(124, 131, (b, t, d_i // 32), dtype=np.uint8))


def queries(rng, b: int, s: int, j: int, dtype=jnp.float32, d_i: int = D_I):
    """An FP4 query as the model's fake-quant makes it (E2M1 values × 2^k per 32), and head weights."""
    values = rng.choice(E2M1, (b, s, j, d_i // 32, 32)) * rng.choice([-1, 1], (b, s, j, d_i // 32, 32))
    q = values * np.exp2(rng.integers(-2, 3, (b, s, j, d_i // 32, 1)))
    return jnp.asarray(q.reshape(b, s, j, d_i), dtype), jnp.asarray(rng.standard_normal((b, s, j)), jnp.float32)


def assert_scores_close(got, want):
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    scale = np.max(np.abs(np.where(finite, want, 0)), axis=-1, keepdims=True)
    error = np.abs(np.where(finite, got, 0) - np.where(finite, want, 0))
    assert np.all(error <= SCORE_RTOL * scale), np.max(error / np.maximum(scale, 1e-30))


def assert_same_picks(got, want, want_scores):
    """Equal index sets per query, except entries scoring within TIE_RTOL of the reference's k-th best;
    `got` must keep the contract: ascending, −1 only at the end."""
    got, want, want_scores = np.asarray(got), np.asarray(want), np.asarray(want_scores)
    for row in np.ndindex(got.shape[:-1]):
        g, w, sc = got[row], want[row], want_scores[row]
        valid = g[g >= 0]
        assert np.all(g[len(valid):] == -1) and np.all(np.diff(valid) > 0), g
        assert len(valid) == np.sum(w >= 0)
        differ = np.setxor1d(valid, w[w >= 0])
        if len(differ):
            kth = np.min(sc[w[w >= 0]])
            tol = TIE_RTOL * np.max(np.abs(sc[np.isfinite(sc)]))
            assert np.all(np.abs(sc[differ] - kth) <= tol), (row, differ, sc[differ], kth)


def jitted(fn, **static):
    return jax.jit(functools.partial(fn, **static))


@pytest.mark.parametrize("backend", BACKENDS)
def test_scores_block_max_and_top_k(backend):
    """Prefill-shaped: 2 rows × 5 queries × 4 heads, T = 300 (not a multiple of the tile or block),
    ratio 2 so query 0 sees nothing, k = 40 above what early queries reach."""
    rng = np.random.default_rng(0)
    keys, scales = packed_store(rng, 2, 300)
    q, w = queries(rng, 2, 5, 4)
    positions = jnp.asarray([[0, 1, 77, 300, 599], [2, 9, 150, 301, 402]], jnp.int32)
    scores, block_max = jitted(isc.indexer_scores, ratio=2, pool_block=8, backend=backend, interpret=True,
                               tile_s=4, tile_t=TILE_T[backend])(q, w, keys, scales, positions)
    want = jitted(isc.indexer_scores_reference, ratio=2)(q, w, keys, scales, positions)
    assert scores.shape == want.shape == (2, 5, 300)
    assert np.all(np.isneginf(scores[0, 0]))                       # (0 + 1) // 2 = 0 visible
    assert_scores_close(scores, want)
    # Block maxima are the max of the scores the kernel returned (−inf padding past T).
    padded = jnp.pad(scores, [(0, 0), (0, 0), (0, 4)], constant_values=-jnp.inf)
    np.testing.assert_array_equal(block_max, padded.reshape(2, 5, -1, 8).max(-1))
    picks = ix.top_k_indices(scores, 40)
    assert np.all(np.asarray(picks[0, 0]) == -1)
    assert_same_picks(picks, ix.top_k_indices(want, 40), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_bf16_query_top_k(backend):
    """Decode (S = 1) with a bf16 query, the model's case: bf16 MXU operands round nothing."""
    rng = np.random.default_rng(1)
    keys, scales = packed_store(rng, 3, 200)
    q, w = queries(rng, 3, 1, 8, jnp.bfloat16)
    positions = jnp.asarray([[0], [63], [199]], jnp.int32)                  # ratio 1: 1, 64, 200 visible
    got = jitted(isc.indexer_top_k, ratio=1, k=96, backend=backend, interpret=True,
                 tile_t=TILE_T[backend])(q, w, keys, scales, positions)
    want_scores = jitted(isc.indexer_scores_reference, ratio=1)(q, w, keys, scales, positions)
    assert np.sum(np.asarray(got) >= 0, axis=-1).tolist() == [[1], [64], [96]]
    assert_same_picks(got, ix.top_k_indices(want_scores, 96), want_scores)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scores_and_pool(backend):
    """The candidate source at ratio 2: picks and pool in one pass against full scores +
    candidate_block_ids; the newest visible block is pinned; a query that sees nothing gets −1s."""
    rng = np.random.default_rng(2)
    keys, scales = packed_store(rng, 2, 256)
    q, w = queries(rng, 2, 2, 4)
    positions = jnp.asarray([[9, 511], [0, 341]], jnp.int32)                # 5, 256, 0, 171 visible
    picks, pool = jitted(cp.scores_and_pool, ratio=2, top_k=24, max_blocks=6, block=8, backend=backend,
                         interpret=True, tile_t=TILE_T[backend])(q, w, keys, scales, positions)
    # scores_and_pool_reference, its full scores kept for the tie check.
    scores = jitted(isc.indexer_scores_reference, ratio=2)(q, w, keys, scales, positions)
    want_picks = ix.top_k_indices(scores, 24)
    want_pool = ix.candidate_block_ids(scores, (positions + 1) // 2, 6, 8)
    assert_same_picks(picks, want_picks, scores)
    assert np.all(np.asarray(picks[1, 0]) == -1) and np.all(np.asarray(pool[1, 0]) == -1)
    assert np.asarray(pool[0, 0]).tolist() == [0, -1, -1, -1, -1, -1]      # 5 entries: one block
    newest = np.asarray((positions + 1) // 2 - 1) // 8
    for row in [(0, 1), (1, 1)]:
        assert newest[row] in np.asarray(pool[row])
    block_scores = scores.reshape(2, 2, -1, 8).max(-1)
    pinned = jnp.where(jnp.arange(32) == jnp.asarray(newest)[..., None], jnp.inf, block_scores)
    assert_same_picks(pool, want_pool, pinned)


def pool_scores_match(backend, q, w, keys, scales, ids, positions):
    """`pool_scores` in interpret mode (block 8, ratio 2, chunks of 4 blocks) against `pool_scores_reference`:
    equal entry ids, scores within SCORE_RTOL. Returns (scores, entry ids, the reference's scores and ids)."""
    scores, entry = jitted(cp.pool_scores, block=8, ratio=2, backend=backend, interpret=True,
                           chunk=4)(q, w, keys, scales, ids, positions_BS=positions)
    want_scores, want_entry = jitted(cp.pool_scores_reference, block=8, ratio=2)(
        q, w, keys, scales, ids, positions_BS=positions)
    np.testing.assert_array_equal(entry, want_entry)
    assert_scores_close(scores, want_scores)
    return scores, entry, want_scores, want_entry


@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_scores_and_top_k(backend):
    """Reindex over a gathered pool: −1 blocks (trailing and in the middle), blocks past the visible
    length, a partly visible block and a query that sees nothing, against pool_gather_scores; then
    top-k inside the pool with k above the usable entries of some queries."""
    rng = np.random.default_rng(3)
    keys, scales = packed_store(rng, 2, 384)
    q, w = queries(rng, 2, 3, 4)
    positions = jnp.asarray([[41, 767, 0], [403, 601, 1]], jnp.int32)     # ratio 2: 21, 384, 0 | 202, 301, 1
    ids = np.full((2, 3, 7), -1, np.int32)
    ids[0, 0, :4] = [0, 1, 2, 40]                      # 21 visible: block 2 partly, block 40 not at all
    ids[0, 1, :6] = [3, 17, 18, 30, 44, 47]
    ids[0, 2, :2] = [0, 1]                             # nothing visible yet
    ids[1, 0, [0, 2, 3]] = [5, 16, 25]                 # a −1 between real blocks; 25 = entries 200..207
    ids[1, 1, :7] = [0, 8, 9, 10, 20, 33, 37]
    ids[1, 2, :1] = [0]                                # 1 visible
    ids = jnp.asarray(ids)
    scores, entry, want_scores, want_entry = pool_scores_match(backend, q, w, keys, scales, ids, positions)
    assert np.sum(np.isfinite(scores), axis=-1).tolist() == [[21, 48, 0], [18, 53, 1]]
    k = 30
    got = cp.pool_picks(scores, entry, k)
    want = cp.pool_picks(want_scores, want_entry, k)
    assert np.sum(np.asarray(got) >= 0, axis=-1).tolist() == [[21, 30, 0], [18, 30, 1]]
    by_entry = np.full((2, 3, 384), -np.inf, np.float32)
    for row in np.ndindex(2, 3):
        ok = np.asarray(want_entry[row]) >= 0
        by_entry[row][np.asarray(want_entry[row])[ok]] = np.asarray(want_scores[row])[ok]
    assert_same_picks(got, want, by_entry)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t", [344, 100])
def test_pool_scores_read_a_store_that_ends_inside_a_tile(backend, t):
    """A store whose length is not a multiple of the TPU's 128-entry lane tile (a 1M-token cache holds
    1,000,000 decoder entries): blocks in its last, partial tile — or in its only tile — score as the
    reference does."""
    rng = np.random.default_rng(11)
    keys, scales = packed_store(rng, 2, t)
    q, w = queries(rng, 2, 2, 4)
    last = t // 8 - 1                                   # the last whole block of the store
    positions = jnp.asarray([[2 * t - 1, 2 * t - 40], [2 * t - 1, 9]], jnp.int32)   # ratio 2: t, t − 20 | t, 5
    ids = np.full((2, 2, 6), -1, np.int32)
    ids[0, 0, :5] = [0, 15, 16 if t > 128 else 1, last - 1, last]
    ids[0, 1, :3] = [2, last - 3, last]                # the last blocks partly or not visible
    ids[1, 0, [0, 2]] = [last - 5, last]
    ids[1, 1, :1] = [0]
    ids = jnp.asarray(ids)
    scores = pool_scores_match(backend, q, w, keys, scales, ids, positions)[0]
    assert np.isfinite(np.asarray(scores)[0, 0, 4 * 8:5 * 8]).all()   # the store's last whole block is scored


def test_errors_name_the_field():
    rng = np.random.default_rng(5)
    keys, scales = packed_store(rng, 1, 128)
    q, w = queries(rng, 1, 1, 4)
    pos = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="index_keys: int32"):
        isc.indexer_scores(q, w, keys.astype(jnp.int32), scales, pos, 1, interpret=True)
    with pytest.raises(ValueError, match="index_scales"):
        isc.indexer_scores(q, w, keys, scales[..., :1], pos, 1, interpret=True)
    with pytest.raises(ValueError, match="backend='cpu'"):
        isc.indexer_scores(q, w, keys, scales, pos, 1, backend="cpu")
    with pytest.raises(ValueError, match="block_ids_BSn.shape"):
        cp.pool_scores(q, w, keys, scales, jnp.zeros((1, 2, 3), jnp.int32), 8, pos, 1, interpret=True)
    with pytest.raises(ValueError, match="block=12"):
        cp.pool_scores(q, w, keys, scales, jnp.zeros((1, 1, 3), jnp.int32), 12, pos, 1, interpret=True)


def test_costs_count_the_store_once_per_query_tile():
    """Decode at full size: 1M entries × 68 B read, 4 B written per entry; 2·J·(dI + 1) flops each."""
    bytes_moved, flops = isc.indexer_scores_cost(1, 1, 2**20, 32, 128)
    assert bytes_moved == 2**20 * (64 + 4 + 4) + 32 * (128 * 4 + 4)
    assert flops == 2 * 2**20 * 32 * 129
    # The GPU pool reads exactly the pool; the TPU one whole 128-entry tiles (16× at block 8).
    gpu, _ = cp.pool_scores_cost(1, 1, 2048, 8, 32, 128, backend="gpu")
    tpu, _ = cp.pool_scores_cost(1, 1, 2048, 8, 32, 128, backend="tpu")
    assert gpu == 2048 * 8 * (68 + 4) + 32 * 516 + 2048 * 4
    assert tpu == 2048 * 128 * (68 + 4) + 32 * 516 + 2048 * 4
