"""The inference cache and the prefill / decode steps against the port's vectors and the accounting."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.array import ArrayImpl

import dsv41
from dsv41 import cache as cache_lib
from dsv41 import steps
from conftest import load_port_case

TOL = 1e-5  # the port's vectors (its own paths agree to ~3e-7; rounding-level flips at hard thresholds aside)


@pytest.fixture(scope="module", params=["A", "B"])
def port(request):
    return load_port_case(request.param)


def test_cache_bytes_equal_the_accounting_at_toy_size():
    cfg = dsv41.load_config("tiny")
    c = cache_lib.init_cache(cfg, batch=3, max_len=512)
    per_token = 2 * (32 + 4 + 16 + 1) / 2 + (32 + 4 + 16 + 1)  # Full layers 2, 4 (ratio 2) and 6 (ratio 1)
    fixed = 12 * 16 * (64 + 2) + 2 * 1 * 2 * 64 * 4 + 4 + 12 * 4  # rings, leftovers, length, starts
    assert cache_lib.nbytes(c) == 3 * (per_token * 512 + fixed) == cache_lib.expected_bytes(cfg, 3, 512)["total"]


def test_cache_bytes_at_full_size_with_a_million_tokens():
    cfg = dsv41.load_config("v41_flash")
    shapes = jax.eval_shape(lambda: cache_lib.init_cache(cfg, batch=1, max_len=1_000_000))
    fixed = 40 * 128 * 528 + 3 * 1 * 2 * 512 * 4 + 4 + 3 * 4 + 40 * 4  # rings, leftovers, length, look-back, starts
    assert cache_lib.nbytes(shapes) == 890 * 1_000_000 + fixed == cache_lib.expected_bytes(cfg, 1, 1_000_000)["total"]


def test_capacities_round_up_to_the_compression_ratios():
    """A capacity is the next multiple of the ratios' lcm (tiny: ratios 1 and 2; tiny_v4: 4 and 16), within
    the context window (512 for both)."""
    tiny, v4 = dsv41.load_config("tiny"), dsv41.load_config("tiny_v4")
    assert [cache_lib.round_capacity(tiny, n) for n in (1, 33, 34, 511, 512)] == [2, 34, 34, 512, 512]
    assert [cache_lib.round_capacity(v4, n) for n in (1, 16, 17, 202, 497)] == [16, 16, 32, 208, 512]
    assert steps.capacity(tiny, cache_lib.init_cache(tiny, 1, 33)) == 34
    assert steps.capacity(v4, cache_lib.init_cache(v4, 1, 202)) == 208
    # The stores hold capacity / ratio entries: tiny's Full layer 2 (ratio 2), tiny_v4's HCA layer 3 (ratio 16).
    assert cache_lib.layer_stores(tiny, cache_lib.abstract_cache(tiny, 1, 33))[2].entries.shape[1] == 17
    assert cache_lib.layer_stores(v4, cache_lib.abstract_cache(v4, 1, 202))[3].entries.shape[1] == 13


@pytest.mark.parametrize("max_len,rule", [
    (0, "expected a positive whole number of tokens"), (-2, "expected a positive whole number of tokens"),
    (32.0, "expected a positive whole number of tokens"), (True, "expected a positive whole number of tokens"),
    (1024, "expected a capacity of at most context_window = 512 (the maximum context length)"),
    (513, "at most context_window = 512 (the maximum context length), got 514: 513 rounded up to a multiple of 2"),
])
def test_capacity_errors(max_len, rule):
    with pytest.raises(dsv41.ConfigError) as e:
        cache_lib.init_cache(dsv41.load_config("tiny"), 1, max_len)
    assert f"'max_len' = {max_len!r}" in str(e.value) and rule in str(e.value), str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("calls", ["free", "bound"])
def test_decode_after_prefill_matches_the_port(port, calls):
    """The free steps and `dsv41.bind`'s (parameters flattened, config keyed once) against the port."""
    d, cfg, params, token_map = port
    ids = d["input_ids"]
    run = dsv41.bind(params, cfg) if calls == "bound" else None
    prefill = run.prefill if run else lambda *a, **k: steps.prefill(params, cfg, *a, **k)
    decode = run.decode if run else lambda *a, **k: steps.decode(params, cfg, *a, **k)
    c = cache_lib.init_cache(cfg, 1, 256)
    logits, c = prefill(c, ids[:, :195], token_map=token_map)
    errors = [np.abs(np.asarray(logits)[0] - d["logits_prefill"][0, 194]).max()]
    for k, pos in enumerate(d["decode_positions"]):
        logits, c = decode(c, ids[:, pos], token_map=token_map)
        errors.append(np.abs(np.asarray(logits)[0] - d["logits_decode"][k]).max())
    assert max(errors) < TOL, errors
    assert int(c.lengths[0]) == 203


def test_a_bound_config_does_not_follow_later_changes():
    """`bind` keeps its own config: a field changed on the caller's config afterwards does not reach it."""
    from dsv41 import config, model
    cfg = config.build(dsv41.load_config("tiny").to_dict())
    bound = steps.Bound({"w": jnp.zeros(2)}, cfg)
    before = model.config_key(cfg)
    cfg.runtime.kernels = "reference" if cfg.runtime.kernels != "reference" else "auto"
    assert bound.key == before == model.config_key(bound.cfg) != model.config_key(cfg)
    assert bound.cfg.runtime.kernels != cfg.runtime.kernels


@contextlib.contextmanager
def no_device_reads(monkeypatch):
    """Every read of a device array's value on the host raises inside: through `_value` (int(), .tolist(),
    .item()) and through NumPy's np.asarray / np.array, which take jaxlib's C++ buffer without `_value`."""
    def refuse(x):
        raise AssertionError(f"a device -> host read of an array {x.shape} {x.dtype}")

    def numpy_guard(fn):
        return lambda x, *a, **k: refuse(x) if isinstance(x, jax.Array) else fn(x, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(ArrayImpl, "_value", property(refuse))
        m.setattr(np, "asarray", numpy_guard(np.asarray))
        m.setattr(np, "array", numpy_guard(np.array))
        yield


@pytest.mark.parametrize("read", ["asarray", "array", "int", "tolist"])
def test_the_guard_sees_a_device_read(monkeypatch, read):
    x = jnp.arange(3) + 1
    reads = {"asarray": lambda: np.asarray(x), "array": lambda: np.array(x), "int": lambda: int(x[0]),
             "tolist": lambda: x.tolist()}
    with pytest.raises(AssertionError, match="device -> host read"), no_device_reads(monkeypatch):
        reads[read]()


def test_prefill_and_decode_never_read_the_device(port, monkeypatch):
    """The host checks and the Engram look-back use the cache's host mirror (DESIGN §6): a prefill and
    decode steps (the port's Engram config) run with every device read refused and give bit for bit the
    logits of the same calls without the guard (their agreement with the port is
    test_decode_after_prefill_matches_the_port's)."""
    d, cfg, params, token_map = port
    ids = d["input_ids"]
    c = cache_lib.init_cache(cfg, 1, 256)
    def run(c):
        logits, c = steps.prefill(params, cfg, c, ids[:, :195], token_map=token_map)
        decoded = [logits]
        for pos in d["decode_positions"]:
            out, c = steps.decode(params, cfg, c, ids[:, pos], token_map=token_map)
            decoded.append(out)
        return decoded, c

    want, _ = run(cache_lib.init_cache(cfg, 1, 256))
    with no_device_reads(monkeypatch):
        got, c = run(c)
    assert c.mirror.lengths.tolist() == [203] == np.asarray(c.lengths).tolist()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="exceed the cache's capacity"), no_device_reads(monkeypatch):
        steps.prefill(params, cfg, c, np.zeros((1, 60), np.int32), token_map=token_map)


def first_near_tie(d) -> int:
    """The first position whose indexer top-k the port records as tied below float32 resolution (gap
    ≤ 1e-7): from there on the port's logits depend on rounding (case A: layer 8 at position 136, a gap of
    3.7e-9; case B: layer 8 at 192, 1.4e-8, which the port's own 1e-7 parameter-noise ablation flips)."""
    gaps = d["diag_index_gap"]
    near = np.argwhere(~np.isnan(gaps) & (gaps <= 1e-7))[:, 1]
    return int(near.min()) if near.size else d["input_ids"].shape[1]


@pytest.mark.slow
def test_rows_of_different_lengths_in_chunks(port):
    """Two rows (prefixes of the port's sequence, so the port's one-shot logits are the reference for
    both) prefilled in two uneven chunks, then decoded: window wrap, several pool blocks, top-k saturation
    and half-filled compression groups at every boundary. The rows end before the port's first top-k tied
    below float32 resolution (`first_near_tie`), where any two float32 implementations may pick apart.
    Every row of a chunk at once (`runtime.row_loop: off`, the default)."""
    _rows_in_chunks(port)


def test_rows_in_chunks_with_the_row_loop():
    """The same with a chunk's attention as a loop over the rows (`runtime.row_loop: on`)."""
    d, cfg, params, token_map = load_port_case("A")
    _rows_in_chunks((d, dsv41.config.build(cfg.to_dict(), ["runtime.row_loop=on"]), params, token_map))


def _rows_in_chunks(port):
    d, cfg, params, token_map = port
    ids = d["input_ids"][0]
    ref = d["logits_prefill"][0]
    n0 = min(ids.size, first_near_tie(d))           # row 0: two chunks, then 6 decode steps
    n1 = min(150, n0 - 40)                           # row 1: two chunks, then 1 decode step
    a0, a1 = 97 * n0 // 203, 61 * n1 // 150          # first chunks
    b0, b1 = n0 - 6 - a0, n1 - 1 - a1                # second chunks
    c = cache_lib.init_cache(cfg, 2, 256)
    width = max(a0, b0, b1)  # both chunks padded to one width: one compiled prefill step
    first = np.zeros((2, width), np.int64)
    first[0, :a0], first[1, :a1] = ids[:a0], ids[:a1]
    logits, c = steps.prefill(params, cfg, c, first, lengths=[a0, a1], token_map=token_map)
    errors = [np.abs(np.asarray(logits) - ref[[a0 - 1, a1 - 1]]).max()]
    rest = np.zeros((2, width), np.int64)
    rest[0, :b0] = ids[a0:a0 + b0]
    rest[1, :b1] = ids[a1:a1 + b1]
    logits, c = steps.prefill(params, cfg, c, rest, lengths=[b0, b1], token_map=token_map)
    errors.append(np.abs(np.asarray(logits) - ref[[a0 + b0 - 1, a1 + b1 - 1]]).max())
    for step in range(6):
        p0 = a0 + b0 + step
        logits, c = steps.decode(params, cfg, c, [ids[p0], ids[n1 - 1] if step == 0 else 0], token_map=token_map)
        errors.append(np.abs(np.asarray(logits)[0] - ref[p0]).max())
        if step == 0:
            errors.append(np.abs(np.asarray(logits)[1] - ref[n1 - 1]).max())
    assert max(errors) < TOL, errors
    assert c.lengths.tolist() == [n0, n1 + 5] and n0 >= 136  # long enough for every boundary above


def test_a_chunk_runs_its_attention_one_row_at_a_time():
    """`runtime.row_loop=on`: each attention layer of a prefill chunk loops over the rows (here 4 rows on one
    device), so the chunk's program holds one more loop per attention body and fewer temporaries than with
    every row at once (`off`); a decode step is the same program either way. The field is part of the jit key."""
    from dsv41 import model as model_lib
    seen = {}
    for s in (32, 1):
        for loop in ("on", "off"):
            cfg = dsv41.load_config("tiny", [f"runtime.row_loop={loop}"])
            e = cfg.architecture.engram  # hash ids [B, S, Engram layers, (max_ngram - 1) · heads_per_ngram]
            ids = (len(e.layers), (e.max_ngram - 1) * e.heads_per_ngram)
            lowered = steps.lower(model_lib.abstract_params(cfg), cfg, cache_lib.abstract_cache(cfg, 4, 256),
                                  jax.ShapeDtypeStruct((4, s), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32),
                                  jax.ShapeDtypeStruct((4, s, *ids), jnp.int32) if ids[0] else None)
            text = lowered.as_text()
            temp = lowered.compile().memory_analysis().temp_size_in_bytes if s > 1 else None
            seen[s, loop] = (text.count("stablehlo.while"), temp, text)
    figures = {k: v[:2] for k, v in seen.items()}
    bodies = len({(r.stage, r.mode) for r in dsv41.layer_plan(cfg)})  # window, full, reuse, reindex (distinct bodies)
    assert seen[32, "on"][0] >= seen[32, "off"][0] + bodies, figures
    assert seen[32, "on"][1] < 0.8 * seen[32, "off"][1], figures
    assert seen[1, "on"][2] == seen[1, "off"][2]  # decode: the same program


def test_prompt_beyond_the_cache_is_refused():
    cfg = dsv41.load_config("tiny")
    params = dsv41.init_params(cfg, jax.random.key(0))
    c = cache_lib.init_cache(cfg, 1, 64)
    with pytest.raises(ValueError, match="maximum context length"):
        steps.prefill(params, cfg, c, np.zeros((1, 65), np.int32))
    with pytest.raises(ValueError, match="expected 0..255"):
        steps.prefill(params, cfg, c, np.full((1, 4), 300))


@pytest.mark.slow
def test_ced_equals_full_when_the_replay_covers_the_prompt(port):
    """CED (DESIGN §3.5) is exact when every prompt token is replayed through the decoder."""
    d, cfg, params, token_map = port
    ced = dsv41.config.build(cfg.to_dict(), ["runtime.prefill_schedule=ced"])
    replay = ced.swa_bounded_replay.decoder_replay_tokens
    ids = d["input_ids"]
    c = cache_lib.init_cache(ced, 1, 256)
    logits, c = steps.prefill(params, ced, c, ids[:, :replay], token_map=token_map)
    errors = [np.abs(np.asarray(logits)[0] - d["logits_prefill"][0, replay - 1]).max()]
    for pos in range(replay, replay + 4):
        logits, c = steps.decode(params, ced, c, ids[:, pos], token_map=token_map)
        errors.append(np.abs(np.asarray(logits)[0] - d["logits_prefill"][0, pos]).max())
    assert max(errors) < TOL, errors


@pytest.mark.slow
def test_ced_truncates_decoder_windows_to_the_replay(port):
    d, cfg, params, token_map = port
    ced = dsv41.config.build(cfg.to_dict(), ["runtime.prefill_schedule=ced"])
    replay = ced.swa_bounded_replay.decoder_replay_tokens
    c = cache_lib.init_cache(ced, 1, 256)
    logits, c = steps.prefill(params, ced, c, d["input_ids"][:, :195], token_map=token_map)
    plan = dsv41.layer_plan(ced)
    assert c.window_start[:, 0].tolist() == [195 - replay if r.stage == "decoder" else 0 for r in plan]
    assert np.isfinite(np.asarray(logits)).all()
    assert int(c.lengths[0]) == 195


def test_ced_needs_one_full_decoder_layer_first(v41_raw, write_config):
    v41_raw["runtime"] = {"prefill_schedule": "ced"}
    v41_raw["csa2"]["decoder"]["groups"][1]["modes"][0] = "full"
    with pytest.raises(dsv41.ConfigError, match="only Full layer comes first"):
        dsv41.load_config(write_config(v41_raw))
