"""`quant: none` for V4.1 (DESIGN §3.8, §6): the inference cache holds floats in the compute dtype with
empty scales, and the cached steps equal the teacher-forced forward (which skips the fake-quant too).

A cut-down tiny model (layers 0–1 window-only, 2 Full and 3 Reuse at ratio 2, 4 Full and 5 Reindex at
ratio 1), two rows of 150 and 110 tokens: the 16-token window wraps, the top-8 and the 4-block pool
saturate. Every prefill call is [2, 40] or [2, 110] and every decode [2, 1] on a 160-token cache, so
the prefix-cache test reuses the compiled steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41
from dsv41 import cache as cache_lib
from dsv41 import config as config_lib
from dsv41 import prefix_cache as pc_lib
from dsv41 import steps

TOL = 1e-5  # measured ≤ 2.2e-7: the cached and the teacher-forced paths differ only in summation order
LENGTHS, FIRST, MAX_LEN, DECODE = (150, 110), (40, 27), 160, 3


def small_config(*overrides):
    d = dsv41.load_config("tiny", ["quant=none", *overrides]).to_dict()
    d["csa2"]["encoder"].update(layers=4, groups=[{"size": 2, "modes": ["full", "reuse"]}])
    d["csa2"]["decoder"].update(layers=2, groups=[{"size": 1, "modes": ["full"]}, {"size": 1, "modes": ["reindex"]}])
    d["architecture"]["mhc"]["sinkhorn_iters"] = 3
    return config_lib.build(d)


@pytest.fixture(scope="module")
def model():
    """(cfg, params, ids [2, 153], teacher-forced logits [2, 153, V]): causal, so row 1's logits up to
    position 112 are those of its own 113-token prefix."""
    cfg = small_config()
    assert [r.mode for r in dsv41.layer_plan(cfg)] == ["window", "window", "full", "reuse", "full", "reindex"]
    params = dsv41.init_params(cfg, jax.random.key(0))
    ids = np.random.default_rng(0).integers(0, cfg.architecture.vocab_size, (2, LENGTHS[0] + DECODE))
    return cfg, params, ids, np.asarray(dsv41.forward(params, cfg, ids))


def _prefill_and_decode(cfg, params, ids, ref, chunks=True):
    """Prefill in two uneven chunks ([2, 40], then [2, 110]) and decode 3 steps; max |Δ logits| per call."""
    c = cache_lib.init_cache(cfg, 2, MAX_LEN)
    first = np.where(np.arange(40) < np.array(FIRST)[:, None], ids[:, :40], 0)
    logits, c = steps.prefill(params, cfg, c, first, lengths=FIRST)
    errors = [np.abs(np.asarray(logits) - ref[[0, 1], [FIRST[0] - 1, FIRST[1] - 1]]).max()]
    if chunks:
        rest = np.zeros((2, 110), np.int64)
        for row in range(2):
            rest[row, :LENGTHS[row] - FIRST[row]] = ids[row, FIRST[row]:LENGTHS[row]]
        logits, c = steps.prefill(params, cfg, c, rest, lengths=[n - f for n, f in zip(LENGTHS, FIRST)])
        errors.append(np.abs(np.asarray(logits) - ref[[0, 1], [LENGTHS[0] - 1, LENGTHS[1] - 1]]).max())
    held = np.asarray(c.lengths)
    for _ in range(DECODE):
        logits, c = steps.decode(params, cfg, c, ids[[0, 1], held])
        errors.append(np.abs(np.asarray(logits) - ref[[0, 1], held]).max())
        held = held + 1
    return errors, c


def test_cache_leaves_are_floats_for_quant_none_and_packed_for_qat():
    none, qat = small_config(), small_config("quant=qat")
    k, d_i, w, layers = 64, 32, 16, 6
    f = cache_lib.abstract_cache(none, 2, MAX_LEN)
    q = cache_lib.abstract_cache(qat, 2, MAX_LEN)
    # one ring leaf per stack slot, [layers of the slot, B, W, ·]; per layer [B, W, ·] in layer order
    for c, dtype, scales in ((f, jnp.float32, 0), (q, jnp.uint8, k // 32)):
        assert sum(x.shape[0] for x in c.window) == layers and len(c.window) == len(c.window_scales)
        assert [(x.shape, x.dtype) for x in cache_lib.layer_rings(none, c.window)] == [((2, w, k), dtype)] * layers
        assert [x.shape for x in cache_lib.layer_rings(none, c.window_scales)] == [(2, w, scales)] * layers
    for ratio, fc, qc in zip((2, 1), cache_lib.layer_stores(none, f).values(), cache_lib.layer_stores(qat, q).values()):
        t = MAX_LEN // ratio
        assert [(x.shape, x.dtype) for x in (fc.entries, fc.entry_scales, fc.index_keys, fc.index_scales)] == [
            ((2, t, k), jnp.float32), ((2, t, 0), jnp.uint8), ((2, t, d_i), jnp.float32), ((2, t, 0), jnp.uint8)]
        assert [(x.shape, x.dtype) for x in (qc.entries, qc.entry_scales, qc.index_keys, qc.index_scales)] == [
            ((2, t, k // 4), jnp.uint16), ((2, t, k // 16), jnp.uint8), ((2, t, d_i // 2), jnp.uint8),
            ((2, t, d_i // 32), jnp.uint8)]
        assert fc.leftover.shape == qc.leftover.shape == (2, ratio - 1, 2 * k)
    assert cache_lib.quantised(q) and not cache_lib.quantised(f)
    # nbytes counts the floats: 4 bytes a value; the per-sequence leaves are the qat cache's.
    per_row = 4 * (layers * w * k + (80 + 160) * (k + d_i) + 1 * 2 * k) + 4 * (1 + layers)  # + lengths, window starts
    assert cache_lib.nbytes(f) == 2 * per_row
    assert cache_lib.nbytes(q) == cache_lib.expected_bytes(qat, 2, MAX_LEN)["total"]
    with pytest.raises(dsv41.ConfigError, match="'quant' = 'none'.*the quantised cache"):
        cache_lib.expected_bytes(none, 2, MAX_LEN)


@pytest.mark.slow
def test_chunked_prefill_and_decode_equal_the_teacher_forced_forward(model):
    cfg, params, ids, ref = model
    errors, c = _prefill_and_decode(cfg, params, ids, ref)
    assert max(errors) <= TOL, errors
    assert c.lengths.tolist() == [LENGTHS[0] + DECODE, LENGTHS[1] + DECODE]
    assert c.window[0].dtype == jnp.float32 and c.compressed[0].entries.dtype == jnp.float32  # [G, B, T, K]


@pytest.mark.slow
def test_every_entry_selected_equals_the_forward():
    """top-k ≥ the store's entries (`dsv41 verify`'s all-entries variant): the cached steps pick every visible
    entry without scoring them, as the forward's top-k over all of them does (scored in 32-entry tiles too)."""
    cfg = small_config("csa2.indexer.top_k=160", "csa2.indexer.hierarchical.enabled=false", "runtime.score_tile=32")
    params = dsv41.init_params(cfg, jax.random.key(1))
    ids = np.random.default_rng(1).integers(0, cfg.architecture.vocab_size, (2, LENGTHS[0] + DECODE))
    errors, _ = _prefill_and_decode(cfg, params, ids, np.asarray(dsv41.forward(params, cfg, ids)))
    assert max(errors) < TOL, errors


def test_pallas_kernels_requested_run_the_reference_on_the_float_cache(model):
    """`runtime.kernels = pallas_interpret` would hand packed bytes to the kernels: with the float cache
    the attention, indexer top-k, pool and Reindex paths take the XLA reference and give the same logits."""
    _, params, ids, ref = model
    cfg = small_config("runtime.kernels=pallas_interpret")
    errors, _ = _prefill_and_decode(cfg, params, ids, ref, chunks=False)
    assert max(errors) <= TOL, errors


@pytest.mark.slow
def test_prefix_cache_keeps_the_float_cache(model, tmp_path):
    """The store keeps the float leaves: a cold run equals the forward, and a restore from disk (rings
    from the pool) equals the cold run bit for bit."""
    cfg, params, ids, ref = model
    prompts = [ids[row, :LENGTHS[row]].tolist() for row in range(2)]
    pc = pc_lib.PrefixCache(cfg, params, tmp_path, block_tokens=32)
    logits, cold, infos = pc.prefill(prompts, MAX_LEN, chunk=40)
    assert [i.rings for i in infos] == ["none", "none"]
    assert np.abs(np.asarray(logits) - ref[[0, 1], [LENGTHS[0] - 1, LENGTHS[1] - 1]]).max() <= TOL
    stored = [pc_lib.decode_entry(p.read_bytes())[1] for p in tmp_path.glob("*.kv")]
    assert len(stored) == 128 // 32 + 96 // 32  # each row's blocks up to its last restorable boundary
    assert {str(a.dtype) for s in stored for n, a in s.items() if n.endswith(("entries", "index_keys"))} == {"float32"}
    warm, again, infos = pc.prefill(prompts, MAX_LEN, chunk=40)
    assert [(i.n_cached, i.rings) for i in infos] == [(128, "pool"), (96, "pool")]
    assert np.array_equal(np.asarray(warm), np.asarray(logits))
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(cold)))
