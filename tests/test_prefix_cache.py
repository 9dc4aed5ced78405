"""The prefix cache (DESIGN §7): exact restores from the store and the pool, bounded replay, damaged,
foreign and racing entries, TTL and byte budgets.

The tiny model, prompts of at most 100 tokens, blocks of 32 (16 where the replay must cover the whole
prefix), and one prefill width (32) so that one compiled step serves every call."""

import shutil

import jax
import numpy as np
import pytest

import dsv41
from dsv41 import cache as cache_lib
from dsv41 import prefix_cache as pc_lib
from dsv41 import xla_options

CHUNK, MAX_LEN, BLOCK = 32, 128, 32
SWA_TTL = 5 * 60


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self):
        return self.now


@pytest.fixture(scope="module")
def model():
    cfg = dsv41.load_config("tiny")
    params = dsv41.init_params(cfg, jax.random.key(0))
    prompt = np.random.default_rng(0).integers(0, cfg.architecture.vocab_size, 100).tolist()
    return cfg, params, prompt


@pytest.fixture(scope="module")
def cold(model, tmp_path_factory):
    """A cold run (empty store): its logits, cache and the directory it filled (blocks 0..2, rings at 96)."""
    cfg, params, prompt = model
    directory = tmp_path_factory.mktemp("cold")
    clock = Clock()
    pc = pc_lib.PrefixCache(cfg, params, directory, block_tokens=BLOCK, clock=clock)
    logits, cache, infos = pc.prefill([prompt], MAX_LEN, chunk=CHUNK)
    return dict(pc=pc, clock=clock, dir=directory, prompt=prompt, logits=np.asarray(logits), cache=cache, info=infos[0])


def _leaves_equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _global_rows_equal(a, b, n, cfg, row_a=0, row_b=0):
    """The global KV of the first n tokens (every per-entry leaf of every Full layer) is the same."""
    full = [r for r in dsv41.layer_plan(cfg) if r.stores_entries]
    stores_a, stores_b = cache_lib.layer_stores(cfg, a), cache_lib.layer_stores(cfg, b)
    for rec in full:
        x, y = stores_a[rec.index], stores_b[rec.index]
        for f in ("entries", "entry_scales", "index_keys", "index_scales"):
            if not np.array_equal(np.asarray(getattr(x, f))[row_a, :n // rec.ratio],
                                  np.asarray(getattr(y, f))[row_b, :n // rec.ratio]):
                return False
    return True


def _copy_dir(cold, tmp_path):
    d = tmp_path / "store"
    shutil.copytree(cold["dir"], d)
    return d


# ------------------------------------------------------------------------------------------------
# Exact restores


@pytest.mark.slow
def test_cold_run_fills_the_store(cold):
    assert cold["info"] == pc_lib.RestoreInfo(0, "none")
    assert len(list(cold["dir"].glob("*.kv"))) == 3  # blocks 0..2: the prefix up to 96 of 100 tokens
    assert not list(cold["dir"].glob("*.swa"))       # enable_prefix_cache_global_only: rings stay in memory


@pytest.mark.slow
def test_pool_hit_equals_the_cold_prefill_exactly(model, cold):
    cfg, params, prompt = model
    logits, cache, infos = cold["pc"].prefill([prompt], MAX_LEN, chunk=CHUNK)
    assert infos[0] == pc_lib.RestoreInfo(96, "pool")
    assert np.array_equal(np.asarray(logits), cold["logits"])
    assert _leaves_equal(cache, cold["cache"])
    # A longer prompt sharing the prefix restores the same 96 tokens; no block is written twice.
    writes = cold["pc"].counters.writes
    restored, n, infos = cold["pc"].restore([prompt + [7, 8, 9]], MAX_LEN)
    assert n == [96] and infos[0].rings == "pool" and cold["pc"].counters.writes == writes
    assert _global_rows_equal(restored, cold["cache"], 96, cfg)


@pytest.mark.slow
def test_replay_when_the_pool_entry_expired(model, cold, tmp_path):
    """Past the pool's TTL (not the store's) the rings are rebuilt by replaying the last 16 tokens; the
    replay reads the restored global KV and never rewrites it."""
    cfg, params, prompt = model
    clock = Clock()
    pc = pc_lib.PrefixCache(cfg, params, _copy_dir(cold, tmp_path), block_tokens=BLOCK, clock=clock)
    pc.pool.put(pc.keys(prompt[:96])[-1], {"window": np.stack([np.asarray(x[0]) for x in
                                                               cache_lib.layer_rings(cfg, cold["cache"].window)])})
    clock.now += SWA_TTL + 1
    cache, n, infos = pc.restore([prompt], MAX_LEN)
    assert infos[0] == pc_lib.RestoreInfo(96, "replay", (16, 16))
    assert pc.counters.expired == 1 and pc.counters.replays == 1 and pc.counters.pool_misses == 1
    assert _global_rows_equal(cache, cold["cache"], 96, cfg)
    for rec in dsv41.layer_plan(cfg):  # every window truncated to the replayed span
        assert int(cache.window_start[rec.index, 0]) == 96 - 16
    assert int(cache.lengths[0]) == 96


@pytest.mark.slow
def test_replay_covering_the_whole_prefix_is_exact(model, tmp_path):
    """Blocks of 16 = the replay length: a 20-token prompt restores 16 tokens and replays all of them, so
    no window is truncated and the answer is the cold one."""
    cfg, params, prompt = model
    clock = Clock()
    pc = pc_lib.PrefixCache(cfg, params, tmp_path, block_tokens=16, clock=clock)
    cold_logits, _, _ = pc.prefill([prompt[:20]], MAX_LEN, chunk=CHUNK)
    clock.now += SWA_TTL + 1
    logits, _, infos = pc.prefill([prompt[:20]], MAX_LEN, chunk=CHUNK)
    assert infos[0] == pc_lib.RestoreInfo(16, "replay", (16, 16))
    diff = float(np.abs(np.asarray(logits) - np.asarray(cold_logits)).max())
    if diff >= 1e-5 and not xla_options.dots_round_rows_alike():  # programs of 16 + 4 rows against one of 20
        pytest.xfail(f"{diff:.1e} from the cold logits: this machine's XLA:CPU GEMM rounds a dot's last rows by "
                     "the row count")
    assert diff < 1e-5, diff


@pytest.mark.slow
def test_restart_replays_unless_rings_are_persisted(model, cold, tmp_path):
    """A new process has an empty pool: global KV from disk, rings by replay; with
    enable_prefix_cache_global_only = false (V4-style) the rings come from disk, exactly."""
    cfg, params, prompt = model
    pc = pc_lib.PrefixCache(cfg, params, _copy_dir(cold, tmp_path), block_tokens=BLOCK, clock=Clock())
    _, _, infos = pc.restore([prompt], MAX_LEN)
    assert infos[0].rings == "replay"

    v4_style = dsv41.config.build(cfg.to_dict(), ["swa_bounded_replay.enable_prefix_cache_global_only=false"])
    d = tmp_path / "v4_style"
    writer = pc_lib.PrefixCache(v4_style, params, d, block_tokens=BLOCK, clock=Clock())
    assert writer.fp == cold["pc"].fp  # the replay settings do not change the KV
    at96 = _prefix_cache(cold, 96)
    writer.save(prompt[:96], at96)
    assert len(list(d.glob("*.full.swa"))) == 1
    reader = pc_lib.PrefixCache(v4_style, params, d, block_tokens=BLOCK, clock=Clock())
    restored, n, infos = reader.restore([prompt], MAX_LEN)
    assert infos[0] == pc_lib.RestoreInfo(96, "disk")
    for name in ("window", "window_scales", "window_start"):
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(getattr(restored, name)),
                                                        jax.tree.leaves(getattr(at96, name)), strict=True))


def _prefix_cache(cold, n):
    """The cache of the cold run as it stood at a block boundary n (restored from its own pool)."""
    cache, got, infos = cold["pc"].restore([cold_prompt(cold, n)], MAX_LEN)
    assert got == [n] and infos[0].rings == "pool"
    return cache


def cold_prompt(cold, n):
    # restore() keeps at least one token to prefill: the prefix plus one token restores n.
    return cold["prompt"][:n + 1]


# ------------------------------------------------------------------------------------------------
# Damaged, foreign and racing entries: detected, counted, deleted, never used


def _block_file(pc, prompt, k):
    return pc.store.path(pc.keys(prompt[:(k + 1) * BLOCK])[k])


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.parametrize("damage, counter", [(_truncate, "truncated"), (_flip, "corrupt")])
def test_damaged_entry_is_a_miss(model, cold, tmp_path, damage, counter):
    cfg, params, prompt = model
    pc = pc_lib.PrefixCache(cfg, params, _copy_dir(cold, tmp_path), block_tokens=BLOCK, clock=Clock())
    path = _block_file(pc, prompt, 1)
    damage(path)
    cache, n, _ = pc.restore([prompt], MAX_LEN)
    assert n == [32] and getattr(pc.counters, counter) == 1 and not path.exists()
    assert _global_rows_equal(cache, cold["cache"], 32, cfg)


@pytest.mark.slow
def test_damaged_first_block_gives_the_cold_answer(model, cold, tmp_path):
    cfg, params, prompt = model
    pc = pc_lib.PrefixCache(cfg, params, _copy_dir(cold, tmp_path), block_tokens=BLOCK, clock=Clock())
    _flip(_block_file(pc, prompt, 0))
    logits, cache, infos = pc.prefill([prompt], MAX_LEN, chunk=CHUNK)
    assert infos[0].n_cached == 0 and pc.counters.corrupt == 1
    assert np.array_equal(np.asarray(logits), cold["logits"]) and _leaves_equal(cache, cold["cache"])
    assert _block_file(pc, prompt, 0).exists()  # recomputed and stored again


@pytest.mark.slow
def test_entry_of_another_model_is_foreign(model, cold, tmp_path):
    cfg, params, prompt = model
    d = _copy_dir(cold, tmp_path)
    other = pc_lib.PrefixCache(cfg, params, tmp_path / "other", block_tokens=BLOCK, weights_id="another checkpoint")
    assert other.fp != cold["pc"].fp
    other.save(prompt[:96], _prefix_cache(cold, 96))
    pc = pc_lib.PrefixCache(cfg, params, d, block_tokens=BLOCK, clock=Clock())
    path = _block_file(pc, prompt, 1)
    shutil.copy(_block_file(other, prompt, 1), path)  # the other model's bytes under our key
    cache, n, _ = pc.restore([prompt], MAX_LEN)
    assert n == [32] and pc.counters.foreign == 1 and not path.exists()
    assert _global_rows_equal(cache, cold["cache"], 32, cfg)


@pytest.mark.slow
def test_two_writers_of_the_same_blocks(model, cold, tmp_path):
    """Two processes save the same prefix into one directory (and a crashed writer left a partial temp
    file): every entry is whole, and a reader restores the cold bytes."""
    cfg, params, prompt = model
    d = tmp_path / "shared"
    at96 = _prefix_cache(cold, 96)
    a = pc_lib.PrefixCache(cfg, params, d, block_tokens=BLOCK, clock=Clock())
    b = pc_lib.PrefixCache(cfg, params, d, block_tokens=BLOCK, clock=Clock())
    (d / f".tmp-{a.keys(prompt[:32])[0]}-1-dead").write_bytes(b"DSV41KV1\x00")
    assert a.save(prompt[:96], at96) > 0
    for path in d.glob("*.kv"):  # b lost the race on every block: it overwrites them all
        path.unlink()
    b.save(prompt[:96], at96)
    a.save(prompt[:96], at96)  # finds b's entries and leaves them
    reader = pc_lib.PrefixCache(cfg, params, d, block_tokens=BLOCK, clock=Clock())
    cache, n, _ = reader.restore([prompt], MAX_LEN)
    assert n == [96] and reader.counters.corrupt == reader.counters.truncated == reader.counters.foreign == 0
    assert _global_rows_equal(cache, cold["cache"], 96, cfg)


def test_entry_format_rejects_every_damage():
    arrays = {"a": np.arange(12, dtype=np.uint8).reshape(3, 4), "b": np.ones((2,), np.float32)}
    data = pc_lib.encode_entry({"key": "k"}, arrays)
    header, back = pc_lib.decode_entry(data)
    assert header["key"] == "k" and all(np.array_equal(back[n], arrays[n]) for n in arrays)
    for cut in (5, 20, len(data) - 1):
        with pytest.raises(pc_lib.EntryError, match="truncated"):
            pc_lib.decode_entry(data[:cut])
    for at in range(0, len(data), 7):
        damaged = bytearray(data)
        damaged[at] ^= 0x01
        with pytest.raises(pc_lib.EntryError):
            pc_lib.decode_entry(bytes(damaged))
    with pytest.raises(pc_lib.EntryError, match="corrupt"):
        pc_lib.decode_entry(data + b"\x00")


# ------------------------------------------------------------------------------------------------
# TTL and budgets


@pytest.mark.slow
def test_global_ttl_expires_blocks(model, cold, tmp_path):
    cfg, params, prompt = model
    clock = Clock()
    clock.now = cold["clock"].now + 71 * 3600
    pc = pc_lib.PrefixCache(cfg, params, _copy_dir(cold, tmp_path), block_tokens=BLOCK, clock=clock)
    assert pc.restore([prompt], MAX_LEN)[1] == [96]  # 71 h: fresh, and the hit restarts the TTL
    clock.now += 72 * 3600 - 1
    assert pc.restore([prompt], MAX_LEN)[1] == [96]
    clock.now += 72 * 3600 + 1
    _, n, infos = pc.restore([prompt], MAX_LEN)
    assert n == [0] and infos[0].rings == "none" and pc.counters.expired == 1
    assert len(list(pc.store.dir.glob("*.kv"))) == 2  # only block 0 was looked at; eviction drops the rest
    pc.store.evict()
    assert not list(pc.store.dir.glob("*.kv")) and pc.counters.expired == 3


def test_store_budget_evicts_least_recently_used(tmp_path):
    clock, counters = Clock(), pc_lib.Counters()
    arrays = {"x": np.zeros((1000,), np.uint8)}
    size = len(pc_lib.encode_entry({"k": 0}, arrays))
    store = pc_lib.DiskStore(tmp_path, ".kv", 3600.0, 2 * size + 10, clock, counters)
    accept = lambda header, arrays: None  # noqa: E731
    for key in ("a", "b"):
        store.put(key, {"k": 0}, arrays)
        clock.now += 1
    assert store.get("a", accept) is not None  # "a" is now the most recently used
    clock.now += 1
    store.put("c", {"k": 0}, arrays)
    assert sorted(p.stem for p in tmp_path.glob("*.kv")) == ["a", "c"] and counters.evicted == 1
    assert store.nbytes() <= 2 * size + 10


def test_pool_ttl_and_budget():
    clock, counters = Clock(), pc_lib.Counters()
    ring = {"window": np.zeros((100,), np.uint8)}
    pool = pc_lib.WindowPool(SWA_TTL, 250, clock, counters)
    pool.put("a", ring)
    clock.now += 1
    pool.put("b", ring)
    assert pool.get("a") is not None
    clock.now += 1
    pool.put("c", ring)  # 300 bytes > 250: "b", the least recently used, goes
    assert list(pool.items) == ["a", "c"] and counters.evicted == 1
    clock.now += SWA_TTL - 1  # "a" (inserted at t0) is past its TTL, "c" (t0 + 2) is not
    assert pool.get("a") is None and pool.get("c") is not None and counters.expired == 1


# ------------------------------------------------------------------------------------------------
# Batches and the CED schedule (one more compiled step each)


@pytest.mark.slow
def test_batch_rows_restore_independently(model, cold, tmp_path):
    """Row 0 shares the cached prefix (pool hit), row 1 has nothing cached: each row's answer is the one
    it gets alone."""
    cfg, params, prompt = model
    other = np.random.default_rng(1).integers(0, cfg.architecture.vocab_size, 60).tolist()
    alone = pc_lib.PrefixCache(cfg, params, tmp_path, block_tokens=BLOCK, clock=Clock())
    other_logits, _, _ = alone.prefill([other], MAX_LEN, chunk=CHUNK)
    logits, cache, infos = cold["pc"].prefill([prompt, other], MAX_LEN, chunk=CHUNK)
    assert [i.rings for i in infos] == ["pool", "none"]
    assert np.abs(np.asarray(logits)[0] - cold["logits"][0]).max() < 1e-5
    assert np.abs(np.asarray(logits)[1] - np.asarray(other_logits)[0]).max() < 1e-5
    assert cache.lengths.tolist() == [100, 60]


@pytest.mark.slow
def test_ced_schedule_pool_hit_is_exact_and_stores_the_same_global_kv(model, cold, tmp_path):
    """Under CED the restore point leaves the last decoder_replay_tokens to the final chunk (which replays
    them as a cold CED prefill does); its global KV is the full schedule's, byte for byte on disk."""
    cfg, params, prompt = model
    ced = dsv41.config.build(cfg.to_dict(), ["runtime.prefill_schedule=ced"])
    pc = pc_lib.PrefixCache(ced, params, tmp_path, block_tokens=BLOCK, clock=Clock())
    assert pc.restorable(100) == 64 and pc.fp == cold["pc"].fp
    cold_logits, cold_cache, _ = pc.prefill([prompt], MAX_LEN, chunk=CHUNK)
    for k in range(2):
        assert _block_file(pc, prompt, k).read_bytes() == _block_file(cold["pc"], prompt, k).read_bytes()
    logits, cache, infos = pc.prefill([prompt], MAX_LEN, chunk=CHUNK)
    assert infos[0] == pc_lib.RestoreInfo(64, "pool")
    assert np.array_equal(np.asarray(logits), np.asarray(cold_logits)) and _leaves_equal(cache, cold_cache)


@pytest.mark.slow
def test_block_size_must_close_every_group(model):
    cfg, params, _ = model
    with pytest.raises(dsv41.ConfigError, match=r"block_tokens' = 33: expected a positive multiple of 2"):
        pc_lib.PrefixCache(cfg, params, None, block_tokens=33)


# ------------------------------------------------------------------------------------------------
# Through generate: a conversation


@pytest.mark.slow
def test_a_second_turn_reuses_the_first_turns_prefix(model, tmp_path):
    """Turn 1 (40 prompt tokens, 88 generated) stores block 0 and its rings; turn 2 resends turn 1's
    prompt and the first 40 generated tokens plus 20 new ones: block 0 comes from the store and its
    rings from the pool, and the generated tokens equal a cold run's (both at one cache size, 128)."""
    from dsv41 import generate as generate_lib

    cfg, params, prompt = model
    pc = pc_lib.PrefixCache(cfg, params, tmp_path, block_tokens=BLOCK, clock=Clock())
    first = generate_lib.generate(params, cfg, prompt[:40], max_new_tokens=88, chunk=CHUNK, prefix_cache=pc)
    assert (pc.counters.writes, pc.counters.hits) == (1, 0)
    second_prompt = prompt[:40] + first[:40] + prompt[40:60]
    second = generate_lib.generate(params, cfg, second_prompt, max_new_tokens=28, chunk=CHUNK, prefix_cache=pc)
    assert (pc.counters.hits, pc.counters.pool_hits, pc.counters.replays) == (1, 1, 0)
    assert pc.counters.writes == 3  # blocks 1 and 2 of turn 2's prompt, for the next turn
    cold = generate_lib.generate(params, cfg, second_prompt, max_new_tokens=28, chunk=CHUNK)
    assert second == cold


@pytest.mark.slow
def test_a_prefix_cache_of_other_params_is_refused(model, tmp_path):
    from dsv41 import generate as generate_lib

    cfg, params, prompt = model
    pc = pc_lib.PrefixCache(cfg, jax.tree.map(lambda x: x, params), tmp_path, block_tokens=BLOCK)
    with pytest.raises(ValueError, match="prefix_cache: built for other parameters"):
        generate_lib.generate(params, cfg, prompt[:40], max_new_tokens=4, chunk=CHUNK, prefix_cache=pc)
