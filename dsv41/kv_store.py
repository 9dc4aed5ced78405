"""The cache's stores as a layer reads and writes them (DESIGN §3.8, §6): ring slots, rows, bytes to floats.

A store is a [B, T, ...] leaf of `cache.Cache`: the FP8 window ring (slot p % W holds position p), a Full
layer's FP4 (or, with `kv_cache.global_kv_dtype: fp8`, FP8) entries with their E4M3 scale bytes and its
MXFP4 indexer keys with their UE8M0 scale bytes, the one-byte codes kept as uint8 (`quant.to_bytes`); V4.1's main
entries keep their bytes in pairs, as uint16 words (`to_words`: a TPU writes rows into an 8-bit array only after
copying the whole store into another tiling, docs/decode_bytes.md). The float cache (`quant: none`, V4 compat)
holds the values themselves, which the dequantisers pass through. Plain JAX over `dsv41.quant`: the cached attention
step (`nn.attention.Attention.step`) and the kernels' references (`dsv41.kernels`) read the stores through these.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dsv41 import quant
from dsv41.errors import ConfigError


def to_words(bytes_u8):
    """uint8 [..., X] (X even) -> the same bytes as uint16 words [..., X/2] (byte 2i the low half of word i)."""
    return jax.lax.bitcast_convert_type(bytes_u8.reshape(*bytes_u8.shape[:-1], -1, 2), jnp.uint16)


def from_words(x):
    """The bytes of a store leaf: uint16 words [..., X/2] -> uint8 [..., X] (`to_words`' inverse); any other leaf
    as it is."""
    if x.dtype != jnp.uint16:
        return x
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(*x.shape[:-1], -1)


def _as_stored(values, store):
    """Values to write into `store`: bytes as words for a word store, else cast to its dtype."""
    if store.dtype == jnp.uint16 and values.dtype == jnp.uint8:
        return to_words(values)
    return values.astype(store.dtype)


def ring_positions(lengths_B, window: int):
    """[B, W]: the position held by each ring slot (slot p % W holds p); negative where empty."""
    last = lengths_B[:, None] - 1
    return last - jnp.mod(last - jnp.arange(window), window)


def gather_rows(store, index_BSk):
    """store[b, index[b, s, j]] -> [B, S, k, ...] of an unstacked leaf [B, T, ...] (index clamped; the caller masks
    invalid picks): `LayerStore.gather`'s rule, for the kernels' references."""
    return LayerStore({"leaf": store}, None).gather("leaf", index_BSk)


@dataclasses.dataclass(frozen=True)
class LayerStore:
    """One layer's view of stacked store leaves (`cache.Cache`'s window ring [L, B, W, ·] or a stack
    slot's `CompressedKV` [G, B, T, ·]): `leaves` {name: stacked array} and the layer's index on their
    leading axis (an int, or traced inside a scan; None: the leaves are one layer's, unstacked). Reads and
    writes go to that layer in place: a scanned layer neither copies nor re-stacks the store.

    row: None (the view holds every row B), or a row index (traced): the leaves' rows are split into D groups
    of N (`split_rows`: [·, D, N, T, ·] where they were [·, B, T, ·]) and the view holds row `row` of each
    group, [D, T, ·] (`Attention.step`'s loop over each device's rows)."""

    leaves: dict
    layer: object
    row: object = None

    def _fixed(self) -> dict:
        """{axis: index} of the leaves' axes the view fixes (the layer's, the row's)."""
        fixed = {} if self.layer is None else {0: self.layer}
        if self.row is not None:
            fixed[len(fixed) + 1] = self.row
        return fixed

    @staticmethod
    def _begin(x, fixed: dict) -> list:
        """A dynamic slice's start of leaf x at the fixed axes' indices (0 elsewhere)."""
        zero = jnp.zeros((), jnp.int32)
        return [jnp.asarray(fixed[a], jnp.int32) if a in fixed else zero for a in range(x.ndim)]

    def _slice(self, x, at: int = 0, size=None):
        """The view of leaf x, with `size` entries from `at` on its entry axis (the whole axis if size is None)."""
        fixed = self._fixed()
        if not fixed and size is None:
            return x
        entry = len(fixed) + 1  # the axis after the rows'
        begin = self._begin(x, fixed)
        sizes = [1 if a in fixed else x.shape[a] for a in range(x.ndim)]
        if size is not None:
            begin[entry], sizes[entry] = jnp.asarray(at, jnp.int32), size
        return jax.lax.squeeze(jax.lax.dynamic_slice(x, begin, sizes), tuple(fixed))

    def get(self, name: str):
        """The layer's whole leaf [B, T, ·] (a dynamic slice under a scan; [D, T, ·] for a row view)."""
        return self._slice(self.leaves[name])

    def tile(self, name: str, start, size: int):
        """Rows start..start+size-1 of the layer's leaf -> [B, size, ·] (start traced; in bounds)."""
        return self._slice(self.leaves[name], start, size)

    def _index(self, x, index):
        """The index tuple of entries index[r, …] of the view's rows r, in leaf x's axes."""
        fixed = self._fixed()
        rows = jnp.arange(index.shape[0]).reshape(-1, *([1] * (index.ndim - 1)))
        lead = [fixed[a] if a in fixed else rows for a in range(len(fixed) + 1)]
        return (*lead, index)

    def gather(self, name: str, index_BSk):
        """The leaf's rows index[b, s, j] of each row b -> [B, S, k, ·] (index clamped; the caller masks invalid
        picks; no copy of the layer's leaf)."""
        x = self.leaves[name]
        entries = x.shape[len(self._fixed()) + 1]
        return x[self._index(x, jnp.clip(index_BSk, 0, entries - 1))]

    def write(self, name: str, values_BNX, index_BN, keep_BN) -> "LayerStore":
        """The store with leaf[b, index[b, n]] = values[b, n] where keep (others dropped), in place."""
        x = self.leaves[name]
        index = jnp.where(keep_BN, index_BN, x.shape[len(self._fixed()) + 1])
        return self.put_leaf(name, x.at[self._index(x, index)].set(_as_stored(values_BNX, x), mode="drop"))

    def put(self, name: str, value) -> "LayerStore":
        """The store with the layer's whole leaf replaced by `value` [B, ·]."""
        x, fixed = self.leaves[name], self._fixed()
        if not fixed:
            return self.put_leaf(name, value.astype(x.dtype))
        return self.put_leaf(name, jax.lax.dynamic_update_slice(
            x, jnp.expand_dims(value.astype(x.dtype), tuple(fixed)), self._begin(x, fixed)))

    def put_leaf(self, name: str, stacked) -> "LayerStore":
        return dataclasses.replace(self, leaves={**self.leaves, name: stacked})

    def split_rows(self, groups: int) -> "LayerStore":
        """The same store with its rows B split into `groups` groups of B / groups ([·, D, N, T, ·]), viewed at
        row 0 of each (`at_row`); `merge_rows` undoes it. Reshapes of leading axes: no copy."""
        a = 0 if self.layer is None else 1
        split = {k: v.reshape(*v.shape[:a], groups, v.shape[a] // groups, *v.shape[a + 1:])
                 for k, v in self.leaves.items()}
        return LayerStore(split, self.layer, 0)

    def at_row(self, row) -> "LayerStore":
        return dataclasses.replace(self, row=row)

    def merge_rows(self) -> "LayerStore":
        a = 0 if self.layer is None else 1
        merged = {k: v.reshape(*v.shape[:a], v.shape[a] * v.shape[a + 1], *v.shape[a + 2:])
                  for k, v in self.leaves.items()}
        return LayerStore(merged, self.layer, None)


def packed(store) -> bool:
    """True when a store leaf holds the packed bytes, False for the float cache."""
    return store.dtype in (jnp.uint8, jnp.uint16)


# The main KV formats the packed cache stores, by (kv_cache.global_kv_dtype, kv_cache.global_kv_scale).
MAIN_KV_FORMATS = {
    ("fp4_e2m1", "e4m3_per_16_channel"): quant.FP4_E4M3_16,
    ("fp8", "e4m3_per_16_channel"): quant.FP8_E4M3_16,
    ("fp8_e4m3", "e4m3_per_16_channel"): quant.FP8_E4M3_16,
}
# The window and indexer key formats it stores (one each), by (dtype, scale) as the config names them.
WINDOW_FORMATS = {("fp8", "ue8m0_per_32_channel", None), ("fp8_e4m3", "ue8m0_per_32_channel", None)}
INDEX_FORMATS = {("fp4_e2m1", "ue8m0_per_32_channel")}


def main_kv_format(cfg) -> str:
    """The `quant` format of the packed cache's main entries (V4.1 with `quant: qat`): FP4 E2M1 (shipped) or FP8
    E4M3, each with an E4M3 scale per 16 channels. Raises ConfigError for a `kv_cache` format the packed cache
    cannot store as the byte accounting counts it (the accounting itself takes any format)."""
    kv = cfg.kv_cache
    fmt = MAIN_KV_FORMATS.get((kv.global_kv_dtype, kv.global_kv_scale))
    if fmt is None:
        raise ConfigError("kv_cache.global_kv_dtype", f"{kv.global_kv_dtype} / {kv.global_kv_scale}",
                          "expected a main KV format the cache stores: "
                          + ", ".join(f"{d} with {s}" for d, s in MAIN_KV_FORMATS))
    checks = [("kv_cache.global_kv_rope_dtype", kv.global_kv_rope_dtype, None),
              ("kv_cache.global_kv_entry_align_bytes", kv.global_kv_entry_align_bytes, 1)]
    for field, value, want in checks:
        if value != want:
            raise ConfigError(field, value,
                              f"expected {want} (the V4.1 cache stores the RoPE dims like the rest, unpadded)")
    if (kv.swa_kv_dtype, kv.swa_kv_scale, kv.swa_kv_rope_dtype) not in WINDOW_FORMATS:
        raise ConfigError("kv_cache.swa_kv_dtype", f"{kv.swa_kv_dtype} / {kv.swa_kv_scale} / {kv.swa_kv_rope_dtype}",
                          "expected fp8 with ue8m0_per_32_channel and no separate RoPE format, the window format the "
                          "V4.1 cache stores")
    if (kv.index_kv_dtype, kv.index_kv_scale) not in INDEX_FORMATS:
        raise ConfigError("kv_cache.index_kv_dtype", f"{kv.index_kv_dtype} / {kv.index_kv_scale}",
                          "expected fp4_e2m1 with ue8m0_per_32_channel, the indexer key format the cache stores")
    return fmt


def dequant_entries(packed_values, scale_bytes):
    """Main entries as stored (+ E4M3 scale bytes, one per 16 channels) -> float32: FP4 (two codes a byte, so
    the bytes are 8 per scale) or FP8 (16 per scale); the float cache's entries as they are."""
    if not packed(packed_values):
        return packed_values
    packed_values = from_words(packed_values)
    scales = quant.from_bytes(scale_bytes, jnp.float8_e4m3fn)
    if packed_values.shape[-1] == scale_bytes.shape[-1] * quant.BLOCK[quant.FP8_E4M3_16]:
        return quant.dequantize_fp8_e4m3_16(quant.from_bytes(packed_values, jnp.float8_e4m3fn), scales)
    return quant.dequantize_fp4_e4m3_16(quant.unpack_fp4(packed_values), scales)


def quant_entries(entries, fmt: str):
    """Float entries [..., K] -> (stored bytes, E4M3 scale bytes) in main KV format `fmt` (`main_kv_format`)."""
    if fmt == quant.FP8_E4M3_16:
        vals, scales = quant.quantize_fp8_e4m3_16(entries)
        return quant.to_bytes(vals), quant.to_bytes(scales)
    vals, scales = quant.quantize_fp4_e4m3_16(entries)
    return quant.pack_fp4(vals), quant.to_bytes(scales)


def quant_keys(keys):
    """Indexer keys [..., dI] -> (packed MXFP4 bytes [..., dI/2], UE8M0 scale bytes [..., dI/32]), as stored."""
    vals, scales = quant.quantize_mxfp4(keys)
    return quant.pack_fp4(vals), quant.to_bytes(scales)


def dequant_keys(packed_values, scale_bytes):
    """MXFP4 indexer keys (+ UE8M0 scale bytes) -> float32; the float cache's keys as they are."""
    if not packed(packed_values):
        return packed_values
    return quant.dequantize_mxfp4(quant.unpack_fp4(packed_values), quant.from_bytes(scale_bytes, jnp.float8_e8m0fnu))


def dequant_window(value_bytes, scale_bytes):
    """FP8 window values (+ UE8M0 scale bytes) [..., K] -> float32 [..., K]; V4.1's packed ring (V4's holds
    `RopeSplitFP8` records)."""
    return quant.dequantize_fp8_ue8m0_32(quant.from_bytes(value_bytes, jnp.float8_e4m3fn),
                                         quant.from_bytes(scale_bytes, jnp.float8_e8m0fnu))


@dataclasses.dataclass(frozen=True)
class RopeSplitFP8:
    """V4's stored KV record (DESIGN §4, §5; its official inference): of a `dims`-wide vector whose last `rope`
    channels carry RoPE, the NoPE channels as FP8 E4M3 with a UE8M0 scale per `block` (`quant.fp8_ue8m0_*`), the
    RoPE channels as BF16, in one row of bytes: [NoPE codes | RoPE BF16, little-endian | scale bytes | zero pad
    up to a multiple of `align`]. V4-Flash's main entry: 448 + 128 + 7 + 1 = 584 bytes (its window rows use
    align 1: 583)."""

    dims: int
    rope: int
    block: int
    align: int = 1

    @property
    def nope(self) -> int:
        return self.dims - self.rope

    @property
    def row_bytes(self) -> int:
        raw = self.nope + 2 * self.rope + self.nope // self.block
        return -(-raw // self.align) * self.align

    def fake_quant(self, x):
        """x [..., dims] as stored and read back, in x.dtype: what the forward attends (quant: qat), with the
        FP8 half's straight-through gradient."""
        nope = quant.fake_quant(x[..., :self.nope], quant.FP8_UE8M0[self.block])
        rope = x[..., self.nope:].astype(jnp.bfloat16).astype(x.dtype)
        return jnp.concatenate([nope, rope], axis=-1)

    def encode(self, x):
        """x [..., dims] -> uint8 [..., row_bytes]."""
        values, scales = quant.quantize_fp8_ue8m0(x[..., :self.nope], self.block)
        rope = jax.lax.bitcast_convert_type(x[..., self.nope:].astype(jnp.bfloat16), jnp.uint8)  # [..., R, 2]
        parts = [quant.to_bytes(values), rope.reshape(*x.shape[:-1], 2 * self.rope), quant.to_bytes(scales)]
        pad = self.row_bytes - sum(p.shape[-1] for p in parts)
        return jnp.concatenate(parts + [jnp.zeros((*x.shape[:-1], pad), jnp.uint8)], axis=-1)

    def decode(self, row):
        """uint8 [..., row_bytes] -> float32 [..., dims]."""
        n, r = self.nope, self.rope
        values = quant.from_bytes(row[..., :n], jnp.float8_e4m3fn)
        rope = jax.lax.bitcast_convert_type(row[..., n:n + 2 * r].reshape(*row.shape[:-1], r, 2), jnp.bfloat16)
        scales = quant.from_bytes(row[..., n + 2 * r:n + 2 * r + n // self.block], jnp.float8_e8m0fnu)
        return jnp.concatenate([quant.dequantize_fp8_ue8m0(values, scales), rope.astype(jnp.float32)], axis=-1)


def v4_records(cfg) -> tuple[RopeSplitFP8, RopeSplitFP8]:
    """(main entry record, window row record) of a V4 config's packed cache (`quant: qat`), from its
    `kv_cache` formats; raises ConfigError naming a field whose format the V4 cache cannot store."""
    a, kv = cfg.architecture, cfg.kv_cache

    def record(prefix, dtype, scale, rope_dtype, align):
        if dtype not in ("fp8", "fp8_e4m3"):
            raise ConfigError(f"kv_cache.{prefix}_dtype", dtype, "expected fp8 (E4M3), the V4 cache's NoPE format")
        block = _ue8m0_block(f"kv_cache.{prefix}_scale", scale)
        if rope_dtype != "bf16":
            raise ConfigError(f"kv_cache.{prefix}_rope_dtype", rope_dtype,
                              "expected 'bf16': the V4 cache keeps the RoPE channels in BF16")
        if (a.head_dim - a.rope_head_dim) % block:
            raise ConfigError(f"kv_cache.{prefix}_scale", scale,
                              f"expected a block dividing the {a.head_dim - a.rope_head_dim} NoPE channels")
        return RopeSplitFP8(a.head_dim, a.rope_head_dim, block, align)

    if (kv.index_kv_dtype, kv.index_kv_scale) not in INDEX_FORMATS:
        raise ConfigError("kv_cache.index_kv_dtype", f"{kv.index_kv_dtype} / {kv.index_kv_scale}",
                          "expected fp4_e2m1 with ue8m0_per_32_channel, the indexer key format the cache stores")
    return (record("global_kv", kv.global_kv_dtype, kv.global_kv_scale, kv.global_kv_rope_dtype,
                   kv.global_kv_entry_align_bytes),
            record("swa_kv", kv.swa_kv_dtype, kv.swa_kv_scale, kv.swa_kv_rope_dtype, 1))


def _ue8m0_block(field: str, spec) -> int:
    blocks = {f"ue8m0_per_{b}_channel": b for b in quant.FP8_UE8M0}
    if spec not in blocks:
        raise ConfigError(field, spec, f"expected one of {sorted(blocks)} (FP8 with a UE8M0 scale per block)")
    return blocks[spec]
