"""Pallas kernels for the cache's storage formats (DESIGN §3.8, §8): quantise + pack, unpack + dequantise.

| format          | values bytes       | scale bytes        |
|-----------------|--------------------|--------------------|
| `fp4_e4m3_16`   | uint8 [N, K/2] E2M1, two a byte, even element in the low nibble | uint8 [N, K/16] E4M3 |
| `mxfp4`         | uint8 [N, K/2] E2M1, same packing                               | uint8 [N, K/32] UE8M0 |
| `fp8_ue8m0_32`  | uint8 [N, K] E4M3                                               | uint8 [N, K/32] UE8M0 |

The reference beside each kernel is `dsv41.quant` followed by `pack_fp4` / `to_bytes` (and the inverse), and
the kernels equal it bit for bit. Inside a kernel every code is built from integer bit operations (no float8
or float4 dtype, which Mosaic and Triton do not all lower) and no quotient is ever rounded: XLA, Mosaic and
Triton turn `x / c` into `x * (1/c)`, which misses the reference's IEEE quotient in the last bit and flips
E4M3/E2M1 ties. Instead
- the E4M3 scale e4m3(RN(a/6)) is first estimated from a·(1/6) and then settled by exact comparisons of a
  against 6 × the midpoints beside the estimate (those products have at most 8 significant bits, so they
  are exact). Rounding RN(a/6) to E4M3 equals rounding a/6 itself: a/6 can round onto an E4M3 midpoint
  only if it is one, because a = 6·midpoint + δ with δ a multiple of ulp(a) puts a/6 more than half an
  ulp away otherwise;
- an E2M1 code of x/s (s the E4M3 scale) counts the thresholds 0.25·s … 5·s that |x| passes, ties to the
  even code, again exact products and the same argument;
- the power-of-two scales divide exactly (`quant._divide_pow2_exact` for MXFP4, as the reference does).
One kernel body serves interpret mode (CPU tests), Mosaic TPU and Triton GPU: the ops it uses (int32 bit
operations, lane-splitting reshapes for the 16/32-element blocks, 0/1 matmuls that move the nibble pairs)
lower on all three;
the TPU AOT test and the GPU lowering check in the tests prove it for the compilers they reach. On a GPU a
tile is worked 128 columns at a time (`_columns`): a whole K = 512 row's [512, 256] pair matrix asked Triton
for 256 KB of shared memory on an H200, which has 227 KB.
Rows are tiled `block_rows` at a time (a multiple of 32: Mosaic tiles 8-bit arrays 32 rows deep).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from dsv41 import quant

FORMATS = (quant.FP4_E4M3_16, quant.MXFP4, quant.FP8_UE8M0_32)
_E2M1_MID = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # midpoints of 0, .5, 1, 1.5, 2, 3, 4, 6
_E4M3_MIN_NORMAL = 2.0**-6
_E4M3_MAX_CODE = 0x7E  # 448; 0x7F is NaN


def _f32(bits):
    return lax.bitcast_convert_type(bits, jnp.float32)


def _bits(x):
    return lax.bitcast_convert_type(x, jnp.int32)


# ----------------------------------------------------------------------------------------------------
# Codes <-> float32 from integer bit operations (shared with the attention kernel).

def decode_e2m1(nibble):
    """int32 codes 0..15 -> float32; both zero codes give +0.0, as the reference decodes them."""
    i = nibble & 7
    e, m = i >> 1, i & 1
    mag = jnp.where(e == 0, m.astype(jnp.float32) * 0.5, _f32(((e + 126) << 23) | (m << 22)))
    return jnp.where(((nibble & 8) != 0) & (mag > 0), -mag, mag)


def decode_e4m3(code):
    """int32 bytes 0..255 of float8_e4m3fn -> float32 (0x7F/0xFF -> NaN)."""
    sign, e, m = code >> 7, (code >> 3) & 15, code & 7
    normal = _f32((sign << 31) | ((e + 120) << 23) | (m << 20))
    sub = m.astype(jnp.float32) * 2.0**-9
    sub = jnp.where(sign != 0, -sub, sub)
    return jnp.where((e == 15) & (m == 7), jnp.nan, jnp.where(e == 0, sub, normal))


def decode_ue8m0(code):
    """int32 bytes of float8_e8m0fnu -> float32 2^(code-127), built as `quant._pow2` builds it (byte 0 -> 0)."""
    return _f32(code << 23)


def _round_half_even(y):
    """int32 round-to-nearest-even of float32 0 <= y < 2^23, by exact comparisons of the fraction (Pallas' Triton
    lowering has no `lax.round`; adding and removing 2^23 is exact only where nothing reassociates it)."""
    whole = y.astype(jnp.int32)                     # truncation: the floor of y >= 0
    frac = y - whole.astype(jnp.float32)            # exact: whole <= y < whole + 1
    up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
    return whole + up.astype(jnp.int32)


def _encode_e4m3(v):
    """float32 v, |v| <= 448 -> int32 float8_e4m3fn byte, round to nearest even (signed zeros kept)."""
    bits = _bits(v)
    mag = bits & 0x7FFFFFFF
    # Round the 23-bit mantissa to 3 bits with the carry running into the exponent; rebias 127 -> 7.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    a = _f32(mag)
    sub = _round_half_even(a * 2.0**9)
    code = jnp.where(a < _E4M3_MIN_NORMAL, sub, normal)
    return code | ((bits >> 31) & 1) << 7


def _e2m1_code(x, s):
    """int32 E2M1 code of round-to-nearest-even(x / s) clipped to ±6, without dividing (see module doc)."""
    a = jnp.abs(x)
    idx = jnp.zeros(x.shape, jnp.int32)
    for i, mid in enumerate(_E2M1_MID):
        # A tie goes to the even code: the upper neighbour i+1 is even when i is odd.
        passed = a >= mid * s if i % 2 else a > mid * s
        idx = idx + passed.astype(jnp.int32)
    return idx | ((_bits(x) >> 31) & 1) << 3


def _pair_matrix(half: int, low: float, high: float, transpose: bool = False):
    """bfloat16 [2·half, half]: row 2j -> column j with weight `low`, row 2j+1 with `high` (or its transpose)."""
    shape = (half, 2 * half) if transpose else (2 * half, half)
    full, pair = (1, 0) if transpose else (0, 1)
    i, j = lax.broadcasted_iota(jnp.int32, shape, full), lax.broadcasted_iota(jnp.int32, shape, pair)
    return jnp.where(i == 2 * j, low, jnp.where(i == 2 * j + 1, high, 0.0)).astype(jnp.bfloat16)


# The nibble pairs move between lanes by a 0/1 matmul of the codes (integers below 256 are exact in bfloat16
# and in the float32 accumulation): Mosaic has no lowering for the [R, K] <-> [R, K/2, 2] reshapes.
def _pack_nibbles(codes):
    """int32 [R, D] codes -> uint8 [R, D/2], even element in the low nibble."""
    packed = jnp.dot(codes.astype(jnp.bfloat16), _pair_matrix(codes.shape[1] // 2, 1.0, 16.0),
                     preferred_element_type=jnp.float32)
    return packed.astype(jnp.int32).astype(jnp.uint8)


def unpack_nibbles(packed):
    """uint8 [R, D/2] -> int32 [R, D] codes, inverse of `_pack_nibbles`."""
    b = packed.astype(jnp.int32)
    half = b.shape[1]

    def spread(nibbles, even):
        m = _pair_matrix(half, 1.0 if even else 0.0, 0.0 if even else 1.0, transpose=True)
        return jnp.dot(nibbles.astype(jnp.bfloat16), m, preferred_element_type=jnp.float32)

    return (spread(b & 15, True) + spread(b >> 4, False)).astype(jnp.int32)


def _blocks(x, block):
    r, d = x.shape
    return x.reshape(r, d // block, block)


def _unblock(x):
    r, n, block = x.shape
    return x.reshape(r, n * block)


# ----------------------------------------------------------------------------------------------------
# Tile computations: float32 [R, K] <-> (int32 codes [R, K], int32 scale bytes [R, K/block]).

def _quantize_fp4_e4m3_16_tile(x):
    b = _blocks(x, quant.BLOCK[quant.FP4_E4M3_16])
    a = jnp.maximum(jnp.max(jnp.abs(b), axis=-1), quant._E4M3_SCALE_FLOOR)
    c = _encode_e4m3(jnp.minimum(a * jnp.float32(1 / quant.E2M1_MAX), quant.E4M3_MAX))
    # Settle the estimate against the exact midpoints 6·(v + neighbour)/2 (module doc).
    v, up, down = decode_e4m3(c), decode_e4m3(c + 1), decode_e4m3(c - 1)
    up_mid, down_mid = 3 * (v + up), 3 * (v + down)
    go_up = (c < _E4M3_MAX_CODE) & ((a > up_mid) | ((a == up_mid) & ((c & 1) == 1)))
    go_down = (c > 1) & ((a < down_mid) | ((a == down_mid) & ((c & 1) == 1)))
    c = c + go_up.astype(jnp.int32) - go_down.astype(jnp.int32)
    codes = _e2m1_code(b, decode_e4m3(c)[..., None])
    return _unblock(codes), c


def _quantize_mxfp4_tile(x):
    b = _blocks(x, quant.BLOCK[quant.MXFP4])
    amax = jnp.max(jnp.abs(b), axis=-1)
    k = quant._ceil_log2(jnp.maximum(amax, quant._MXFP4_AMAX_FLOOR) * jnp.float32(1 / quant.E2M1_MAX))
    q = quant._divide_pow2_exact(b, k[..., None])
    return _unblock(_e2m1_code(q, jnp.float32(1))), k + 127


def _quantize_fp8_tile(x):
    b = _blocks(x, quant.BLOCK[quant.FP8_UE8M0_32])
    amax = jnp.maximum(jnp.max(jnp.abs(b), axis=-1), jnp.float32(quant._FP8_AMAX_FLOOR))
    k = quant._ceil_log2(amax * jnp.float32(1 / quant.E4M3_MAX))
    # 2^-k lies in [2^-120, 2^22]: the product is the reference's exact quotient.
    q = jnp.clip(b * quant._pow2(-k)[..., None], -quant.E4M3_MAX, quant.E4M3_MAX)
    return _unblock(_encode_e4m3(q)), k + 127


def dequantize_fp4_e4m3_16_tile(codes, scale_bytes):
    """int32 E2M1 codes [R, K], int32 E4M3 scale bytes [R, K/16] -> float32 [R, K]."""
    v = _blocks(decode_e2m1(codes), quant.BLOCK[quant.FP4_E4M3_16])
    return _unblock(v * decode_e4m3(scale_bytes)[..., None])


def _dequantize_mxfp4_tile(codes, scale_bytes):
    v = _blocks(decode_e2m1(codes), quant.BLOCK[quant.MXFP4])
    u = scale_bytes[..., None]
    # As the reference: ±0.5·2^-126 is kept as the float32 subnormal ±2^-127 (a CPU product would flush it).
    tiny = jnp.where(v < 0, jnp.float32(-(2.0**-127)), jnp.float32(2.0**-127))
    return _unblock(jnp.where((u == 1) & (jnp.abs(v) == 0.5), tiny, v * decode_ue8m0(u)))


def dequantize_fp8_tile(codes, scale_bytes):
    """int32 E4M3 bytes [R, K], int32 UE8M0 scale bytes [R, K/32] -> float32 [R, K]."""
    v = _blocks(decode_e4m3(codes), quant.BLOCK[quant.FP8_UE8M0_32])
    return _unblock(v * decode_ue8m0(scale_bytes)[..., None])


_PACKED = {quant.FP4_E4M3_16: True, quant.MXFP4: True, quant.FP8_UE8M0_32: False}
_QUANTIZE_TILE = {quant.FP4_E4M3_16: _quantize_fp4_e4m3_16_tile, quant.MXFP4: _quantize_mxfp4_tile,
                  quant.FP8_UE8M0_32: _quantize_fp8_tile}
_DEQUANTIZE_TILE = {quant.FP4_E4M3_16: dequantize_fp4_e4m3_16_tile, quant.MXFP4: _dequantize_mxfp4_tile,
                    quant.FP8_UE8M0_32: dequantize_fp8_tile}


def _column_slices(fmt, k: int, cols: int):
    """(x, values, scales) column slices of each `cols`-wide step: the blocks and nibble pairs are local to
    a step, so a tile can be quantised a few columns at a time (the GPU's shared memory holds a [cols, cols/2]
    pair matrix, not [K, K/2]: 256 KB at K = 512)."""
    per = 2 if _PACKED[fmt] else 1
    block = quant.BLOCK[fmt]
    return [(pl.ds(c, cols), pl.ds(c // per, cols // per), pl.ds(c // block, cols // block))
            for c in range(0, k, cols)]


def _quantize_kernel(x_ref, values_ref, scales_ref, *, fmt, cols):
    for xs, vs, ss in _column_slices(fmt, x_ref.shape[1], cols):
        codes, scale_bytes = _QUANTIZE_TILE[fmt](x_ref[:, xs].astype(jnp.float32))
        values_ref[:, vs] = _pack_nibbles(codes) if _PACKED[fmt] else codes.astype(jnp.uint8)
        scales_ref[:, ss] = scale_bytes.astype(jnp.uint8)


def _dequantize_kernel(values_ref, scales_ref, out_ref, *, fmt, cols):
    for xs, vs, ss in _column_slices(fmt, out_ref.shape[1], cols):
        v = values_ref[:, vs]
        codes = unpack_nibbles(v) if _PACKED[fmt] else v.astype(jnp.int32)
        out_ref[:, xs] = _DEQUANTIZE_TILE[fmt](codes, scales_ref[:, ss].astype(jnp.int32))


# Columns per step on a GPU (a whole row elsewhere: TPU lanes take the tile whole).
_GPU_COLUMNS = 128


def _columns(backend: str, k: int) -> int:
    return _GPU_COLUMNS if backend == "gpu" and k > _GPU_COLUMNS and k % _GPU_COLUMNS == 0 else k


# ----------------------------------------------------------------------------------------------------
# Public entry points.

def _check_fmt(fmt):
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r}: expected one of {list(FORMATS)}")


def _row_tiling(n: int, block_rows: int):
    if block_rows <= 0 or block_rows % 32:
        raise ValueError(f"block_rows={block_rows}: expected a positive multiple of 32 (8-bit tiles are 32 rows)")
    rows = min(block_rows, -(-n // 32) * 32)
    return rows, -(-n // rows) * rows


def _compiler_params(backend: str, n_axes: int):
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        return pltpu.CompilerParams(dimension_semantics=("parallel",) * n_axes)
    if backend == "gpu":
        from jax.experimental.pallas import triton as pltr
        return pltr.CompilerParams(num_warps=4, num_stages=1)
    return None


def quantize_pack(x, fmt: str, *, block_rows: int = 256, interpret: bool = False, backend: str | None = None):
    """x [..., K] -> (value bytes uint8 [..., K/2] (FP4) or [..., K] (FP8), scale bytes uint8 [..., K/block]).

    Bit-exact to `quantize_pack_reference`. `backend` ('tpu', 'gpu') picks the compiler parameters; by
    default the one JAX runs on."""
    _check_fmt(fmt)
    block = quant.BLOCK[fmt]
    *lead, k = x.shape
    if k % block or (_PACKED[fmt] and k % 2):
        raise ValueError(f"x.shape[-1]={k}: expected a multiple of the {fmt} block {block}")
    n = math.prod(lead)
    rows, padded = _row_tiling(n, block_rows)
    x_NK = jnp.pad(x.reshape(n, k), [(0, padded - n), (0, 0)])
    kv = k // 2 if _PACKED[fmt] else k
    backend = backend or jax.default_backend()
    values, scales = pl.pallas_call(
        functools.partial(_quantize_kernel, fmt=fmt, cols=_columns(backend, k)),
        out_shape=(jax.ShapeDtypeStruct((padded, kv), jnp.uint8), jax.ShapeDtypeStruct((padded, k // block), jnp.uint8)),
        grid=(padded // rows,),
        in_specs=[pl.BlockSpec((rows, k), lambda i: (i, 0))],
        out_specs=(pl.BlockSpec((rows, kv), lambda i: (i, 0)), pl.BlockSpec((rows, k // block), lambda i: (i, 0))),
        compiler_params=None if interpret else _compiler_params(backend, 1),
        interpret=interpret,
        # Tens of integer ops an element, the pair matmul for FP4; what XLA schedules around the call.
        cost_estimate=pl.CostEstimate(flops=(40 + (k if _PACKED[fmt] else 0)) * padded * k, transcendentals=0,
                                      bytes_accessed=padded * (4 * k + kv + k // block)),
        name=f"quantize_pack_{fmt}",
    )(x_NK)
    return values[:n].reshape(*lead, kv), scales[:n].reshape(*lead, k // block)


def unpack_dequantize(values, scales, fmt: str, *, block_rows: int = 256, interpret: bool = False,
                      backend: str | None = None):
    """(value bytes [..., K/2] or [..., K], scale bytes [..., K/block]) -> float32 [..., K], bit-exact to
    `unpack_dequantize_reference`."""
    _check_fmt(fmt)
    block = quant.BLOCK[fmt]
    *lead, kv = values.shape
    k = 2 * kv if _PACKED[fmt] else kv
    if values.dtype != jnp.uint8 or scales.dtype != jnp.uint8:
        raise ValueError(f"values.dtype={values.dtype}, scales.dtype={scales.dtype}: expected uint8 bytes")
    if k % block or scales.shape != (*lead, k // block):
        raise ValueError(f"scales.shape={scales.shape}: expected {(*lead, k // block)} for {fmt} values of shape "
                         f"{values.shape}")
    n = math.prod(lead)
    rows, padded = _row_tiling(n, block_rows)
    v_NV = jnp.pad(values.reshape(n, kv), [(0, padded - n), (0, 0)])
    s_NS = jnp.pad(scales.reshape(n, k // block), [(0, padded - n), (0, 0)])
    backend = backend or jax.default_backend()
    out = pl.pallas_call(
        functools.partial(_dequantize_kernel, fmt=fmt, cols=_columns(backend, k)),
        out_shape=jax.ShapeDtypeStruct((padded, k), jnp.float32),
        grid=(padded // rows,),
        in_specs=[pl.BlockSpec((rows, kv), lambda i: (i, 0)), pl.BlockSpec((rows, k // block), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((rows, k), lambda i: (i, 0)),
        compiler_params=None if interpret else _compiler_params(backend, 1),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(flops=(20 + (2 * k if _PACKED[fmt] else 0)) * padded * k, transcendentals=0,
                                      bytes_accessed=padded * (4 * k + kv + k // block)),
        name=f"unpack_dequantize_{fmt}",
    )(v_NV, s_NS)
    return out[:n].reshape(*lead, k)


# ----------------------------------------------------------------------------------------------------
# Plain-JAX references (dsv41.quant).

def quantize_pack_reference(x, fmt: str):
    """x [..., K] -> the bytes `quantize_pack` gives, from `dsv41.quant`."""
    _check_fmt(fmt)
    quantize, _ = quant._CODECS[fmt]
    values, scales = quantize(x)
    return (quant.pack_fp4(values) if _PACKED[fmt] else quant.to_bytes(values)), quant.to_bytes(scales)


_SCALE_DTYPE = {quant.FP4_E4M3_16: jnp.float8_e4m3fn, quant.MXFP4: jnp.float8_e8m0fnu,
                quant.FP8_UE8M0_32: jnp.float8_e8m0fnu}


def unpack_dequantize_reference(values, scales, fmt: str):
    """The float32 [..., K] `unpack_dequantize` gives, from `dsv41.quant`."""
    _check_fmt(fmt)
    _, dequantize = quant._CODECS[fmt]
    v = quant.unpack_fp4(values) if _PACKED[fmt] else quant.from_bytes(values, jnp.float8_e4m3fn)
    return dequantize(v, quant.from_bytes(scales, _SCALE_DTYPE[fmt]))
