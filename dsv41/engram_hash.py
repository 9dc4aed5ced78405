"""Engram n-gram hashing on the host (int64 NumPy; JAX runs without int64 by default).

V4.1's Engram layers look up rows of per-layer hash tables. Every position is hashed as the
`max_ngram - 1` n-grams (2-gram .. max_ngram-gram) that end there, each over `heads_per_ngram`
heads; every (n-gram size, head) pair owns a disjoint prime-sized range of its layer's table.

The pieces, in the order the model uses them:

1. `compressed_token_map(tokenizer)`: raw token id -> compressed id, where tokens whose decoded
   text normalises alike (NFKC, NFD, accents stripped, lowercased, whitespace collapsed and
   stripped; a lone space kept) share an id, numbered by first appearance. `identity_token_map`
   serves byte-level / tokenizer-free cases.
2. `EngramLayout`: the primes (the next unused primes >= `prime_floor`, drawn in (layer, n-gram,
   head) order and never reused), the per-layer offsets (running sums of that layer's primes, each
   layer's table addressed from 0), the rows per layer and the odd hash multipliers (one per
   (layer, look-back), from `np.random.default_rng(10007 * layer_id)`).
3. `hash_ids(layout, token_map, pad_id, tokens, ...)`: `[B, S, n_layers, (max_ngram-1)*heads]`
   int64 row ids, offsets included. The compressed ids at look-backs 0..max_ngram-1 are multiplied
   by their look-back's multiplier and XOR-accumulated; after adding look-back i the running value
   is reduced modulo each head's prime of the (i+1)-gram. Look-back before position 0 (or across a
   masked token) uses the compressed pad id. `history` carries the previous tokens across chunked
   prefill / decode calls.

Every bad input raises `ValueError` naming the argument or field, the value and what was expected.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

INT64_MAX = int(np.iinfo(np.int64).max)
MULTIPLIER_SEED_STRIDE = 10007

# Miller-Rabin with the first 13 prime bases is deterministic below this bound (Sorenson & Webster).
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
_MR_DETERMINISTIC_BELOW = 3_317_044_064_679_887_385_961_981

# A private-use character: a token that is exactly one space survives Strip() through it.
_LONE_SPACE_SENTINEL = "\ue000"


# ------------------------------------------------------------------------------------------------
# Primes


def is_prime(n: int) -> bool:
    """Deterministic primality test (Miller-Rabin, fixed bases) for 0 <= n < 3.3e24."""
    n = int(n)
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    if n >= _MR_DETERMINISTIC_BELOW:
        raise ValueError(f"is_prime: n = {n}: expected n < {_MR_DETERMINISTIC_BELOW} (deterministic range)")
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x == 1 or x == n - 1:
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime(after: int) -> int:
    """The smallest prime strictly greater than `after`."""
    candidate = max(int(after) + 1, 2)
    while not is_prime(candidate):
        candidate += 1
    return candidate


def draw_primes(prime_floor: int, n_layers: int, max_ngram: int, heads_per_ngram: int):
    """Primes as nested tuples [layer][ngram - 2][head]: the primes >= `prime_floor` in increasing
    order, assigned in (layer, n-gram size, head) order, none used twice.

    (The reference restarts its search at `prime_floor - 1` for every (layer, n-gram) and skips the
    primes already taken; that yields exactly the consecutive primes drawn here.)
    """
    current = int(prime_floor) - 1
    layers = []
    for _ in range(n_layers):
        per_ngram = []
        for _ in range(max_ngram - 1):
            heads = []
            for _ in range(heads_per_ngram):
                current = next_prime(current)
                heads.append(current)
            per_ngram.append(tuple(heads))
        layers.append(tuple(per_ngram))
    return tuple(layers)


# ------------------------------------------------------------------------------------------------
# Multipliers


def multiplier_bound(compressed_vocab_size: int) -> int:
    """Upper bound (exclusive) of the raw draws: `(int64 max // vocab) // 2`, at least 1, so that
    `compressed_id * (2 * draw + 1)` cannot overflow int64 for any id below the vocab size."""
    return max(1, (INT64_MAX // int(compressed_vocab_size)) // 2)


def hash_multipliers(layer_ids: Sequence[int], max_ngram: int, compressed_vocab_size: int) -> np.ndarray:
    """int64 [n_layers, max_ngram] odd multipliers, one per (layer, look-back), each layer from its
    own `np.random.default_rng(10007 * layer_id)`."""
    bound = multiplier_bound(compressed_vocab_size)
    rows = []
    for layer_id in layer_ids:
        rng = np.random.default_rng(MULTIPLIER_SEED_STRIDE * int(layer_id))
        draws = rng.integers(low=0, high=bound, size=(int(max_ngram),), dtype=np.int64)
        rows.append(draws * 2 + 1)
    if not rows:
        return np.zeros((0, int(max_ngram)), dtype=np.int64)
    return np.stack(rows).astype(np.int64)


# ------------------------------------------------------------------------------------------------
# Layout


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} = {value!r}: expected an integer >= {minimum}")
    if value < minimum:
        raise ValueError(f"{name} = {value!r}: expected an integer >= {minimum}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class EngramLayout:
    """Bucket layout of the Engram hash tables (everything but the token map).

    Fields (plain numbers, as in `cfg.architecture.engram`):
      layer_ids: the Engram layers, in table order (hash_ids' layer axis follows it).
      max_ngram: largest n-gram size N; a position hashes the 2..N-grams ending there.
      heads_per_ngram: hash heads per n-gram size.
      compressed_vocab_size: size of the compressed token vocabulary (sets the multiplier bound).
      prime_floor: the primes are drawn from the primes >= prime_floor (the reference's
        `engram_vocab_size`; its search starts strictly above prime_floor - 1).
    Derived:
      primes: tuple [layer][ngram - 2][head] of ints.
      prime_array: int64 [n_layers, max_ngram - 1, heads_per_ngram].
      offsets: int64 [n_layers, n_cols], the running sum of a layer's primes over the flat
        (n-gram, head) order, starting at 0 for every layer.
      rows_per_layer: tuple of each layer's table size (the sum of its primes).
      multipliers: int64 [n_layers, max_ngram], odd.
    Arrays are read-only.
    """

    layer_ids: tuple[int, ...]
    max_ngram: int
    heads_per_ngram: int
    compressed_vocab_size: int
    prime_floor: int
    primes: tuple = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        ids = self.layer_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise ValueError(f"engram.layers = {ids!r}: expected a sequence of layer indices")
        ids = tuple(_check_int("engram.layers[]", i, 0) for i in ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"engram.layers = {list(ids)!r}: expected distinct layer indices")
        object.__setattr__(self, "layer_ids", ids)
        object.__setattr__(self, "max_ngram", _check_int("engram.max_ngram", self.max_ngram, 2))
        object.__setattr__(self, "heads_per_ngram", _check_int("engram.heads_per_ngram", self.heads_per_ngram, 1))
        object.__setattr__(
            self, "compressed_vocab_size",
            _check_int("engram.compressed_vocab_size", self.compressed_vocab_size, 1),
        )
        object.__setattr__(self, "prime_floor", _check_int("engram.prime_floor", self.prime_floor, 1))
        object.__setattr__(
            self, "primes", draw_primes(self.prime_floor, len(ids), self.max_ngram, self.heads_per_ngram)
        )

    @classmethod
    def from_config(cls, cfg) -> EngramLayout:
        """From a model config (`cfg.architecture.engram`) or that `engram` node itself. A config
        with no Engram layers gives a layout with `n_layers == 0`."""
        node = cfg.architecture.engram if "architecture" in cfg else cfg
        return cls(
            layer_ids=tuple(node.layers),
            max_ngram=node.max_ngram,
            heads_per_ngram=node.heads_per_ngram,
            compressed_vocab_size=node.compressed_vocab_size,
            prime_floor=node.prime_floor,
        )

    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def n_cols(self) -> int:
        """Hash ids per position and layer: (max_ngram - 1) * heads_per_ngram."""
        return (self.max_ngram - 1) * self.heads_per_ngram

    @functools.cached_property
    def prime_array(self) -> np.ndarray:
        shape = (self.n_layers, self.max_ngram - 1, self.heads_per_ngram)
        return _readonly(np.asarray(self.primes, dtype=np.int64).reshape(shape))

    @functools.cached_property
    def offsets(self) -> np.ndarray:
        flat = self.prime_array.reshape(self.n_layers, self.n_cols)
        starts = np.zeros_like(flat)
        starts[:, 1:] = np.cumsum(flat, axis=1)[:, :-1]
        return _readonly(starts)

    @property
    def rows_per_layer(self) -> tuple[int, ...]:
        return tuple(sum(p for per in layer for p in per) for layer in self.primes)

    @functools.cached_property
    def multipliers(self) -> np.ndarray:
        return _readonly(hash_multipliers(self.layer_ids, self.max_ngram, self.compressed_vocab_size))

    def layer_index(self, layer_id: int) -> int:
        """Position of `layer_id` on hash_ids' layer axis."""
        try:
            return self.layer_ids.index(layer_id)
        except ValueError:
            raise ValueError(f"layer_id = {layer_id!r}: expected one of the Engram layers {list(self.layer_ids)}") from None


# ------------------------------------------------------------------------------------------------
# Token maps


def identity_token_map(vocab_size: int) -> tuple[np.ndarray, int]:
    """(arange(vocab_size) as int64, vocab_size): every token is its own compressed id."""
    vocab_size = _check_int("vocab_size", vocab_size, 1)
    return np.arange(vocab_size, dtype=np.int64), vocab_size


def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _LONE_SPACE_SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_LONE_SPACE_SENTINEL, " "),
        ]
    )


def compressed_token_map_from_texts(
    texts: Sequence[str], raw_tokens: Sequence[str] | None = None
) -> tuple[np.ndarray, int]:
    """The compressed map from each token id's decoded text (`texts[i]` = decode([i])).

    A text containing U+FFFD (a partial UTF-8 byte token) is not normalised; it is keyed by
    `raw_tokens[i]` (the vocabulary entry) when given, else by the text. A text that normalises to
    the empty string is keyed by itself. Keys get new ids in order of first appearance.
    Returns (int64 [len(texts)] lookup, compressed vocab size).
    """
    if raw_tokens is not None and len(raw_tokens) != len(texts):
        raise ValueError(f"raw_tokens has {len(raw_tokens)} entries: expected one per text ({len(texts)})")
    normalizer = _normalizer()
    key_to_new: dict[str, int] = {}
    lookup = np.empty(len(texts), dtype=np.int64)
    for token_id, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"texts[{token_id}] = {text!r}: expected a str")
        if "\ufffd" in text:
            key = raw_tokens[token_id] if raw_tokens is not None else text
        else:
            key = normalizer.normalize_str(text) or text
        lookup[token_id] = key_to_new.setdefault(key, len(key_to_new))
    return lookup, len(key_to_new)


def compressed_token_map(tokenizer) -> tuple[np.ndarray, int]:
    """The compressed map of a `tokenizers.Tokenizer` (or a transformers fast tokenizer, through its
    `backend_tokenizer`): every id in 0..vocab-1 (added tokens included) is decoded on its own with
    special tokens kept, then normalised as in `compressed_token_map_from_texts`.
    Returns (int64 [vocab] lookup, compressed vocab size)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not all(hasattr(backend, a) for a in ("decode", "id_to_token", "get_vocab_size")):
        raise ValueError(
            f"tokenizer = {type(tokenizer).__name__}: expected a tokenizers.Tokenizer or an object with "
            "a `backend_tokenizer` (transformers fast tokenizer)"
        )
    if backend is not tokenizer and hasattr(tokenizer, "__len__"):
        size = len(tokenizer)
    else:
        size = backend.get_vocab_size(with_added_tokens=True)
    texts, raw = [], []
    for token_id in range(size):
        texts.append(backend.decode([token_id], skip_special_tokens=False))
        raw.append(backend.id_to_token(token_id))
    raw = [r if r is not None else t for r, t in zip(raw, texts)]
    return compressed_token_map_from_texts(texts, raw)


def validate_token_map(layout: EngramLayout, token_map, vocab_size: int | None = None) -> np.ndarray:
    """Checks a raw -> compressed map against the layout and returns it as int64 [V].

    The compressed ids must lie in [0, layout.compressed_vocab_size) (the multipliers are bounded
    for that range; a larger id could overflow int64). When `vocab_size` (the map builder's
    compressed vocab size) is given it must equal `layout.compressed_vocab_size`: the multipliers
    derive from it, so a mismatch silently rehashes the whole table.
    """
    if vocab_size is not None and int(vocab_size) != layout.compressed_vocab_size:
        raise ValueError(
            f"engram.compressed_vocab_size = {layout.compressed_vocab_size}: the token map's compressed "
            f"vocabulary has {vocab_size} ids; expected them equal (the hash multipliers derive from it)"
        )
    array = np.asarray(token_map)
    if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"token_map: shape {array.shape}, dtype {array.dtype}: expected a non-empty 1-D integer array"
        )
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= layout.compressed_vocab_size:
        raise ValueError(
            f"token_map: compressed ids span [{low}, {high}]: expected ids in "
            f"[0, {layout.compressed_vocab_size}) (engram.compressed_vocab_size)"
        )
    return array.astype(np.int64, copy=False)


# ------------------------------------------------------------------------------------------------
# Hash ids


def _int_array(name: str, value, ndim: int) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim != ndim:
        raise ValueError(f"{name}: shape {array.shape}: expected {ndim} dimensions")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name}: dtype {array.dtype}: expected integers")
    return array.astype(np.int64, copy=False)


def _check_ids(name: str, ids: np.ndarray, size: int) -> None:
    if ids.size == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0:
        raise ValueError(f"{name}: token id {low}: expected ids >= 0")
    if high >= size:
        raise ValueError(f"{name}: token id {high}: expected ids < {size} (the token map's size)")


def _bool_mask(name: str, mask, shape) -> np.ndarray:
    if mask is None:
        return np.ones(shape, dtype=bool)
    array = np.asarray(mask)
    if array.shape != tuple(shape) or array.dtype != np.bool_:
        raise ValueError(f"{name}: shape {array.shape}, dtype {array.dtype}: expected bool {tuple(shape)}")
    return array


def hash_ids(
    layout: EngramLayout,
    token_map,
    pad_id: int,
    tokens,
    positions=None,
    *,
    history=None,
    token_mask=None,
    history_mask=None,
) -> np.ndarray:
    """Engram table rows for every position: int64 [B, S, layout.n_layers, layout.n_cols], offsets
    added (row r of layer l indexes that layer's table of `layout.rows_per_layer[l]` rows).

    token_map: int64 [V] raw -> compressed id (`compressed_token_map` / `identity_token_map`).
    pad_id: RAW token id (cfg.architecture.engram.pad_id); its compressed id stands in for look-back
      before position 0 and across masked tokens.
    tokens: int [B, S] raw ids.
    positions: int [S] or [B, S] absolute positions, consecutive along S; default `H + arange(S)`
      with H the history length (0 without history).
    history: int [B, H] raw ids at positions p0-H .. p0-1 (p0 = the first position of each row),
      e.g. the previous chunk's last `max_ngram - 1` tokens. H >= max_ngram - 1 is needed unless
      the history reaches back to position 0 (H == p0).
    token_mask / history_mask: bool [B, S] / [B, H], False marks a token no n-gram may span (the
      reference's DEAD tokens, e.g. an image span): look-back stops there (that look-back and all
      further ones use the pad id); a masked position's own ids are all-pad.
    """
    token_map = validate_token_map(layout, token_map)
    tokens = _int_array("tokens", tokens, 2)
    batch, seq = tokens.shape
    _check_ids("tokens", tokens, token_map.size)
    pad = _int_array("pad_id", pad_id, 0)
    _check_ids("pad_id", pad.reshape(1), token_map.size)
    pad_c = token_map[int(pad)]

    if history is None:
        if history_mask is not None:
            raise ValueError("history_mask: given without history: expected history [B, H] as well")
        history = np.zeros((batch, 0), dtype=np.int64)
    history = _int_array("history", history, 2)
    if history.shape[0] != batch:
        raise ValueError(f"history: shape {history.shape}: expected {batch} rows (tokens has {batch})")
    _check_ids("history", history, token_map.size)
    hist_len = history.shape[1]

    if positions is None:
        positions = np.broadcast_to(hist_len + np.arange(seq, dtype=np.int64), (batch, seq))
    else:
        positions = np.asarray(positions)
        if positions.ndim == 1:
            positions = positions[None, :]
        positions = _int_array("positions", positions, 2)
        if positions.shape[1] != seq or positions.shape[0] not in (1, batch):
            raise ValueError(f"positions: shape {positions.shape}: expected ({seq},) or ({batch}, {seq})")
        positions = np.broadcast_to(positions, (batch, seq))
    if seq == 0:
        return np.zeros((batch, 0, layout.n_layers, layout.n_cols), dtype=np.int64)
    start = positions[:, :1]
    if np.any(positions != start + np.arange(seq)):
        raise ValueError("positions: expected consecutive positions along S (positions[:, s] = positions[:, 0] + s)")
    if int(start.min()) < hist_len:
        raise ValueError(
            f"positions: first position {int(start.min())} with a history of {hist_len} tokens: expected "
            f"the first position >= {hist_len} (the history would start before position 0)"
        )
    lookback = layout.max_ngram - 1
    if hist_len < lookback and np.any(start != hist_len):
        raise ValueError(
            f"history: {hist_len} tokens before first position(s) {np.unique(start).tolist()}: expected at "
            f"least {lookback} (engram.max_ngram - 1) previous tokens, or all of them from position 0"
        )

    buffer = token_map[np.concatenate([history, tokens], axis=1)]  # [B, H + S] compressed ids
    alive = np.concatenate(
        [_bool_mask("history_mask", history_mask, history.shape), _bool_mask("token_mask", token_mask, tokens.shape)],
        axis=1,
    )
    s_idx = np.arange(seq)
    grams = np.empty((batch, seq, layout.max_ngram), dtype=np.int64)
    blocked = np.zeros((batch, seq), dtype=bool)
    for shift in range(layout.max_ngram):
        index = hist_len + s_idx - shift  # < 0 only where the position is < 0 (checked above)
        safe = np.maximum(index, 0)
        blocked = blocked | (positions - shift < 0) | ~alive[:, safe]
        grams[:, :, shift] = np.where(blocked, pad_c, buffer[:, safe])

    return _hash_grams(layout, grams)


def hash_window(layout: EngramLayout, window_BW, pad_c: int) -> np.ndarray:
    """`hash_ids` of every row's new tokens at once, from a window of compressed ids: int64 [B, max_ngram - 1 + S],
    each row's look-back before its first new token followed by the new tokens, -1 where a position lies before
    the row's start (rows may hold different numbers of tokens). pad_c: the compressed pad id. Returns int64
    [B, S, n_layers, n_cols], offsets added. A decode step's ids (`steps.engram_inputs`); `hash_ids_jax` is the
    same on the device."""
    return _hash_grams(layout, look_backs(np, np.asarray(window_BW, np.int64), layout.max_ngram, pad_c))


def hash_token_window(layout: EngramLayout, token_map, pad_id: int, window_BW) -> np.ndarray:
    """`hash_window` of raw token ids: window_BW int [B, max_ngram - 1 + S], -1 before each row's start, mapped
    through token_map (raw -> compressed, checked; ids out of its range raise naming them); pad_id is the RAW
    pad id. The ids of a step (`steps.engram_inputs`) and of the prefix cache's replay."""
    token_map = validate_token_map(layout, token_map)
    window = np.asarray(window_BW, np.int64)
    _check_ids("tokens", window[window >= 0], token_map.size)
    compressed = np.where(window < 0, -1, token_map[np.maximum(window, 0)])
    return hash_window(layout, compressed, int(token_map[pad_id]))


def look_backs(xp, window_BW, max_ngram: int, pad_c: int):
    """[B, S, max_ngram]: for each new token of a look-back window [B, max_ngram - 1 + S] (`hash_window`) the
    ids 0..max_ngram-1 positions back, pad_c where that lies before the row's start (once a look-back
    reaches before the start every further one does: -1 only leads a row). xp: numpy or jax.numpy."""
    look = max_ngram - 1
    s = window_BW.shape[1] - look
    grams = xp.stack([window_BW[:, look - j:look - j + s] for j in range(max_ngram)], axis=-1)
    return xp.where(grams < 0, pad_c, grams)


def _hash_grams(layout: EngramLayout, grams_BSN) -> np.ndarray:
    """Row ids [B, S, n_layers, n_cols] of the compressed ids at look-backs 0..max_ngram-1 [B, S, max_ngram]."""
    # [B, S, L, max_ngram]; each product < int64 max because ids < compressed_vocab_size.
    products = grams_BSN[:, :, None, :] * layout.multipliers[None, None, :, :]
    primes = layout.prime_array
    rolling = products[..., 0]
    out = []
    for i in range(1, layout.max_ngram):
        rolling = np.bitwise_xor(rolling, products[..., i])
        out.append(rolling[..., None] % primes[None, None, :, i - 1, :])
    return np.concatenate(out, axis=-1) + layout.offsets[None, None]


# ------------------------------------------------------------------------------------------------
# The same hash inside a jitted loop (uint32 arithmetic)


def hash_ids_jax(layout: EngramLayout, window_BW, pad_c: int):
    """`hash_window` traced in JAX (int32 [B, S, n_layers, n_cols], offsets added) for the device-resident decode
    loop, where the tokens never reach the host: the int64 products, XORs and remainders are carried out
    exactly on pairs of uint32 words, since JAX runs without int64. The values are the host's.

    window_BW: int32 [B, max_ngram - 1 + S] compressed ids, the look-back of each row's first new token
    followed by the new tokens, -1 where a position lies before the row's start (its n-grams use pad_c,
    the compressed pad id, from there back). Token masks are not supported here (`hash_ids` has them)."""
    import jax.numpy as jnp

    look = layout.max_ngram - 1
    s = window_BW.shape[1] - look
    if s < 1:
        raise ValueError(f"window_BW: shape {window_BW.shape}: expected {look} look-back ids and at least one token")
    if max(layout.rows_per_layer, default=0) > 2**31:
        raise ValueError(f"engram: tables of {max(layout.rows_per_layer)} rows: expected at most 2**31 rows per layer "
                         "(int32 row ids)")
    grams = look_backs(jnp, window_BW, layout.max_ngram, pad_c).astype(jnp.uint32)[:, :, None, :]  # [B, S, 1, max_ngram]
    m = layout.multipliers.astype(np.uint64)  # [L, max_ngram], < 2**63
    m_hi = jnp.asarray((m >> np.uint64(32)).astype(np.uint32))
    m_lo = jnp.asarray((m & np.uint64(0xFFFFFFFF)).astype(np.uint32))
    hi, lo = _mul_u32(grams, m_lo)  # id · multiplier < 2**63 (`multiplier_bound`): no carry out of 64 bits
    hi = hi + grams * m_hi
    primes = layout.prime_array  # [L, max_ngram - 1, heads]
    # Remainder by Horner over `step`-bit pieces of the 64-bit value: r · 2**step + piece stays below 2**32.
    step = 1 << ((32 - int(primes.max()).bit_length()).bit_length() - 1)
    p = jnp.asarray(primes.astype(np.uint32))
    x_hi, x_lo, out = hi[..., 0], lo[..., 0], []
    for i in range(1, layout.max_ngram):
        x_hi, x_lo = x_hi ^ hi[..., i], x_lo ^ lo[..., i]
        r = jnp.zeros((*x_hi.shape, p.shape[-1]), jnp.uint32)
        p_i = p[:, i - 1]  # [L, heads]
        for word in (x_hi, x_lo):
            for shift in range(32 - step, -1, -step):
                piece = (word >> shift) & ((1 << step) - 1)
                r = ((r << step) | piece[..., None]) % p_i
        out.append(r)
    ids = jnp.concatenate(out, axis=-1).astype(jnp.int32)
    return ids + jnp.asarray(layout.offsets.astype(np.int32))


def _mul_u32(a, b):
    """The 64-bit product of uint32 arrays as (high word, low word), in 16-bit limbs."""
    a0, a1, b0, b1 = a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 16) + (p01 & 0xFFFF) + (p10 & 0xFFFF)
    return p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16), (p00 & 0xFFFF) | (mid << 16)
