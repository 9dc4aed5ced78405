"""Storage formats of the V4.1 caches (DESIGN §3.8) in plain JAX: quantise, dequantise, pack, fake-quant.

| format          | tensor                | values   | scale, per block                                 |
|-----------------|-----------------------|----------|--------------------------------------------------|
| `fp4_e4m3_16`   | main global KV entry  | FP4 E2M1 | E4M3 per 16: e4m3(max(amax, 6·2^-9) / 6)         |
| `mxfp4`         | indexer key / query   | FP4 E2M1 | UE8M0 per 32: 2^ceil(log2(max(amax, 6·2^-126)·(1/6))) |
| `fp8_ue8m0_32`  | window KV             | FP8 E4M3 | UE8M0 per 32: 2^ceil(log2(max(amax, 1e-4)·(1/448)))   |
| `fp8_e4m3_16`   | main entry, FP8 option | FP8 E4M3 | E4M3 per 16: e4m3(max(amax, 448·2^-9) / 448)     |
| `fp8_ue8m0_64`  | V4: main and window KV, its NoPE dims | FP8 E4M3 | UE8M0 per 64, as `fp8_ue8m0_32` |

V4 (compat, DESIGN §4) as its official inference stores it: the main and window KV quantise only their NoPE
channels (`fp8_ue8m0_64`; `fp8_ue8m0_16` for narrow test models) and keep the RoPE channels in BF16
(`kv_store.RopeSplitFP8` packs the record); indexer keys and queries are rotated by the normalised
Walsh–Hadamard transform (`hadamard`) before `mxfp4`.

The numbers are those of the PyTorch port (transformers `modeling_deepseek_v41.py`: `_fake_quant_fp4_block`,
`_fake_quant_fp8_block`, `_pow2_ceil_scale`, run by the oracle on PyTorch 2.13 CPU), bit for bit on finite
inputs (`fp8_e4m3_16`, the main KV of `kv_cache.global_kv_dtype: fp8`, is dsv41's own: `fp4_e4m3_16` with
the E4M3 grid in place of E2M1, so 448 takes the place of 6): every product and quotient is the port's float32 one, the constants 1/6 and 1/448 are float32, values
are rounded to nearest-even. Three places differ between XLA and torch and are handled below: XLA turns
division by a constant or a broadcast into multiplication by the reciprocal; XLA CPU treats subnormal float32
as zero, which only the `mxfp4` floor (scales down to 2^-126) can reach; torch's float32 -> E4M3 cast
saturates where XLA's and ml_dtypes' give NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

FP4_E4M3_16 = "fp4_e4m3_16"
MXFP4 = "mxfp4"
FP8_UE8M0_32 = "fp8_ue8m0_32"
FP8_E4M3_16 = "fp8_e4m3_16"
FP8_UE8M0_64 = "fp8_ue8m0_64"
# FP8 E4M3 with a UE8M0 scale per block: 32 is V4.1's window, 64 V4's NoPE channels (16 and 128 for other widths).
FP8_UE8M0 = {block: f"fp8_ue8m0_{block}" for block in (16, 32, 64, 128)}
BLOCK = {FP4_E4M3_16: 16, MXFP4: 32, FP8_E4M3_16: 16, **{fmt: block for block, fmt in FP8_UE8M0.items()}}

E2M1_MAX = 6.0
E4M3_MAX = 448.0
# DESIGN §3.8: the E4M3 scale is floored at 6·2^-9 / 6 = 2^-9, the smallest E4M3 subnormal, so it is never 0.
_E4M3_SCALE_FLOOR = 6.0 * 2.0**-9
# DESIGN §3.8 "floored": the port floors the MXFP4 block max at 6·2^-126, keeping every scale >= 2^-126
# (a normal float32, never the UE8M0 byte 0).
_MXFP4_AMAX_FLOOR = 6.0 * 2.0**-126
# The port's FP8 floor (torch compares in float32; no float32 lies between float32(1e-4) and 1e-4).
_FP8_AMAX_FLOOR = 1e-4


def _blocks(x, block: int, name: str = "x"):
    """[..., D] -> float32 [..., D/block, block]; D must fill whole blocks."""
    d = x.shape[-1]
    if d % block:
        # The port silently skips quantisation for such widths; dsv41's config refuses them (DESIGN §3.8).
        raise ValueError(f"{name}.shape[-1]={d}: expected a multiple of the quantisation block {block}")
    return x.astype(jnp.float32).reshape(*x.shape[:-1], d // block, block)


def _check_scales(values, scales, block: int):
    """Raises unless `scales` is [..., D/block] for `values` [..., D]."""
    want = (*values.shape[:-1], values.shape[-1] // block)
    if values.shape[-1] % block or scales.shape != want:
        raise ValueError(f"scales.shape={scales.shape}: expected {want} for values of shape {values.shape}")


def _pow2(k):
    """float32 2^k for int32 k in [-126, 127], built from the exponent bits (jnp.exp2 is not exact on CPU)."""
    return lax.bitcast_convert_type((k + 127).astype(jnp.int32) << 23, jnp.float32)


def _ceil_log2(t):
    """int32 ceil(log2 t) of normal float32 t > 0, read off the bits as the port's `_pow2_ceil_scale` does."""
    bits = lax.bitcast_convert_type(t, jnp.int32)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)


def _ue8m0(k):
    """UE8M0 scale 2^k (float8_e8m0fnu) of int32 exponents k in [-127, 127]."""
    return lax.bitcast_convert_type((k + 127).astype(jnp.uint8), jnp.float8_e8m0fnu)


def _ue8m0_exponent(scales):
    """int32 exponent k of UE8M0 scales 2^k."""
    return lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.int32) - 127


def _divide(a, b):
    """a / b correctly rounded, b broadcast to a's shape.

    XLA rewrites division by a constant or a broadcast into multiplication by the reciprocal, which can
    miss the port's IEEE quotient in the last bit and so flip an E4M3 or E2M1 tie; the barrier hides b.
    """
    return a / lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, a.dtype), a.shape))


def _divide_pow2_exact(x, k):
    """x / 2^k for float32 x and int32 k, exact down to the E2M1 grid even for subnormal x.

    XLA CPU reads subnormal inputs as zero; torch does not, and with the MXFP4 floor a block of
    subnormals has scale 2^-126, so x·2^126 is what the port rounds. Here x = significand · 2^e is
    rescaled from its integer significand; a quotient below 2^-102 is clipped, it rounds to ±0 anyway.
    """
    bits = lax.bitcast_convert_type(x, jnp.int32)
    biased = (bits >> 23) & 0xFF
    significand = jnp.where(biased > 0, (bits & 0x7FFFFF) | 0x800000, bits & 0x7FFFFF)
    exponent = jnp.maximum(biased, 1) - 150
    magnitude = significand.astype(jnp.float32) * _pow2(jnp.clip(exponent - k, -126, 127))
    return jnp.where(bits < 0, -magnitude, magnitude)


def _to_e2m1(q):
    """float32 -> float4_e2m1fn, round to nearest even after the port's clamp to ±6 (signed zeros kept)."""
    return jnp.clip(q, -E2M1_MAX, E2M1_MAX).astype(jnp.float4_e2m1fn)


def _decode_e2m1(values):
    """float4_e2m1fn -> float32; the port decodes both zero codes through its table to +0.0."""
    v = values.astype(jnp.float32)
    return jnp.where(v == 0, jnp.float32(0), v)


def _unblock(b):
    """[..., n, block] -> [..., n·block]."""
    return b.reshape(*b.shape[:-2], b.shape[-2] * b.shape[-1])


def quantize_fp4_e4m3_16(x):
    """x [..., D] -> (E2M1 values float4_e2m1fn [..., D], E4M3 scales float8_e4m3fn [..., D/16])."""
    b = _blocks(x, BLOCK[FP4_E4M3_16])
    amax = jnp.max(jnp.abs(b), axis=-1)
    t = _divide(jnp.maximum(amax, _E4M3_SCALE_FLOOR), E2M1_MAX)
    # torch 2.13's float32 -> e4m3fn cast saturates to 448 (inf too); ml_dtypes' and XLA's give NaN.
    # DESIGN §3.8 is silent on it; the port is the truth, so a block max above 6·448 gets scale 448.
    scales = jnp.minimum(t, E4M3_MAX).astype(jnp.float8_e4m3fn)
    q = _divide(b, scales.astype(jnp.float32)[..., None])
    return _unblock(_to_e2m1(q)), scales


def dequantize_fp4_e4m3_16(values, scales):
    """(float4_e2m1fn [..., D], float8_e4m3fn [..., D/16]) -> float32 [..., D]."""
    block = BLOCK[FP4_E4M3_16]
    _check_scales(values, scales, block)
    v = _decode_e2m1(values).reshape(*scales.shape, block)
    return _unblock(v * scales.astype(jnp.float32)[..., None])


def quantize_fp8_e4m3_16(x):
    """x [..., D] -> (E4M3 values float8_e4m3fn [..., D], E4M3 scales float8_e4m3fn [..., D/16]): the FP8 main
    entry, scaled as `quantize_fp4_e4m3_16` with the E4M3 grid's 448 in place of E2M1's 6 (scales >= 2^-9,
    saturating at 448 like the FP4 entry's)."""
    b = _blocks(x, BLOCK[FP8_E4M3_16])
    amax = jnp.max(jnp.abs(b), axis=-1)
    t = _divide(jnp.maximum(amax, E4M3_MAX * 2.0**-9), E4M3_MAX)
    scales = jnp.minimum(t, E4M3_MAX).astype(jnp.float8_e4m3fn)
    q = jnp.clip(_divide(b, scales.astype(jnp.float32)[..., None]), -E4M3_MAX, E4M3_MAX)
    return _unblock(q.astype(jnp.float8_e4m3fn)), scales


def dequantize_fp8_e4m3_16(values, scales):
    """(float8_e4m3fn [..., D], float8_e4m3fn [..., D/16]) -> float32 [..., D]."""
    block = BLOCK[FP8_E4M3_16]
    _check_scales(values, scales, block)
    v = values.astype(jnp.float32).reshape(*scales.shape, block)
    return _unblock(v * scales.astype(jnp.float32)[..., None])


def quantize_mxfp4(x):
    """x [..., D] -> (E2M1 values float4_e2m1fn [..., D], UE8M0 scales float8_e8m0fnu [..., D/32])."""
    b = _blocks(x, BLOCK[MXFP4])
    amax = jnp.max(jnp.abs(b), axis=-1)
    # The port multiplies by float32(1/6) rather than dividing: the product can round across a power of two.
    k = _ceil_log2(jnp.maximum(amax, _MXFP4_AMAX_FLOOR) * jnp.float32(1 / E2M1_MAX))
    q = _divide_pow2_exact(b, k[..., None])
    return _unblock(_to_e2m1(q)), _ue8m0(k)


def dequantize_mxfp4(values, scales):
    """(float4_e2m1fn [..., D], float8_e8m0fnu [..., D/32], scales >= 2^-126) -> float32 [..., D]."""
    block = BLOCK[MXFP4]
    _check_scales(values, scales, block)
    v = _decode_e2m1(values).reshape(*scales.shape, block)
    k = _ue8m0_exponent(scales)[..., None]
    # ±0.5·2^-126 is the one product below 2^-126; XLA CPU flushes it to zero, the port keeps ±2^-127.
    subnormal = jnp.where(v < 0, jnp.float32(-(2.0**-127)), jnp.float32(2.0**-127))
    out = jnp.where((k == -126) & (jnp.abs(v) == 0.5), subnormal, v * _pow2(k))
    return _unblock(out)


def quantize_fp8_ue8m0(x, block: int):
    """x [..., D] -> (E4M3 values float8_e4m3fn [..., D], UE8M0 scales float8_e8m0fnu [..., D/block])."""
    b = _blocks(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(b), axis=-1), jnp.float32(_FP8_AMAX_FLOOR))
    k = _ceil_log2(amax * jnp.float32(1 / E4M3_MAX))
    # Scales lie in [2^-22, 2^120]: dividing by one (or XLA's multiply by its reciprocal) is exact, and a
    # quotient that XLA CPU flushes is below E4M3's smallest half-step anyway.
    q = jnp.clip(b / _pow2(k)[..., None], -E4M3_MAX, E4M3_MAX)
    return _unblock(q.astype(jnp.float8_e4m3fn)), _ue8m0(k)


def dequantize_fp8_ue8m0(values, scales):
    """(float8_e4m3fn [..., D], float8_e8m0fnu [..., D/block]) -> float32 [..., D] (the block from the shapes)."""
    if not scales.shape[-1] or values.shape[-1] % scales.shape[-1]:
        raise ValueError(f"scales.shape={scales.shape}: expected whole blocks of values of shape {values.shape}")
    block = values.shape[-1] // scales.shape[-1]
    _check_scales(values, scales, block)
    v = values.astype(jnp.float32).reshape(*scales.shape, block)
    return _unblock(v * _pow2(_ue8m0_exponent(scales))[..., None])


def quantize_fp8_ue8m0_32(x):
    """x [..., D] -> (E4M3 values float8_e4m3fn [..., D], UE8M0 scales float8_e8m0fnu [..., D/32])."""
    return quantize_fp8_ue8m0(x, BLOCK[FP8_UE8M0_32])


def dequantize_fp8_ue8m0_32(values, scales):
    """(float8_e4m3fn [..., D], float8_e8m0fnu [..., D/32]) -> float32 [..., D]."""
    _check_scales(values, scales, BLOCK[FP8_UE8M0_32])  # the block this name promises, not the shapes'
    return dequantize_fp8_ue8m0(values, scales)


def hadamard(x):
    """The normalised Walsh–Hadamard transform (Sylvester order) of x [..., D] along its last axis, D a power of
    two, in float32, returned in x.dtype: H_D x / sqrt(D) with H_1 = [1], H_2n = [[H, H], [H, -H]]. Orthonormal,
    so it leaves dot products unchanged and only spreads outliers before FP4 (V4's indexer, DESIGN §3.4)."""
    d = x.shape[-1]
    if d & (d - 1) or d == 0:
        raise ValueError(f"x.shape[-1]={d}: expected a power of two for the Hadamard transform")
    y = x.astype(jnp.float32)
    h = 1
    while h < d:  # butterflies: (a, b) -> (a + b, a - b) over pairs h apart
        y = y.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        y = jnp.concatenate([y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]], axis=-1)
        h *= 2
    return (y.reshape(x.shape) * jnp.float32(d ** -0.5)).astype(x.dtype)


def pack_fp4(values):
    """float4_e2m1fn [..., D] -> uint8 [..., D/2]: two codes a byte, the even element in the low nibble."""
    if values.shape[-1] % 2:
        raise ValueError(f"values.shape[-1]={values.shape[-1]}: expected an even count to pack two per byte")
    codes = lax.bitcast_convert_type(values, jnp.uint4).astype(jnp.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed):
    """uint8 [..., D/2] -> float4_e2m1fn [..., D], inverse of `pack_fp4`."""
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    codes = codes.reshape(*packed.shape[:-1], 2 * packed.shape[-1]).astype(jnp.uint4)
    return lax.bitcast_convert_type(codes, jnp.float4_e2m1fn)


def to_bytes(a):
    """One-byte codes (float8_e4m3fn values or scales, float8_e8m0fnu scales) [...] -> their bits, uint8 [...]."""
    return lax.bitcast_convert_type(a, jnp.uint8)


def from_bytes(b, dtype):
    """uint8 [...] -> the one-byte `dtype` [...] with those bits, inverse of `to_bytes`."""
    return lax.bitcast_convert_type(b, dtype)


_CODECS = {
    FP4_E4M3_16: (quantize_fp4_e4m3_16, dequantize_fp4_e4m3_16),
    MXFP4: (quantize_mxfp4, dequantize_mxfp4),
    FP8_E4M3_16: (quantize_fp8_e4m3_16, dequantize_fp8_e4m3_16),
    **{fmt: (functools.partial(quantize_fp8_ue8m0, block=block), dequantize_fp8_ue8m0)
       for block, fmt in FP8_UE8M0.items()},
}


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def fake_quant(x, fmt: str):
    """x [..., D] -> dequantise(quantise(x)) [..., D] in x.dtype, with a straight-through (identity) gradient."""
    if fmt not in _CODECS:
        raise ValueError(f"fmt={fmt!r}: expected one of {sorted(_CODECS)}")
    quantize, dequantize = _CODECS[fmt]
    return dequantize(*quantize(x)).astype(x.dtype)


@fake_quant.defjvp
def _fake_quant_jvp(fmt, primals, tangents):
    # DESIGN §3.8: training sees the cache formats as fake-quant with straight-through gradients; a
    # custom rule keeps the forward value bit-exact, which `x + stop_gradient(q - x)` does not.
    (x,), (dx,) = primals, tangents
    return fake_quant(x, fmt), dx
