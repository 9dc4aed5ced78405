"""Work follows the filled length (DESIGN §6): the cached steps' indexer scores, ranks and pools only the
tiles of its store up to the rows' lengths (`indexer.filled_top_k`, `runtime.score_tile`), and picks what
scoring the whole capacity picks: against a NumPy ranking (ties to the lowest index) and, end to end,
prefill and decode with 8-entry tiles against one whole-capacity pass, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41
from dsv41 import cache as cache_lib
from dsv41 import kv_store
from dsv41 import model, steps
from dsv41.nn import indexer as ix


def numpy_top_k(scores, k):
    """Per query the k best finite scores, ties to the lower index; ascending ids, −1 padded."""
    out = np.full((*scores.shape[:-1], k), -1)
    for idx in np.ndindex(scores.shape[:-1]):
        row = scores[idx]
        order = sorted((i for i in range(row.size) if np.isfinite(row[i]) or row[i] > 0), key=lambda i: (-row[i], i))
        picked = sorted(order[:k])
        out[idx][:len(picked)] = picked
    return out


def numpy_pool(scores, visible_count, max_blocks, block):
    """Blocks ranked by their best entry (the newest visible block pinned first), ties to the lower id."""
    t = scores.shape[-1]
    blocks = scores.reshape(*scores.shape[:-1], t // block, block).max(-1)
    newest = (visible_count - 1) // block
    for idx in np.ndindex(blocks.shape[:-1]):
        if newest[idx] >= 0:
            blocks[idx][newest[idx]] = np.inf
    return numpy_top_k(blocks, max_blocks)


@pytest.mark.parametrize("t,tile,block", [(64, 8, 8), (64, 16, 8), (64, 64, 8), (56, 24, 8), (60, 16, 4)])
def test_filled_top_k_ranks_as_numpy_over_the_filled_tiles(t, tile, block):
    """Tiles that divide the capacity, and tiles that do not (the last one overlaps the one before)."""
    rng = np.random.default_rng(0)
    b, s, k, max_blocks = 2, 3, 5, 3
    scores = rng.integers(0, 4, (b, s, t)).astype(np.float32)  # many exact ties
    visible = np.array([[9, 17, t - 3], [1, 0, 26]])            # entries each query may see
    scores = np.where(np.arange(t) < visible[..., None], scores, -np.inf)
    tiles_run = []

    def tile_scores(start):
        tiles_run.append(start)
        return jax.lax.dynamic_slice_in_dim(jnp.asarray(scores), start, tile, axis=2)

    picks, pool = jax.jit(lambda: ix.filled_top_k(tile_scores, (b, s), t, tile, jnp.max(visible), k,
                                                  (max_blocks, block, jnp.asarray(visible))))()
    np.testing.assert_array_equal(np.asarray(picks), numpy_top_k(scores, k))
    np.testing.assert_array_equal(np.asarray(pool), numpy_pool(scores, visible, max_blocks, block))
    # and as the whole-capacity functions rank
    np.testing.assert_array_equal(np.asarray(picks), np.asarray(ix.top_k_indices(jnp.asarray(scores), k)))
    np.testing.assert_array_equal(np.asarray(pool), np.asarray(ix.candidate_block_ids(
        jnp.asarray(scores), jnp.asarray(visible), max_blocks, block)))


def test_the_trip_count_is_the_filled_tiles():
    """Scores of tiles past the filled length are never looked at: poisoning them changes nothing, while
    poisoning a filled tile does."""
    b, s, t, tile, k = 1, 2, 64, 8, 4
    base = np.tile(np.arange(t, dtype=np.float32), (b, s, 1))
    filled = 20  # tiles 0..2 run

    def run(scores):
        fn = lambda start: jax.lax.dynamic_slice_in_dim(jnp.asarray(scores), start, tile, axis=2)
        return np.asarray(jax.jit(lambda: ix.filled_top_k(fn, (b, s), t, tile, jnp.int32(filled), k)[0])())

    want = run(base)
    np.testing.assert_array_equal(want, [[[20, 21, 22, 23]] * 2])  # the best of tiles 0..2
    late, early = base.copy(), base.copy()
    late[..., 24:] = 1e9  # past the filled tiles
    early[..., 3] = 1e9
    np.testing.assert_array_equal(run(late), want)
    assert 3 in run(early)


@pytest.mark.parametrize("chunk_blocks", [1, 2, 3, 8])
@pytest.mark.parametrize("source", ["keys", "store"])
def test_pool_chunks_top_k_ranks_as_numpy_over_the_pool(chunk_blocks, source):
    """A Reindex layer's selection scores its candidate pool a few blocks at a time with a running top-k
    (`indexer.pool_chunks_top_k`; training reads the keys, decode the Full layer's packed index store, a
    chunk's entries at a time): the picks of NumPy float64 lightning scores over each query's pool entries
    (everything else −inf; ties to the lower entry), with pools of different sizes, −1 padded, and entries
    not yet visible; and those of the whole pool at once (`pool_top_k`)."""
    rng = np.random.default_rng(1)
    b, s, heads, d, t, block, n, k = 2, 3, 4, 32, 48, 4, 5, 6
    q = rng.integers(-2, 3, (b, s, heads, d)).astype(np.float32)  # small integers: exact sums, many ties
    w = rng.integers(0, 3, (b, s, heads)).astype(np.float32)
    keys = rng.integers(-2, 3, (b, t, d)).astype(np.float32)
    keys[:, :, 0] = 2  # every 32-key block's max is 2: MXFP4 (scale 2^-1 x E2M1) holds each key exactly
    pools = np.full((b, s, n), -1)
    for r, row in enumerate([[[0, 3, 7, 9, 11], [2, 5], [1]], [[4, 6, 8], [], [0, 1, 2, 10, 11]]]):
        for i, ids in enumerate(row):
            pools[r, i, :len(ids)] = ids
    visible = np.array([[45, 30, 6], [40, 0, 47]])
    dots = np.einsum("bshd,btd->bsht", q.astype(np.float64), keys.astype(np.float64))
    full = np.einsum("bsh,bsht->bst", w / np.sqrt(heads), np.maximum(dots, 0)) / np.sqrt(d)
    in_pool = np.zeros((b, s, t), bool)
    for idx in np.ndindex(b, s):
        for blk in pools[idx]:
            if blk >= 0:
                in_pool[idx][blk * block:(blk + 1) * block] = True
    want = numpy_top_k(np.where(in_pool & (np.arange(t) < visible[..., None]), full, -np.inf), k)
    read = jnp.asarray(keys)
    if source == "store":  # stacked as the cache holds it, this layer second of three
        packed, scales = kv_store.quant_keys(jnp.asarray(np.stack([keys * 0, keys, keys * 0])))
        read = kv_store.LayerStore({"index_keys": packed, "index_scales": scales}, 1)
        np.testing.assert_array_equal(np.asarray(kv_store.dequant_keys(read.get("index_keys"),
                                                                       read.get("index_scales"))), keys)
    args = (jnp.asarray(q), jnp.asarray(w), read, jnp.asarray(pools, jnp.int32), block, jnp.asarray(visible))
    got = jax.jit(lambda: ix.pool_chunks_top_k(*args, k, chunk_blocks, group=1))()
    np.testing.assert_array_equal(np.asarray(got), want)
    entry, ok = ix.pool_entries(args[3], block, args[5])
    gathered = jax.vmap(lambda t_, i: t_[i])(jnp.asarray(keys), entry)
    at_once = ix.pool_top_k(ix.lightning_scores_per_query(args[0], gathered, args[1], ok), jnp.where(ok, entry, -1), k)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(at_once))


def test_score_tile_must_hold_whole_pool_blocks():
    with pytest.raises(dsv41.ConfigError, match="runtime.score_tile.*positions_per_block"):
        dsv41.load_config("tiny", ["runtime.score_tile=12"])
    with pytest.raises(dsv41.ConfigError, match="runtime.score_tile"):
        dsv41.load_config("tiny", ["runtime.score_tile=0"])


@pytest.mark.slow
def test_tiled_steps_equal_one_pass_over_the_capacity():
    """tiny (qat), rows of different lengths: prefill and decode scoring 40-entry tiles up to the filled
    length (the decoder's 64 entries: a second tile from 24, overlapping the first), or 8-entry ones (the
    Reindex layers' decode also reads its 4-block pool one block a time), give the logits and cache of
    scoring every entry at once, exactly."""
    rng = np.random.default_rng(3)
    out = {}
    for tile in (1024, 40, 8):
        cfg = dsv41.load_config("tiny", [f"runtime.score_tile={tile}"])
        params = model.init_params(cfg, jax.random.key(0))
        tokens = rng.integers(0, cfg.architecture.vocab_size, (2, 48)) if tile == 1024 else tokens
        c = cache_lib.init_cache(cfg, 2, 64)
        logits, c = steps.prefill(params, cfg, c, tokens[:, :44], [44, 13])
        got = [np.asarray(logits)]
        for i in range(44, 48):
            logits, c = steps.decode(params, cfg, c, tokens[:, i])
            got.append(np.asarray(logits))
        out[tile] = got, jax.tree.map(np.asarray, c)
    for tile in (40, 8):
        for a, b in zip(out[1024][0], out[tile][0]):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(jax.tree.leaves(out[1024][1]), jax.tree.leaves(out[tile][1])):
            np.testing.assert_array_equal(a, b)
