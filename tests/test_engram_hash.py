"""Engram hashing (dsv41/engram_hash.py) against the PyTorch port's recorded arrays (oracle case B,
copied into tests/data/engram_caseB.npz), the published full-size table sizes, trial division and a
plain-Python big-integer reference."""

import json

import numpy as np
import pytest

import dsv41
from dsv41.engram_hash import (
    INT64_MAX,
    EngramLayout,
    compressed_token_map,
    compressed_token_map_from_texts,
    hash_ids,
    hash_window,
    identity_token_map,
    is_prime,
    multiplier_bound,
    validate_token_map,
)

from conftest import DATA

FULL_ROWS = (384_006_168, 384_016_682)  # V4.1-Flash Engram tables of layers 1 and 14


@pytest.fixture(scope="module")
def case_b():
    with np.load(DATA / "engram_caseB.npz", allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def small_layout(case_b):
    # The port's config: engram_vocab_size 50, 2 heads, compressed vocab 128, layers [1, 4].
    return EngramLayout(layer_ids=(1, 4), max_ngram=4, heads_per_ngram=2, compressed_vocab_size=128, prime_floor=50)


@pytest.fixture(scope="module")
def full_layout():
    return EngramLayout.from_config(dsv41.load_config("v41_flash"))


def trial_division_prime(n: int) -> bool:
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True


def reference_hash(layout, token_map, pad_id, tokens, alive=None):
    """Plain-Python (big integer) transcription of the rule in the oracle README: per position the
    compressed ids at look-backs 0..N-1 (pad before the start or across a dead token), each times
    its look-back's multiplier, XOR-accumulated; after look-back i, mod each (i+1)-gram prime,
    plus the layer offset."""
    pad = int(token_map[pad_id])
    mult = layout.multipliers.tolist()
    out = np.zeros((len(tokens), len(tokens[0]), layout.n_layers, layout.n_cols), dtype=np.int64)
    for b, row in enumerate(tokens):
        for s in range(len(row)):
            gram, stop = [], False
            for k in range(layout.max_ngram):
                j = s - k
                stop = stop or j < 0 or (alive is not None and not alive[b][j])
                gram.append(pad if stop else int(token_map[row[j]]))
            for li in range(layout.n_layers):
                acc, col, offset = gram[0] * mult[li][0], 0, 0
                for i in range(1, layout.max_ngram):
                    acc ^= gram[i] * mult[li][i]
                    assert acc <= INT64_MAX
                    for p in layout.primes[li][i - 1]:
                        out[b, s, li, col] = acc % p + offset
                        offset += p
                        col += 1
    return out


# ------------------------------------------------------------------------------------------------
# Oracle case B (the port's own arrays)


def test_case_b_layout_matches_port(case_b, small_layout):
    assert list(small_layout.layer_ids) == case_b["engram_layer_ids"].tolist()
    np.testing.assert_array_equal(small_layout.prime_array, case_b["engram_primes"])
    np.testing.assert_array_equal(small_layout.offsets, case_b["engram_offsets"])
    np.testing.assert_array_equal(small_layout.multipliers, case_b["engram_multipliers"])
    assert small_layout.multipliers.dtype == np.int64 and small_layout.offsets.dtype == np.int64
    port_cfg = json.loads((DATA / "v41_port_caseB_config.json").read_text())
    assert list(small_layout.rows_per_layer) == port_cfg["engram_num_embeddings"] == [384, 552]


def test_case_b_token_map_through_tokenizers(case_b):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = [f"w{i}" for i in range(128)] + [f"W{i}" for i in range(128)]
    assert vocab == case_b["engram_tokenizer_vocab"].tolist()
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="w0"))
    token_map, size = compressed_token_map(tok)
    assert size == 128 and token_map.dtype == np.int64
    np.testing.assert_array_equal(token_map, np.arange(256) % 128)
    np.testing.assert_array_equal(token_map, case_b["engram_token_map"])
    assert token_map[2] == case_b["engram_pad_compressed_id"] == 2


def test_case_b_hash_ids_exact(case_b, small_layout):
    ids = hash_ids(small_layout, case_b["engram_token_map"], 2, case_b["input_ids"])
    assert ids.dtype == np.int64 and ids.shape == (1, 203, 2, 6)
    np.testing.assert_array_equal(ids, case_b["engram_hash_ids"])
    # Every id lands inside its own (n-gram, head) bucket range of its layer's table.
    lo = small_layout.offsets
    hi = lo + small_layout.prime_array.reshape(2, 6)
    assert np.all(ids >= lo) and np.all(ids < hi)


def test_case_b_chunked_and_decode_equal_one_shot(case_b, small_layout):
    tokens, token_map = case_b["input_ids"], case_b["engram_token_map"]
    whole = case_b["engram_hash_ids"]
    first = hash_ids(small_layout, token_map, 2, tokens[:, :97])
    # Full history (positions default to H + arange) and a 3-token history with explicit positions.
    second = hash_ids(small_layout, token_map, 2, tokens[:, 97:], history=tokens[:, :97])
    second_short = hash_ids(small_layout, token_map, 2, tokens[:, 97:], 97 + np.arange(106), history=tokens[:, 94:97])
    np.testing.assert_array_equal(np.concatenate([first, second], axis=1), whole)
    np.testing.assert_array_equal(second_short, second)
    for p in range(195, 203):
        step = hash_ids(small_layout, token_map, 2, tokens[:, p : p + 1], [p], history=tokens[:, p - 3 : p])
        np.testing.assert_array_equal(step, whole[:, p : p + 1])


# ------------------------------------------------------------------------------------------------
# Full size (V4.1-Flash)


def test_full_size_rows_and_primes(full_layout):
    assert full_layout.layer_ids == (1, 14)
    assert full_layout.rows_per_layer == FULL_ROWS
    assert full_layout.prime_array.shape == (2, 3, 8) and full_layout.offsets.shape == (2, 24)
    flat = full_layout.prime_array.reshape(-1).tolist()
    assert len(set(flat)) == 48 and flat == sorted(flat)
    assert min(flat) > 16_000_000 - 1
    # Independently: every drawn prime is prime, and no prime between the floor and the last one
    # was skipped (so the draw is "the next unused prime, in order").
    candidates = np.arange(16_000_000, flat[-1] + 1, dtype=np.int64)
    divisors = np.arange(2, int(np.sqrt(flat[-1])) + 2, dtype=np.int64)
    sieve_primes = candidates[np.all(candidates[:, None] % divisors[None, :] != 0, axis=1)]
    assert sieve_primes.tolist() == flat
    for p in (flat[0], flat[23], flat[-1]):
        assert trial_division_prime(p)
    np.testing.assert_array_equal(full_layout.offsets[:, 0], 0)
    np.testing.assert_array_equal(full_layout.offsets[:, -1] + full_layout.prime_array[:, -1, -1], FULL_ROWS)


def test_full_size_multipliers_odd_and_in_range(full_layout):
    m = full_layout.multipliers
    assert m.shape == (2, 4) and m.dtype == np.int64
    bound = (INT64_MAX // 99092) // 2
    assert multiplier_bound(99092) == bound
    assert np.all(m % 2 == 1) and np.all(m >= 1) and np.all(m <= 2 * bound - 1)
    assert 99091 * int(m.max()) <= INT64_MAX  # the largest compressed id cannot overflow
    assert len(set(m.reshape(-1).tolist())) == 8  # layers hash differently


def test_full_size_against_big_int_reference(full_layout):
    rng = np.random.default_rng(0)
    token_map, size = identity_token_map(99092)
    assert size == 99092
    tokens = rng.integers(0, 99092, size=(2, 23))
    tokens[0, :5] = 99091  # the largest ids: products near the int64 limit
    ids = hash_ids(full_layout, token_map, 2, tokens)
    np.testing.assert_array_equal(ids, reference_hash(full_layout, token_map, 2, tokens.tolist()))
    assert np.all(ids >= 0) and np.all(ids < np.array(FULL_ROWS)[None, None, :, None])
    # Chunked (uneven split, each row its own history) equals one-shot.
    a = hash_ids(full_layout, token_map, 2, tokens[:, :10])
    b = hash_ids(full_layout, token_map, 2, tokens[:, 10:], np.broadcast_to(10 + np.arange(13), (2, 13)),
                 history=tokens[:, 6:10])
    np.testing.assert_array_equal(np.concatenate([a, b], axis=1), ids)


def test_from_config_equals_explicit_and_v4_has_none(full_layout):
    explicit = EngramLayout(layer_ids=[1, 14], max_ngram=4, heads_per_ngram=8, compressed_vocab_size=99092,
                            prime_floor=16_000_000)
    assert explicit == full_layout
    assert EngramLayout.from_config(dsv41.load_config("v41_flash").architecture.engram) == full_layout
    v4 = EngramLayout.from_config(dsv41.load_config("v4_flash"))
    assert v4.n_layers == 0 and v4.rows_per_layer == ()
    assert hash_ids(v4, np.arange(5), 2, np.zeros((1, 3), dtype=np.int64)).shape == (1, 3, 0, 24)


# ------------------------------------------------------------------------------------------------
# Pieces


def test_is_prime_against_trial_division():
    assert [n for n in range(3000) if is_prime(n)] == [n for n in range(3000) if trial_division_prime(n)]
    assert not is_prime(561) and not is_prime(3_215_031_751)  # Carmichael; strong pseudoprime to 2,3,5,7
    assert is_prime(2**61 - 1) and is_prime(2**64 - 59) and not is_prime(2**64 - 1)


def test_normalisation_groups_tokens():
    texts = [" The", "the", "THE", "café", "cafe", " ", "  ", "\t", "\ufb01", "fi", "\u0301", "x\ufffd", "<s>"]
    token_map, size = compressed_token_map_from_texts(texts)
    assert token_map.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 4, 5, 6] and size == 7
    # Partial-UTF-8 tokens are keyed by their raw vocabulary form, not their text.
    token_map, size = compressed_token_map_from_texts(["a\ufffd", "b\ufffd"], raw_tokens=["x", "x"])
    assert token_map.tolist() == [0, 0] and size == 1


def test_token_mask_stops_look_back(small_layout, case_b):
    token_map = case_b["engram_token_map"]
    tokens = case_b["input_ids"][:, :40]
    alive = np.ones(tokens.shape, dtype=bool)
    alive[0, [5, 6, 20]] = False
    ids = hash_ids(small_layout, token_map, 2, tokens, token_mask=alive)
    np.testing.assert_array_equal(ids, reference_hash(small_layout, token_map, 2, tokens.tolist(), alive.tolist()))
    # Split inside the masked span: the history carries its mask.
    a = hash_ids(small_layout, token_map, 2, tokens[:, :6], token_mask=alive[:, :6])
    b = hash_ids(small_layout, token_map, 2, tokens[:, 6:], history=tokens[:, :6], token_mask=alive[:, 6:],
                 history_mask=alive[:, :6])
    np.testing.assert_array_equal(np.concatenate([a, b], axis=1), ids)


# ------------------------------------------------------------------------------------------------
# Validation


def test_bad_inputs_raise_clear_errors(small_layout, case_b):
    token_map = case_b["engram_token_map"]
    ok = np.zeros((1, 4), dtype=np.int64)
    with pytest.raises(ValueError, match=r"tokens: token id 256: expected ids < 256"):
        hash_ids(small_layout, token_map, 2, ok + 256)
    with pytest.raises(ValueError, match=r"tokens: token id -1: expected ids >= 0"):
        hash_ids(small_layout, token_map, 2, ok - 1)
    with pytest.raises(ValueError, match=r"pad_id: token id 999"):
        hash_ids(small_layout, token_map, 999, ok)
    with pytest.raises(ValueError, match=r"compressed_vocab_size = 128.*127"):
        validate_token_map(small_layout, token_map % 127, 127)
    with pytest.raises(ValueError, match=r"token_map: compressed ids span \[0, 255\]"):
        hash_ids(small_layout, np.arange(256), 2, ok)
    with pytest.raises(ValueError, match=r"positions: expected consecutive"):
        hash_ids(small_layout, token_map, 2, ok, [0, 1, 3, 4])
    with pytest.raises(ValueError, match=r"history: 1 tokens .* expected at least 3"):
        hash_ids(small_layout, token_map, 2, ok, [10, 11, 12, 13], history=ok[:, :1])
    with pytest.raises(ValueError, match=r"tokens: shape \(4,\): expected 2 dimensions"):
        hash_ids(small_layout, token_map, 2, ok[0])
    with pytest.raises(ValueError, match=r"engram.max_ngram = 1"):
        EngramLayout(layer_ids=(1,), max_ngram=1, heads_per_ngram=2, compressed_vocab_size=128, prime_floor=50)
    with pytest.raises(ValueError, match=r"engram.layers = \[1, 1\]"):
        EngramLayout(layer_ids=(1, 1), max_ngram=4, heads_per_ngram=2, compressed_vocab_size=128, prime_floor=50)


# ------------------------------------------------------------------------------------------------
# The same hash in JAX (uint32 words), for the device-resident decode loop


@pytest.mark.parametrize("layout_name", ["small", "full", "wide"])
@pytest.mark.parametrize("seq,held", [(1, 0), (1, 2), (1, 9), (6, 0), (6, 1), (4, 50)])
def test_jax_hash_equals_the_big_integer_reference(small_layout, full_layout, layout_name, seq, held):
    """`hash_ids_jax` and `hash_window` (a look-back window of compressed ids, -1 before the start) equals the plain-Python
    reference on the whole sequence: the port's small primes, the full-size layout (primes near 16M,
    multipliers near 2**63 / 99,092) and a prime near 2**31 (the remainder taken one bit at a time; one table
    of that many rows is the most int32 ids address)."""
    import jax
    import jax.numpy as jnp

    from dsv41.engram_hash import hash_ids_jax

    layout = {"small": small_layout, "full": full_layout,
              "wide": EngramLayout(layer_ids=(3,), max_ngram=2, heads_per_ngram=1, compressed_vocab_size=1000,
                                   prime_floor=2**31 - 200)}[layout_name]
    rng = np.random.default_rng(seq * 100 + held)
    vocab = 3 * layout.compressed_vocab_size
    token_map = rng.integers(0, layout.compressed_vocab_size, size=vocab)
    token_map[-1] = layout.compressed_vocab_size - 1  # the largest compressed id: the largest product
    tokens = rng.integers(0, vocab, size=(3, held + seq))
    tokens[0, -1] = vocab - 1
    want = reference_hash(layout, token_map, 2, tokens.tolist())[:, held:]
    look = layout.max_ngram - 1
    window = np.full((3, look + seq), -1)
    seen = token_map[tokens[:, max(0, held - look):]]
    window[:, look + seq - seen.shape[1]:] = seen
    got = jax.jit(lambda w: hash_ids_jax(layout, w, int(token_map[2])))(jnp.asarray(window, jnp.int32))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(hash_window(layout, window, int(token_map[2])), want)  # the host's, all rows at once
    if layout_name == "wide":
        two = EngramLayout(layer_ids=(3,), max_ngram=2, heads_per_ngram=2, compressed_vocab_size=1000,
                           prime_floor=2**31 - 200)
        with pytest.raises(ValueError, match=r"engram: tables of \d+ rows: expected at most 2\*\*31 rows per layer"):
            hash_ids_jax(two, jnp.asarray(window, jnp.int32), 0)


def test_without_a_token_map_the_identity_needs_the_compressed_vocabulary_to_be_the_vocabulary():
    """V4.1-Flash's 129,280 token ids map into 99,092 classes: a step, the teacher-forced ids and the device
    loop's map refuse to hash without a token map, naming the field (the identity would overflow the classes)."""
    from dsv41 import model as model_lib
    from dsv41 import steps

    cfg = dsv41.load_config("v41_flash")
    message = r"architecture.engram.compressed_vocab_size' = 99092: expected a token map .* vocab_size \(129280\)"
    with pytest.raises(dsv41.ConfigError, match=message):
        steps.engram_inputs(cfg, np.full((1, 3), -1), np.zeros((1, 1), np.int64), np.ones(1, np.int32), np.zeros(1))
    with pytest.raises(dsv41.ConfigError, match=message):
        model_lib.engram_ids(cfg, np.zeros((1, 4), np.int64))
    token_map = np.arange(129_280) % 99_092
    assert model_lib.engram_token_map(cfg, token_map) is token_map
    ids, recent = steps.engram_inputs(cfg, np.full((1, 3), -1), np.full((1, 1), 129_279), np.ones(1, np.int32),
                                      np.zeros(1), token_map)
    np.testing.assert_array_equal(np.asarray(ids), hash_ids(EngramLayout.from_config(cfg), token_map, 2,
                                                            np.full((1, 1), 129_279)))
    assert recent.tolist() == [[-1, -1, 129_279]]


def test_a_steps_ids_hash_rows_of_different_lengths_at_once(full_layout):
    """`steps.engram_inputs` hashes every row of a step at once: rows holding 0, 1, 2 and 40 tokens (fewer than
    the look-back, and more), 3 new tokens of which each row brings its first 3, 1, 0 and 2, give per row what
    `hash_ids` gives that row alone with its history, and the look-back each row keeps is its last 3 tokens."""
    from dsv41 import steps

    cfg = dsv41.load_config("v41_flash")
    token_map = np.arange(129_280) % 99_092
    rng = np.random.default_rng(7)
    history = [rng.integers(0, 129_280, size=h).tolist() for h in (0, 1, 2, 40)]
    recent = np.full((4, 3), -1)
    for row, h in enumerate(history):
        recent[row, 3 - min(3, len(h)):] = h[-3:] if h else []
    tokens, counts = rng.integers(0, 129_280, size=(4, 3)), np.array([3, 1, 0, 2], np.int32)
    held = np.array([len(h) for h in history])
    ids, kept = steps.engram_inputs(cfg, recent, tokens, counts, held, token_map)
    for row, h in enumerate(history):
        want = hash_ids(full_layout, token_map, 2, tokens[row:row + 1], len(h) + np.arange(3),
                        history=np.asarray(h[-3:], np.int64)[None])
        np.testing.assert_array_equal(np.asarray(ids[row:row + 1]), want, err_msg=f"row {row}")
        seen = (h + tokens[row, :counts[row]].tolist())[-3:]
        assert kept[row].tolist() == [-1] * (3 - len(seen)) + seen


def test_a_replays_ids_hash_rows_of_different_starts_at_once(full_layout):
    """The prefix cache's bounded replay hashes every row at once (`prefix_cache.replay_engram_ids`): rows whose
    replay starts at positions 0, 1, 2 and 37 of their prompts (fewer tokens before it than the look-back, and
    more), with 4, 3, 0 and 4 replayed tokens, give per row what `hash_ids` gives that row alone with its prompt's
    last 3 tokens before the start as history."""
    from dsv41.prefix_cache import replay_engram_ids

    cfg = dsv41.load_config("v41_flash")
    token_map = np.arange(129_280) % 99_092
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 129_280, size=n) for n in (4, 5, 2, 41)]
    counts = np.array([4, 3, 0, 4], np.int32)
    n_cached = np.array([4, 4, 2, 41])
    tokens = np.zeros((4, 4), np.int32)
    for row, p in enumerate(prompts):
        tokens[row, :counts[row]] = p[n_cached[row] - counts[row]:n_cached[row]]
    ids = replay_engram_ids(cfg, token_map, prompts, n_cached, tokens, counts)
    assert ids.shape == (4, 4, 2, full_layout.n_cols)
    for row, p in enumerate(prompts):
        start = n_cached[row] - counts[row]
        want = hash_ids(full_layout, token_map, 2, tokens[row:row + 1], start + np.arange(4),
                        history=np.asarray(p[max(0, start - 3):start], np.int64)[None])
        np.testing.assert_array_equal(np.asarray(ids[row:row + 1]), want, err_msg=f"row {row}")


def test_a_window_of_raw_ids_is_checked_against_the_token_map(full_layout):
    """`hash_token_window` (a step's and a replay's ids) maps raw ids through the token map and hashes them as
    `hash_window` does the compressed ones; an id outside the map is refused naming it, not an IndexError."""
    from dsv41.engram_hash import hash_token_window

    token_map = np.arange(129_280) % 99_092
    window = np.array([[-1, 5, 129_000, 7], [3, 4, 5, 6]])
    got = hash_token_window(full_layout, token_map, 2, window)
    compressed = np.where(window < 0, -1, token_map[np.maximum(window, 0)])
    np.testing.assert_array_equal(got, hash_window(full_layout, compressed, int(token_map[2])))
    with pytest.raises(ValueError, match=r"tokens: token id 129280: expected ids < 129280"):
        hash_token_window(full_layout, token_map, 2, np.array([[-1, 5, 129_280, 7]]))
