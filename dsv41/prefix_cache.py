"""Persistent prefix cache of global KV, host-memory window pool and SWA bounded replay (DESIGN §7).

A prompt is cut into blocks of `block_tokens` tokens, a multiple of every compression ratio, so that a
block boundary closes every compressor group. Block k is named by a hash chain:
`key_k = sha256(key_{k-1} | token ids of block k)`, `key_{-1}` = the fingerprint of the weights and of
the config fields that change the KV, so one key names the whole prefix up to the block's end.

- The **store** (local disk, TTL `kv_cache.persistent_cache.global_kv_ttl_hours`, a byte budget with
  LRU eviction) keeps per block only global KV: for every Full layer the rows of each per-entry leaf of
  its `CompressedKV` (packed FP4 main entries + E4M3 scales, indexer keys + UE8M0 scales: block/ratio
  rows each; with `quant: none` the float entries and keys, and empty scales) and the per-sequence
  leaves (the compressor leftovers) at the block's end when they are not the empty state. One file per
  block, written atomically, checked by sha256 and by a header (fingerprint, key, block tokens, array
  shapes) before any byte is used.
- The **pool** (host memory, TTL `swa_kv_ttl_minutes`, a byte budget, LRU) keeps the window rings at a
  block's end: per layer `window` [L, W, K], `window_scales` [L, W, K/32], `window_start` [L].
  With `swa_bounded_replay.enable_prefix_cache_global_only` false they are also persisted on disk
  (V4-style); with true (the default) they never touch the disk.
- **Restore** loads the longest cached block-aligned prefix into fresh cache rows; the rings come from
  the pool (then the state equals a cold prefill's bit for bit), or else from a **bounded replay** of
  the prefix's last `encoder_replay_tokens` through the encoder and `decoder_replay_tokens` through the
  decoder, their windows truncated to the replayed span; the replay reads the restored global KV and
  never rewrites it.

Only complete, exactly computed state is saved: rows restored through a replay (approximate by design)
do not save their later blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import struct
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import engram_hash, schema, steps
from dsv41 import model as model_lib
from dsv41.cache import Cache, init_cache, layer_rings, layer_stores, with_mirror
from dsv41.errors import ConfigError
from dsv41.plan import layer_plan

MAGIC = b"DSV41KV1"
DIGEST = 32  # sha256
DEFAULT_DISK_BUDGET = 64 << 30
DEFAULT_POOL_BUDGET = 4 << 30
# Hashing every weight byte of a full-size model (~1 TB) at start-up is not an option; above this size
# the fingerprint hashes a strided sample of each leaf (pass `weights_id` for a checkpoint's own hash).
FULL_HASH_BYTES = 256 << 20
SAMPLE_ELEMENTS = 1 << 16


@dataclasses.dataclass
class Counters:
    """What the store and the pool did; every rejected entry is counted under its reason."""

    hits: int = 0             # blocks loaded from disk
    misses: int = 0           # blocks looked up and not usable (absent, expired or rejected)
    writes: int = 0           # block files written
    expired: int = 0          # entries dropped for their TTL (disk and pool)
    evicted: int = 0          # entries dropped for the byte budget (disk and pool)
    corrupt: int = 0          # bad magic, header or checksum
    truncated: int = 0        # shorter than its header says
    foreign: int = 0          # another model's fingerprint, another key, other tokens or shapes
    pool_hits: int = 0
    pool_misses: int = 0
    replays: int = 0          # rows whose rings were rebuilt by bounded replay
    replayed_tokens: int = 0  # tokens those replays ran through the encoder again


@dataclasses.dataclass
class RestoreInfo:
    """How a row was restored: `n_cached` tokens of global KV; rings from "pool", "disk", "replay" or
    "none" (nothing cached); `replayed` = (encoder tokens, decoder tokens) run again."""

    n_cached: int
    rings: str
    replayed: tuple = (0, 0)


# ------------------------------------------------------------------------------------------------
# Entries on disk: MAGIC | u32 header length | header JSON | payload | sha256 of all that precedes


def encode_entry(header: dict, arrays: dict[str, np.ndarray]) -> bytes:
    header = dict(header, arrays=[[n, str(a.dtype), list(a.shape)] for n, a in arrays.items()])
    head = json.dumps(header, sort_keys=True).encode()
    body = MAGIC + struct.pack("<I", len(head)) + head + b"".join(np.ascontiguousarray(a).tobytes()
                                                                  for a in arrays.values())
    return body + hashlib.sha256(body).digest()


class EntryError(Exception):
    """A stored entry that must not be used; `reason` is the Counters field it is counted under."""

    def __init__(self, reason: str, detail: str):
        self.reason = reason
        super().__init__(f"{reason}: {detail}")


def decode_entry(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """(header, arrays) of an entry, or EntryError("corrupt" | "truncated", ...)."""
    fixed = len(MAGIC) + 4
    if len(data) < fixed + DIGEST:
        raise EntryError("truncated", f"{len(data)} bytes, shorter than an empty entry")
    if data[:len(MAGIC)] != MAGIC:
        raise EntryError("corrupt", "bad magic")
    (n_head,) = struct.unpack("<I", data[len(MAGIC):fixed])
    if len(data) < fixed + n_head + DIGEST:
        raise EntryError("truncated", f"{len(data)} bytes, header alone needs {fixed + n_head + DIGEST}")
    try:
        header = json.loads(data[fixed:fixed + n_head])
        specs = [(n, np.dtype(d), tuple(s)) for n, d, s in header["arrays"]]
    except (ValueError, KeyError, TypeError) as e:
        raise EntryError("corrupt", f"unreadable header ({e})") from None
    size = fixed + n_head + sum(math.prod(s) * d.itemsize for _, d, s in specs) + DIGEST
    if len(data) < size:
        raise EntryError("truncated", f"{len(data)} bytes, expected {size}")
    if len(data) > size or hashlib.sha256(data[:-DIGEST]).digest() != data[-DIGEST:]:
        raise EntryError("corrupt", "checksum mismatch")
    arrays, at = {}, fixed + n_head
    for name, dtype, shape in specs:
        n = math.prod(shape) * dtype.itemsize
        arrays[name] = np.frombuffer(data, dtype, math.prod(shape), at).reshape(shape)
        at += n
    return header, arrays


class DiskStore:
    """Block entries as files `<key><suffix>` in one directory: TTL on last use, LRU byte budget.

    Times come from `clock` (seconds) and are kept as the files' mtimes, so TTL and LRU order survive
    restarts and are shared by every process that uses the directory."""

    def __init__(self, directory, suffix: str, ttl_s: float, budget_bytes: int, clock, counters: Counters):
        self.dir, self.suffix, self.ttl_s, self.budget = Path(directory), suffix, ttl_s, budget_bytes
        self.clock, self.counters = clock, counters
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.dir / f"{key}{self.suffix}"

    def get(self, key: str, check) -> dict[str, np.ndarray] | None:
        """The arrays of `key` if present, fresh and accepted by `check(header, arrays)` (which raises
        EntryError("foreign", ...) otherwise); a rejected entry is counted and deleted."""
        path = self.path(key)
        try:
            mtime = path.stat().st_mtime
            if self.clock() - mtime > self.ttl_s:
                self._drop(path, "expired")
                return None
            header, arrays = decode_entry(path.read_bytes())
            check(header, arrays)
        except FileNotFoundError:
            return None
        except EntryError as e:
            self._drop(path, e.reason)
            return None
        now = self.clock()
        os.utime(path, (now, now))  # last use: the LRU order and the TTL restart
        return arrays

    def put(self, key: str, header: dict, arrays: dict[str, np.ndarray]) -> int:
        """Writes atomically (temp file in the same directory, fsync, rename): a reader sees the old
        entry, the new one or none, never a partial file; two writers of one key both leave a whole one."""
        data = encode_entry(header, arrays)
        tmp = self.dir / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        now = self.clock()
        os.utime(tmp, (now, now))
        os.replace(tmp, self.path(key))
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself survives a crash
        finally:
            os.close(fd)
        self.counters.writes += 1
        self.evict()
        return len(data)

    def evict(self) -> None:
        """Drops expired entries, then the least recently used until the directory fits the budget."""
        now, live = self.clock(), []
        for e in os.scandir(self.dir):
            if not e.name.endswith(self.suffix) or e.name.startswith(".tmp-"):
                continue
            st = e.stat()
            if now - st.st_mtime > self.ttl_s:
                self._drop(Path(e.path), "expired")
            else:
                live.append((st.st_mtime, st.st_size, Path(e.path)))
        total = sum(s for _, s, _ in live)
        for _, size, path in sorted(live, key=lambda t: t[0]):
            if total <= self.budget:
                break
            self._drop(path, "evicted")
            total -= size

    def nbytes(self) -> int:
        return sum(e.stat().st_size for e in os.scandir(self.dir) if e.name.endswith(self.suffix)
                   and not e.name.startswith(".tmp-"))

    def _drop(self, path: Path, reason: str) -> None:
        setattr(self.counters, reason, getattr(self.counters, reason) + 1)
        path.unlink(missing_ok=True)


class WindowPool:
    """Window rings at block boundaries in host memory: key -> arrays, TTL on insertion, LRU budget."""

    def __init__(self, ttl_s: float, budget_bytes: int, clock, counters: Counters):
        self.ttl_s, self.budget, self.clock, self.counters = ttl_s, budget_bytes, clock, counters
        self.items: OrderedDict[str, tuple[float, dict]] = OrderedDict()

    def get(self, key: str) -> dict[str, np.ndarray] | None:
        item = self.items.get(key)
        if item is not None and self.clock() - item[0] > self.ttl_s:
            del self.items[key]
            self.counters.expired += 1
            item = None
        if item is None:
            self.counters.pool_misses += 1
            return None
        self.items.move_to_end(key)
        self.counters.pool_hits += 1
        return item[1]

    def put(self, key: str, arrays: dict[str, np.ndarray]) -> None:
        self.items[key] = (self.clock(), {n: np.array(a) for n, a in arrays.items()})
        self.items.move_to_end(key)
        while self.nbytes() > self.budget and self.items:
            self.items.popitem(last=False)
            self.counters.evicted += 1

    def nbytes(self) -> int:
        return sum(a.nbytes for _, arrays in self.items.values() for a in arrays.values())


# ------------------------------------------------------------------------------------------------
# Identity of the model


def fingerprint(cfg, params, weights_id: str | None = None) -> str:
    """sha256 of the config fields that change the KV and of the weights (or of `weights_id`).

    The prefill schedule, the replay lengths and the cache settings are left out: the global KV is the
    same under both schedules (CED computes it from the encoder, which every prompt token runs)."""
    raw = cfg.to_dict()
    for drop in ("base_url", "swa_bounded_replay"):
        raw.pop(drop, None)
    raw.get("kv_cache", {}).pop("persistent_cache", None)
    raw.get("runtime", {}).pop("prefill_schedule", None)
    h = hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode())
    if weights_id is not None:
        h.update(b"weights_id:" + weights_id.encode())
        return h.hexdigest()
    leaves = jax.tree_util.tree_leaves_with_path(params)
    sample = sum(x.size * x.dtype.itemsize for _, x in leaves) > FULL_HASH_BYTES
    for path, x in leaves:
        a = np.asarray(x).reshape(-1)
        h.update(f"{jax.tree_util.keystr(path)}:{x.shape}:{x.dtype}".encode())
        if sample:
            a = a[:: max(1, a.size // SAMPLE_ELEMENTS)]
        h.update(np.ascontiguousarray(a).view(np.uint8).tobytes())
    return h.hexdigest()


def chain_keys(fp: str, tokens, block: int) -> list[str]:
    """The key of every complete block of `tokens`: sha256(previous key | int32 LE token ids)."""
    tokens = np.asarray(tokens, np.int64)
    keys, prev = [], bytes.fromhex(fp)
    for k in range(len(tokens) // block):
        prev = hashlib.sha256(prev + tokens[k * block:(k + 1) * block].astype("<i4").tobytes()).digest()
        keys.append(prev.hex())
    return keys


# ------------------------------------------------------------------------------------------------
# The prefix cache


def replay_engram_ids(cfg, token_map, prompts, n_cached, tokens, counts):
    """Engram ids [B, R, L_engram, C] (None without Engram layers) of replayed tokens [B, R]: row b's tokens
    start at position n_cached[b] - counts[b] and look back into its prompt; every row hashed at once
    (`engram_hash.hash_token_window`)."""
    e = cfg.architecture.engram
    if not list(e.layers):
        return None
    look = e.max_ngram - 1
    tokens = np.asarray(tokens)
    window = np.full((len(prompts), look + tokens.shape[1]), -1, np.int64)
    for row, p in enumerate(prompts):
        start = int(n_cached[row]) - int(counts[row])
        back = np.asarray(p)[max(0, start - look):start]
        window[row, look - len(back):look] = back
    window[:, look:] = tokens
    ids = engram_hash.hash_token_window(model_lib.engram_layout(cfg), model_lib.engram_token_map(cfg, token_map),
                                        e.pad_id, window)
    return jnp.asarray(ids, jnp.int32)


class PrefixCache:
    """Global KV of prompt prefixes on disk, window rings in a host pool, bounded replay on a pool miss.

        pc = PrefixCache(cfg, params, "/var/cache/dsv41")       # or directory=None: $DSV41_PREFIX_CACHE
        logits_BV, cache, infos = pc.prefill([prompt_ids, ...], max_len=4096)   # restore + prefill + save
        # or by hand:
        cache, n_cached, infos = pc.restore([prompt_ids], max_len)   # then prefill prompt_ids[n_cached:]
        pc.save(prompt_ids[:q], cache, row=0)                         # cache.lengths[row] == q

    Args:
      cfg, params: the model (a V4.1 config; the store keeps the cache's leaves as they are: the packed
        formats with quant qat, floats with quant none, which the fingerprint tells apart).
      directory: the store's folder (default: $DSV41_PREFIX_CACHE or ~/.cache/dsv41/prefix_cache).
      block_tokens: tokens per block; default `kv_cache.persistent_cache.block_tokens` when the config
        has that field, else 256. Must be a positive multiple of every compression ratio.
      disk_budget_bytes / pool_budget_bytes: byte budgets of the store (shared by every model using the
        directory) and of the window pool.
      clock: seconds, e.g. time.time (injectable for TTL tests).
      weights_id: a checkpoint's identity to fingerprint instead of hashing the weights.
      token_map: the Engram token map (as for `steps.prefill`).
      replay_tokens: (encoder, decoder) tokens a bounded replay runs again; default
        swa_bounded_replay's encoder_replay_tokens and decoder_replay_tokens (a report varies them
        without a new config, whose compiled steps would all be rebuilt).
    """

    def __init__(self, cfg, params, directory=None, *, block_tokens: int | None = None,
                 disk_budget_bytes: int = DEFAULT_DISK_BUDGET, pool_budget_bytes: int = DEFAULT_POOL_BUDGET,
                 clock=time.time, weights_id: str | None = None, token_map=None,
                 replay_tokens: tuple[int, int] | None = None):
        if cfg.architecture.family != schema.V41:
            raise ConfigError("architecture.family", cfg.architecture.family,
                              f"expected {schema.V41!r}: the prefix cache stores V4.1's global KV and replays "
                              "V4.1's windows")
        self.cfg, self.params, self.token_map = cfg, params, token_map
        self.steps = steps.bind(params, cfg)  # the steps, bound once (`steps.Bound`)
        pc = cfg.kv_cache.persistent_cache
        if block_tokens is None:
            block_tokens = pc.block_tokens
        ratios = sorted({r.ratio for r in layer_plan(cfg) if r.ratio})
        step = math.lcm(*ratios) if ratios else 1
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0 \
                or block_tokens % step:
            raise ConfigError("kv_cache.persistent_cache.block_tokens", block_tokens,
                              f"expected a positive multiple of {step} (the compression ratios {ratios}): a block "
                              "boundary must close every compressor group")
        r = cfg.swa_bounded_replay
        enc, dec = replay_tokens or (r.encoder_replay_tokens, r.decoder_replay_tokens)
        window = cfg.kv_cache.swa_window_size
        if not 0 <= enc <= window:
            raise ConfigError("swa_bounded_replay.encoder_replay_tokens", enc,
                              f"expected 0..kv_cache.swa_window_size ({window}): replay rebuilds at most one window")
        if not 0 <= dec <= enc:
            raise ConfigError("swa_bounded_replay.decoder_replay_tokens", dec,
                              f"expected 0..encoder_replay_tokens ({enc}): the decoder replays tokens whose "
                              "encoder output the encoder replay rebuilt")
        self.replay_tokens = (enc, dec)
        self.block = block_tokens
        self.counters = Counters()
        self.fp = fingerprint(cfg, params, weights_id)
        self.schedule = cfg.runtime.prefill_schedule
        directory = directory or os.environ.get("DSV41_PREFIX_CACHE") or Path.home() / ".cache/dsv41/prefix_cache"
        self.store = DiskStore(directory, ".kv", pc.global_kv_ttl_hours * 3600.0, disk_budget_bytes, clock,
                               self.counters)
        swa_ttl = pc.swa_kv_ttl_minutes * 60.0
        self.pool = None if pc.swa_kv_location == "none" else WindowPool(swa_ttl, pool_budget_bytes, clock,
                                                                         self.counters)
        # V4-style: rings persisted beside the global KV, per schedule (CED's decoder rings differ).
        self.ring_store = None if r.enable_prefix_cache_global_only else DiskStore(
            directory, f".{self.schedule}.swa", swa_ttl, disk_budget_bytes, clock, self.counters)
        self.plan = layer_plan(cfg)
        self.full = [rec for rec in self.plan if rec.stores_entries]
        self._layout()

    def _layout(self) -> None:
        """Which CompressedKV leaves grow with the capacity (per-entry rows, sliced per block) and which
        are per-sequence state (kept at a block's end); found from the shapes, not from field names."""
        step = self.block
        a, b = init_cache(self.cfg, 1, step), init_cache(self.cfg, 1, 2 * step)
        a_kv, b_kv = self._stores(a), self._stores(b)
        self.fields = [f.name for f in dataclasses.fields(a_kv[0])]
        self.per_entry = {f for f in self.fields if getattr(a_kv[0], f).shape[1] != getattr(b_kv[0], f).shape[1]}
        self.empty_state = [{f: np.asarray(getattr(c, f))[0] for f in self.fields if f not in self.per_entry}
                            for c in a_kv]
        self.block_shapes = {f"{rec.index}/{f}": (getattr(c, f).shape[1:], getattr(c, f).dtype)
                             for rec, c in zip(self.full, a_kv) for f in self.per_entry}
        self.state_shapes = {f"{rec.index}/{f}": (x.shape, x.dtype) for rec, e in zip(self.full, self.empty_state)
                             for f, x in e.items()}
        self.ring_shapes = {n: (x.shape, x.dtype) for n, x in self._row_rings(a, 0).items()}

    def _row_rings(self, cache: Cache, row: int) -> dict:
        """Row `row`'s rings in layer order (the pool's and the files' layout): window [L, W, K],
        window_scales [L, W, K/32], window_start [L] (copies; `cache` on the host or the device)."""
        out = {n: np.stack(layer_rings(self.cfg, [np.asarray(x[:, row]) for x in getattr(cache, n)]))
               for n in ("window", "window_scales")}  # one read per leaf, then the layers in order
        out["window_start"] = np.asarray(cache.window_start[:, row])
        return out

    def _set_row_rings(self, host: Cache, row: int, rings: dict) -> None:
        """Writes `_row_rings`' arrays into row `row` of a host cache (its per-slot leaves in place)."""
        for n in ("window", "window_scales"):
            for layer, view in enumerate(layer_rings(self.cfg, getattr(host, n))):
                view[row] = rings[n][layer]
        host.window_start[:, row] = rings["window_start"]

    def _stores(self, cache: Cache) -> list:
        """Each Full layer's CompressedKV [B, ·] in layer order (views into a host cache's stacked arrays)."""
        return list(layer_stores(self.cfg, cache).values())

    # -- keys and the usable prefix ------------------------------------------------------------

    def keys(self, tokens) -> list[str]:
        """The chain key of each complete block of `tokens`."""
        return chain_keys(self.fp, tokens, self.block)

    def restorable(self, n_prompt: int) -> int:
        """The longest block-aligned prefix of an n-token prompt worth restoring: at least one token is
        left to prefill (it gives the logits); under CED the last `decoder_replay_tokens` too, so that the
        final chunk replays them through the decoder as a cold CED prefill does."""
        keep = max(1, self.cfg.swa_bounded_replay.decoder_replay_tokens) if self.schedule == "ced" else 1
        return max(0, (n_prompt - keep) // self.block * self.block)

    # -- save ----------------------------------------------------------------------------------

    def save(self, tokens, cache: Cache, row: int = 0) -> int:
        """Saves the blocks of `tokens` (the ids row `row` of `cache` holds: cache.lengths[row] ==
        len(tokens)) that the store lacks, and the rings when the row ends on a block boundary.
        Returns the bytes written."""
        tokens = np.asarray(tokens, np.int64)
        held = int(cache.lengths[row])
        if held != len(tokens):
            raise ValueError(f"tokens: {len(tokens)} ids: expected the {held} tokens cache row {row} holds")
        keys = self.keys(tokens)
        comp = [{f: np.asarray(getattr(c, f)[row]) for f in self.fields} for c in self._stores(cache)]
        at_end = held % self.block == 0
        written = 0
        for k, key in enumerate(keys):
            last = at_end and k == len(keys) - 1
            if self.store.path(key).exists():
                continue  # a key names its whole prefix: an existing entry already holds these bytes
            arrays = {}
            for rec, c, empty in zip(self.full, comp, self.empty_state):
                lo, hi = k * self.block // rec.ratio, (k + 1) * self.block // rec.ratio
                for f in self.fields:
                    if f in self.per_entry:
                        arrays[f"{rec.index}/{f}"] = c[f][lo:hi]
                    elif last and not np.array_equal(c[f], empty[f]):
                        # A group-aligned boundary leaves V4.1's compressors empty; store any other state.
                        arrays[f"{rec.index}/{f}"] = c[f]
            written += self.store.put(key, self._header(key, k, tokens), arrays)
        if at_end and keys:
            rings = self._row_rings(cache, row)
            if self.pool is not None:
                self.pool.put(keys[-1], rings)
            if self.ring_store is not None:
                written += self.ring_store.put(keys[-1], self._header(keys[-1], len(keys) - 1, tokens), rings)
        return written

    def _header(self, key: str, k: int, tokens) -> dict:
        return {"version": 1, "fingerprint": self.fp, "key": key, "block": k,
                "tokens": tokens[k * self.block:(k + 1) * self.block].tolist()}

    # -- restore -------------------------------------------------------------------------------

    def restore(self, prompts, max_len: int):
        """Fresh cache rows holding each prompt's longest cached prefix.

        prompts: lists of token ids (one per row). Returns (cache [len(prompts) rows, capacity max_len rounded up
        to the compression ratios (`cache.round_capacity`)],
        n_cached [per row, a multiple of block_tokens], infos [RestoreInfo per row]); prefill each row's
        prompt[n_cached:] next. Rings come from the pool (exact) or from bounded replay (approximate).
        """
        prompts = [np.asarray(p, np.int64) for p in prompts]
        base = init_cache(self.cfg, len(prompts), max_len)
        host = jax.tree.map(np.array, base)
        n_cached, infos, replay_rows = [], [], []
        for row, p in enumerate(prompts):
            keys = self.keys(p[:self.restorable(len(p))])
            blocks = []
            for k, key in enumerate(keys):
                arrays = self.store.get(key, functools.partial(self._check, key=key, k=k, tokens=p))
                if arrays is None:
                    self.counters.misses += 1
                    break
                self.counters.hits += 1
                blocks.append(arrays)
            n = len(blocks) * self.block
            n_cached.append(n)
            if not n:
                infos.append(RestoreInfo(0, "none"))
                continue
            self._fill_row(host, row, p[:n], blocks)
            rings, where = self._rings(keys[len(blocks) - 1], len(blocks) - 1, p)
            if rings is not None:
                self._set_row_rings(host, row, rings)
                infos.append(RestoreInfo(n, where))
            else:
                replay_rows.append(row)
                infos.append(RestoreInfo(n, "replay"))
        cache = with_mirror(jax.tree.map(jnp.asarray, host), host.lengths, host.recent_tokens)
        if replay_rows:
            cache = self._replay(cache, prompts, n_cached, replay_rows, infos)
        return cache, n_cached, infos

    def _rings(self, key: str, k: int, tokens):
        if self.pool is not None:
            rings = self.pool.get(key)
            if rings is not None:
                return rings, "pool"
        if self.ring_store is not None:
            rings = self.ring_store.get(key, functools.partial(self._check, key=key, k=k, tokens=tokens,
                                                               rings=True))
            if rings is not None:
                return rings, "disk"
        return None, None

    def _check(self, header, arrays, *, key, k, tokens, rings=False) -> None:
        if header.get("fingerprint") != self.fp:
            raise EntryError("foreign", "another model's fingerprint")
        if header.get("key") != key or header.get("block") != k:
            raise EntryError("foreign", "another block's entry")
        if header.get("tokens") != tokens[k * self.block:(k + 1) * self.block].tolist():
            raise EntryError("foreign", "other tokens under this key")
        want = self.ring_shapes if rings else self.block_shapes
        allowed = want if rings else {**want, **self.state_shapes}
        got = {n: (a.shape, a.dtype) for n, a in arrays.items()}
        if not set(want) <= set(got) or any(allowed.get(n) != shape for n, shape in got.items()):
            raise EntryError("foreign", f"arrays {got} do not match this config's {allowed}")

    def _fill_row(self, host: Cache, row: int, prefix, blocks) -> None:
        n = len(prefix)
        host.lengths[row] = n
        for rec, c, empty in zip(self.full, self._stores(host), self.empty_state):
            for f in self.fields:
                name = f"{rec.index}/{f}"
                if f in self.per_entry:
                    getattr(c, f)[row, :n // rec.ratio] = np.concatenate([b[name] for b in blocks])
                else:
                    getattr(c, f)[row] = blocks[-1].get(name, empty[f])
        look = host.recent_tokens.shape[1]
        if look:  # the Engram look-back: the prefix's last tokens, -1 before the start
            tail = prefix[-look:]
            host.recent_tokens[row] = -1
            host.recent_tokens[row, look - len(tail):] = tail
        # Nothing of the prefix is in the rings until the pool or a replay fills them.
        host.window_start[:, row] = n

    # -- bounded replay ------------------------------------------------------------------------

    def _replay(self, cache: Cache, prompts, n_cached, rows, infos) -> Cache:
        """Rebuilds the rings of `rows` from the last replay tokens of their restored prefixes."""
        enc, dec = self.replay_tokens
        # Under CED the final prefill chunk replays the decoder itself (with its own truncated windows),
        # so only the encoder rings are needed here.
        dec = 0 if self.schedule == "ced" else dec
        if enc == 0:
            for row in rows:
                infos[row].replayed = (0, 0)
                self.counters.replays += 1
            return cache
        b = len(prompts)
        tokens = np.zeros((b, enc), np.int32)
        counts = np.zeros((b,), np.int32)
        for row in rows:
            n = min(enc, n_cached[row])
            tokens[row, :n] = prompts[row][n_cached[row] - n:n_cached[row]]
            counts[row] = n
            infos[row].replayed = (n, min(dec, n))
            self.counters.replays += 1
            self.counters.replayed_tokens += n
        ids = replay_engram_ids(self.cfg, self.token_map, prompts, n_cached, tokens, counts)
        return self.steps.replay(cache, tokens, counts, decoder_tokens=dec, engram_ids_BRLC=ids)

    # -- restore, prefill, save ----------------------------------------------------------------

    def prefill(self, prompts, max_len: int, *, chunk: int = 512):
        """Restores each prompt's cached prefix, prefills up to its last restorable block boundary,
        saves there (global KV and rings), then prefills the rest.

        prompts: lists of ids. Returns (logits [B, V] at each prompt's last token, cache, infos). Every
        call runs steps.prefill on [B, chunk] tokens (one compiled shape)."""
        prompts = [np.asarray(p, np.int64) for p in prompts]
        if not isinstance(chunk, int) or chunk <= 0:
            raise ValueError(f"chunk: {chunk!r}: expected a positive integer")
        if self.schedule == "ced" and chunk < self.cfg.swa_bounded_replay.decoder_replay_tokens:
            raise ValueError(f"chunk: {chunk}: expected at least swa_bounded_replay.decoder_replay_tokens "
                             f"({self.cfg.swa_bounded_replay.decoder_replay_tokens}) under CED, whose final chunk "
                             "replays them")
        cache, n_cached, infos = self.restore(prompts, max_len)
        snap = [max(n, self.restorable(len(p))) for p, n in zip(prompts, n_cached)]
        if any(s > n for s, n in zip(snap, n_cached)):
            _, cache = self._prefill_spans(cache, prompts, n_cached, snap, chunk, final=False)
        for row, (p, s, n, info) in enumerate(zip(prompts, snap, n_cached, infos)):
            if s > n and info.rings != "replay":
                self.save(p[:s], cache, row)
        logits, cache = self._prefill_spans(cache, prompts, snap, [len(p) for p in prompts], chunk, final=True)
        return logits, cache, infos

    def _prefill_spans(self, cache, prompts, begin, end, chunk, final):
        """steps.prefill of prompts[row][begin:end] in [B, chunk] calls aligned to the spans' ends."""
        size = np.array(end) - np.array(begin)
        calls = -(-int(size.max()) // chunk)
        logits = None
        for k in range(calls):
            stop = np.array(end) - (calls - 1 - k) * chunk
            start = np.maximum(stop - chunk, begin)
            counts = np.maximum(stop - start, 0)
            tokens = np.zeros((len(prompts), chunk), np.int32)
            for row, p in enumerate(prompts):
                tokens[row, :counts[row]] = p[start[row]:start[row] + counts[row]]
            logits, cache = self.steps.prefill(cache, tokens, counts, token_map=self.token_map,
                                               final=final and k == calls - 1)
        return logits, cache
