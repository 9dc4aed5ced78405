"""Cache storage formats (DESIGN §3.8) against a NumPy float64 reference of the PyTorch port's quantisers.

The reference follows the port's formulas (transformers `modeling_deepseek_v41.py`) step by step: float32
wherever the port computes in float32, written here as an exact float64 operation followed by one rounding
to float32 (correct for products of floats, and for quotients since 53 >= 2·24 + 2); E2M1 rounding is a
nearest-grid-point search with ties to the even code; E4M3 / UE8M0 through ml_dtypes.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41 import formats, quant

F32, F64 = np.float32, np.float64
E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], F64)
E4M3_MAX = 448.0


# ---------------------------------------------------------------- the float64 reference of the port


def e2m1_round(q):
    """Port rounding of float32 q (clamped to ±6) onto E2M1: nearest grid point, ties to the even code.

    Returns (value float64 with the port's +0.0 for both zero codes, 4-bit code with the sign in bit 3).
    """
    mag = np.abs(q)
    dist = np.abs(mag[..., None] - E2M1_GRID)
    ties = dist == dist.min(-1, keepdims=True)
    index = np.argmax(ties & (np.arange(8) % 2 == 0), -1)  # a tie always pairs an even and an odd code
    index = np.where(ties.sum(-1) == 1, dist.argmin(-1), index)
    code = index | (np.signbit(q).astype(np.int64) << 3)
    return np.where(np.signbit(q), -1.0, 1.0) * E2M1_GRID[index] + 0.0, code.astype(np.uint8)


def ceil_log2(t):
    """Exact ceil(log2 t) of positive floats."""
    mantissa, exponent = np.frexp(t.astype(F64))
    return np.where(mantissa == 0.5, exponent - 1, exponent)


def torch_e4m3(t):
    """PyTorch 2.13's float32 -> float8_e4m3fn cast: round to nearest even, saturating at ±448."""
    return np.clip(t, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)


@np.errstate(over="ignore")  # like the port, a block at float32's limit may dequantise to inf
def ref_fp4_e4m3_16(x):
    """Port's compressed-KV quantiser: (codes, scale bytes, dequantised float32)."""
    b = x.astype(F64).reshape(*x.shape[:-1], -1, 16)
    amax = np.abs(b).max(-1)
    scale = torch_e4m3(F32(np.maximum(amax, 6 * 2.0**-9) / 6))
    s = scale.astype(F64)[..., None]
    value, code = e2m1_round(np.clip(F32(b / s), -6, 6))
    return code.reshape(x.shape), scale.view(np.uint8), F32(value * s).reshape(x.shape)


@np.errstate(over="ignore")  # like the port, a block at float32's limit may dequantise to inf
def ref_mxfp4(x):
    """Port's indexer quantiser: (codes, UE8M0 bytes, dequantised float32)."""
    b = x.astype(F64).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(b).max(-1)
    k = ceil_log2(F32(np.maximum(amax, 6 * 2.0**-126) * F64(F32(1 / 6))))
    s = np.ldexp(1.0, k)[..., None]
    value, code = e2m1_round(np.clip(F32(b / s), -6, 6))
    return code.reshape(x.shape), (k + 127).astype(np.uint8), F32(value * s).reshape(x.shape)


@np.errstate(over="ignore")  # like the port, a block at float32's limit may dequantise to inf
def ref_fp8(x, block=32):
    """Port's window-KV quantiser (V4's official `act_quant` with UE8M0 scales at block 64): (E4M3 bytes, UE8M0
    bytes, dequantised float32)."""
    b = x.astype(F64).reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(b).max(-1), F64(F32(1e-4)))
    k = ceil_log2(F32(amax * F64(F32(1 / 448))))
    s = np.ldexp(1.0, k)[..., None]
    value = np.clip(F32(b / s), -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    deq = F32(value.astype(F64) * s)
    return value.view(np.uint8).reshape(x.shape), (k + 127).astype(np.uint8), deq.reshape(x.shape)


@np.errstate(over="ignore")
def ref_fp8_e4m3_16(x):
    """dsv41's FP8 main entry (no port has one): the FP4 entry's recipe with E4M3 values, 448 in place of 6.
    (E4M3 bytes, E4M3 scale bytes, dequantised float32)."""
    b = x.astype(F64).reshape(*x.shape[:-1], -1, 16)
    amax = np.abs(b).max(-1)
    scale = torch_e4m3(F32(np.maximum(amax, E4M3_MAX * 2.0**-9) / E4M3_MAX))
    s = scale.astype(F64)[..., None]
    value = np.clip(F32(b / s), -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    deq = F32(value.astype(F64) * s)
    return value.view(np.uint8).reshape(x.shape), scale.view(np.uint8), deq.reshape(x.shape)


REFERENCE = {quant.FP4_E4M3_16: ref_fp4_e4m3_16, quant.MXFP4: ref_mxfp4, quant.FP8_UE8M0_32: ref_fp8,
             quant.FP8_E4M3_16: ref_fp8_e4m3_16, quant.FP8_UE8M0_64: lambda x: ref_fp8(x, 64)}
# Jitted once here: eager dispatch compiles every primitive separately and would dominate the run time.
QUANTIZE = {quant.FP4_E4M3_16: jax.jit(quant.quantize_fp4_e4m3_16), quant.MXFP4: jax.jit(quant.quantize_mxfp4),
            quant.FP8_UE8M0_32: jax.jit(quant.quantize_fp8_ue8m0_32),
            quant.FP8_E4M3_16: jax.jit(quant.quantize_fp8_e4m3_16),
            quant.FP8_UE8M0_64: jax.jit(lambda x: quant.quantize_fp8_ue8m0(x, 64))}
DEQUANTIZE = {quant.FP4_E4M3_16: jax.jit(quant.dequantize_fp4_e4m3_16), quant.MXFP4: jax.jit(quant.dequantize_mxfp4),
              quant.FP8_UE8M0_32: jax.jit(quant.dequantize_fp8_ue8m0_32),
              quant.FP8_E4M3_16: jax.jit(quant.dequantize_fp8_e4m3_16),
              quant.FP8_UE8M0_64: jax.jit(quant.dequantize_fp8_ue8m0)}
FAKE_QUANT = jax.jit(quant.fake_quant, static_argnums=1)
PACK, UNPACK = jax.jit(quant.pack_fp4), jax.jit(quant.unpack_fp4)
WIDTH = {quant.FP4_E4M3_16: 512, quant.MXFP4: 128, quant.FP8_UE8M0_32: 512, quant.FP8_E4M3_16: 512,
         quant.FP8_UE8M0_64: 448}
FORMATS = sorted(REFERENCE)


# ---------------------------------------------------------------- inputs


def e4m3_midpoints():
    """Midpoints between consecutive non-negative E4M3 values (ties of the FP8 cast)."""
    grid = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F64)
    return (grid[:-1] + grid[1:]) / 2


def hard_inputs(fmt, rows=96, seed=0):
    """float32 [rows, width] of blocks chosen to hit every branch of the port's arithmetic."""
    rng = np.random.default_rng(seed)
    block, width = quant.BLOCK[fmt], WIDTH[fmt]
    x = np.empty((rows, width // block, block), F64)
    for r in range(rows):
        for j in range(width // block):
            kind = rng.integers(8)
            if kind == 0:  # ordinary magnitudes, with exact zeros of both signs
                v = rng.standard_normal(block) * 10.0 ** rng.uniform(-8, 8)
                v[rng.random(block) < 0.15] = 0.0
                v[rng.random(block) < 0.1] = -0.0
            elif kind == 1:  # all-zero block, signs mixed
                v = np.where(rng.random(block) < 0.5, -0.0, 0.0)
            elif kind == 2:  # huge (float32's largest, which may dequantise to inf, is in `scale_edges`)
                v = rng.uniform(-1, 1, block) * 10.0 ** rng.uniform(28, 38)
            elif kind == 3:  # tiny, down to float32 subnormals
                v = rng.uniform(-1, 1, block) * 10.0 ** rng.uniform(-45, -34)
            elif kind == 4:  # a few large outliers among small values
                v = rng.standard_normal(block) * 1e-3
                v[rng.integers(block, size=2)] = rng.standard_normal(2) * 1e3
            else:  # a block max that fixes the scale exactly and elements on rounding midpoints
                v = midpoint_block(fmt, block, rng)
            x[r, j] = v
    return F32(x).reshape(rows, width)


def midpoint_block(fmt, block, rng):
    """One block whose scale is 2^j (or an E4M3 number) exactly and whose other elements are ties."""
    sign = np.where(rng.random(block) < 0.5, -1.0, 1.0)
    if fmt in (quant.FP8_UE8M0_32, quant.FP8_UE8M0_64):
        # 448·2^j · float32(1/448) rounds to 2^j (checked against the reference below).
        s = 2.0 ** rng.integers(-20, 100)
        v = sign * rng.choice(e4m3_midpoints(), block) * s
        v[0] = E4M3_MAX * s
        return v
    if fmt == quant.FP8_E4M3_16:  # an E4M3 scale s: 448·s / 448 = s exactly
        s = rng.choice(np.arange(8, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F64))
        v = sign * rng.choice(e4m3_midpoints(), block) * s
        v[0] = E4M3_MAX * s
        return v
    if fmt == quant.FP4_E4M3_16:
        s = rng.choice(np.arange(8, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F64))
    else:
        s = 2.0 ** rng.integers(-120, 120)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    v = sign * rng.choice(np.concatenate([mids, E2M1_GRID]), block) * s
    v[0] = 6.0 * s
    return v


def scale_edges(fmt):
    """Block maxima at and next to the points where the scale changes, one block each."""
    block = quant.BLOCK[fmt]
    if fmt == quant.FP4_E4M3_16:  # the floor 6·2^-9, saturation at 6·448 and the tie 6·464, E4M3 ties
        points = [6 * 2.0**-9, 6 * 448.0, 6 * 464.0, 6 * 480.0, 3e38] + list(6 * e4m3_midpoints()[8:40])
    elif fmt == quant.FP8_E4M3_16:  # the floor 448·2^-9, saturation at 448·448, E4M3 ties of the scale
        points = [448 * 2.0**-9, 448 * 448.0, 448 * 464.0, 448 * 480.0, 3e38] + list(448 * e4m3_midpoints()[8:40])
    elif fmt == quant.MXFP4:  # the floor 6·2^-126 and powers of two times 6
        points = [6 * 2.0**-126, 2.0**-126, float(np.finfo(F32).max)] + [6 * 2.0**j for j in range(-124, 126, 7)]
    else:  # the floor 1e-4 and powers of two times 448
        points = [1e-4, 448 * 1e-4, float(np.finfo(F32).max)] + [448 * 2.0**j for j in range(-30, 120, 7)]
    amax = F32(points)
    with np.errstate(over="ignore"):
        amax = np.concatenate([amax, np.nextafter(amax, F32(0)), np.nextafter(amax, F32(np.inf))])
    amax = amax[np.isfinite(amax)]  # finite inputs only: the port's scales of inf and NaN are not a format
    x = np.outer(amax, np.linspace(-1, 1, block)).astype(F32)
    x[:, -1] = amax
    per_row = WIDTH[fmt] // block
    return np.resize(x, (-(-len(x) // per_row) * per_row, block)).reshape(-1, WIDTH[fmt])


def all_inputs(fmt):
    return np.concatenate([hard_inputs(fmt), scale_edges(fmt)])


def bits(a):
    """The bit pattern of a float32 array (so -0.0 != 0.0 and NaN == NaN)."""
    return np.asarray(a, F32).view(np.uint32)


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("fmt", FORMATS)
def test_bit_exact_against_the_port_reference(fmt):
    x = all_inputs(fmt)
    want_codes, want_scales, want = REFERENCE[fmt](x)
    values, scales = QUANTIZE[fmt](jnp.asarray(x))
    got = DEQUANTIZE[fmt](values, scales)
    np.testing.assert_array_equal(np.asarray(values).view(np.uint8), want_codes)
    np.testing.assert_array_equal(np.asarray(quant.to_bytes(scales)), want_scales)
    np.testing.assert_array_equal(bits(got), bits(want))
    np.testing.assert_array_equal(bits(FAKE_QUANT(jnp.asarray(x), fmt)), bits(want))


def test_eager_division_is_exact_too():
    """Outside jit every primitive is compiled alone; the E4M3-scale quotients must still be IEEE ones."""
    x = scale_edges(quant.FP4_E4M3_16)
    np.testing.assert_array_equal(bits(quant.fake_quant(jnp.asarray(x), quant.FP4_E4M3_16)),
                                  bits(ref_fp4_e4m3_16(x)[2]))


def test_the_inputs_reach_the_edges():
    """The cases the exactness test relies on are really in its inputs."""
    x = all_inputs(quant.FP4_E4M3_16)
    _, scale_bytes, _ = ref_fp4_e4m3_16(x)
    assert (scale_bytes == 0x7E).any() and (scale_bytes == 0x01).any()  # saturated 448, floor 2^-9
    code, _, _ = ref_fp4_e4m3_16(np.array([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, 6] + [0] * 7], F32))
    np.testing.assert_array_equal(code[0, :9], [0, 2, 2, 4, 4, 6, 6, 8, 7])  # RNE ties, signed zero
    x = all_inputs(quant.MXFP4)
    _, scale_bytes, deq = ref_mxfp4(x)
    assert (scale_bytes == 1).any() and (scale_bytes == 126 + 127).any()  # 2^-126 floor, 2^126
    assert (np.abs(deq) == F32(2.0**-127)).any()  # a subnormal output survives
    assert ((x != 0) & (np.abs(x) < 2.0**-126) & (deq != 0)).any()  # a subnormal input is not read as 0
    _, scale_bytes, _ = ref_fp8(all_inputs(quant.FP8_UE8M0_32))
    k = ceil_log2(F32(np.float64(448.0) * F64(F32(1 / 448))))
    assert k == 0  # the FP8 midpoint blocks do sit on scale 2^j
    assert (scale_bytes == 127 + ceil_log2(F32(F64(F32(1e-4)) * F64(F32(1 / 448))))).any()  # the 1e-4 floor


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantised_values_lie_on_the_grid(fmt):
    x = hard_inputs(fmt, rows=32, seed=1)
    values, scales = QUANTIZE[fmt](jnp.asarray(x))
    y = np.asarray(DEQUANTIZE[fmt](values, scales), F64)
    s = np.repeat(np.asarray(scales).astype(F64), quant.BLOCK[fmt], axis=-1)
    if fmt in (quant.FP4_E4M3_16, quant.FP8_E4M3_16):
        assert (np.asarray(scales).astype(ml_dtypes.float8_e4m3fn).astype(F64) == s[:, ::16]).all()
    else:
        assert (np.frexp(s)[0] == 0.5).all()  # exact powers of two
    fp8 = fmt in (quant.FP8_UE8M0_32, quant.FP8_E4M3_16, quant.FP8_UE8M0_64)
    element = ml_dtypes.float8_e4m3fn if fp8 else ml_dtypes.float4_e2m1fn
    ratio = y / s
    np.testing.assert_array_equal(ratio.astype(element).astype(F64), ratio)
    if element is ml_dtypes.float4_e2m1fn:
        assert set(np.unique(np.abs(ratio))) <= set(E2M1_GRID)


def test_pack_nibble_order():
    values = jnp.array([1.0, -6.0, 0.5, 3.0], jnp.float32).astype(jnp.float4_e2m1fn)
    packed = np.asarray(PACK(values))
    assert packed.dtype == np.uint8
    assert packed.tolist() == [0xF2, 0x51]  # element 0 = 0b0010 low, element 1 = 0b1111 high
    np.testing.assert_array_equal(np.asarray(UNPACK(jnp.asarray(packed))).astype(F32), [1, -6, 0.5, 3])


def test_pack_unpack_round_trip():
    every_byte = jnp.arange(256, dtype=jnp.uint8).reshape(4, 64)
    np.testing.assert_array_equal(np.asarray(PACK(UNPACK(every_byte))), np.asarray(every_byte))
    values, _ = QUANTIZE[quant.MXFP4](jnp.asarray(all_inputs(quant.MXFP4)))
    codes = np.asarray(values).view(np.uint8)
    np.testing.assert_array_equal(np.asarray(PACK(values)), codes[:, 0::2] | (codes[:, 1::2] << 4))
    np.testing.assert_array_equal(np.asarray(UNPACK(PACK(values))).view(np.uint8), codes)


def test_scale_bytes_round_trip():
    scales = jnp.arange(256, dtype=jnp.uint8)
    for dtype in (jnp.float8_e4m3fn, jnp.float8_e8m0fnu):
        np.testing.assert_array_equal(np.asarray(quant.to_bytes(quant.from_bytes(scales, dtype))), np.asarray(scales))
    _, s = QUANTIZE[quant.MXFP4](jnp.full((1, 128), 3.0, jnp.float32))  # 3·f32(1/6) = 0.5 -> 2^-1 -> byte 126
    assert np.asarray(quant.to_bytes(s)).tolist() == [[126] * 4]


def test_byte_counts_match_the_accounting():
    def stored_bytes(*arrays):
        return sum(a.size * a.dtype.itemsize for a in arrays)

    vector = jax.ShapeDtypeStruct((512,), jnp.float32)
    values, scales = jax.eval_shape(quant.quantize_fp4_e4m3_16, vector)
    main = stored_bytes(jax.eval_shape(quant.pack_fp4, values), jax.eval_shape(quant.to_bytes, scales))
    values, scales = jax.eval_shape(quant.quantize_mxfp4, vector.update(shape=(128,)))
    index = stored_bytes(jax.eval_shape(quant.pack_fp4, values), jax.eval_shape(quant.to_bytes, scales))
    values, scales = jax.eval_shape(quant.quantize_fp8_ue8m0_32, vector)
    window = stored_bytes(jax.eval_shape(quant.to_bytes, values), jax.eval_shape(quant.to_bytes, scales))
    values, scales = jax.eval_shape(quant.quantize_fp8_e4m3_16, vector)
    main_fp8 = stored_bytes(jax.eval_shape(quant.to_bytes, values), jax.eval_shape(quant.to_bytes, scales))
    assert main_fp8 == 512 + 32 == formats.make_part("main", 512, "fp8", "e4m3_per_16_channel").bytes
    assert (main, index, window) == (256 + 32, 64 + 4, 512 + 16)
    assert (main, index, window) == (
        formats.make_part("main", 512, "fp4_e2m1", "e4m3_per_16_channel").bytes,
        formats.make_part("index", 128, "fp4_e2m1", "ue8m0_per_32_channel").bytes,
        formats.make_part("window", 512, "fp8_e4m3", "ue8m0_per_32_channel").bytes,
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_straight_through_gradient(fmt):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((3, 2, WIDTH[fmt])), jnp.float32)
    w = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(quant.fake_quant(x, fmt) * w)))(x)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(w))
    _, tangent = jax.jit(lambda x, w: jax.jvp(lambda x: quant.fake_quant(x, fmt), (x,), (w,)))(x, w)
    np.testing.assert_array_equal(np.asarray(tangent), np.asarray(w))


@pytest.mark.parametrize("fmt", FORMATS)
def test_fake_quant_keeps_bf16(fmt):
    x = hard_inputs(fmt, rows=8, seed=4).astype(ml_dtypes.bfloat16)
    got = FAKE_QUANT(jnp.asarray(x), fmt)
    assert got.dtype == jnp.bfloat16
    want = REFERENCE[fmt](x.astype(F32))[2].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want.view(np.uint16))
    grad = jax.jit(jax.grad(lambda x: jnp.sum(quant.fake_quant(x, fmt).astype(jnp.float32))))(jnp.asarray(x))
    assert grad.dtype == jnp.bfloat16 and (np.asarray(grad) == 1).all()


def test_errors_name_the_value():
    with pytest.raises(ValueError, match=r"x.shape\[-1\]=24: expected a multiple of the quantisation block 16"):
        quant.quantize_fp4_e4m3_16(jnp.zeros((2, 24)))
    with pytest.raises(ValueError, match="fmt='nvfp4'"):
        quant.fake_quant(jnp.zeros(32), "nvfp4")
    with pytest.raises(ValueError, match=r"scales.shape=\(3,\): expected \(2,\)"):
        quant.dequantize_mxfp4(jnp.zeros(64, jnp.float4_e2m1fn), jnp.ones(3, jnp.float8_e8m0fnu))


def test_torch_cast_saturates():
    """The premise of `torch_e4m3`: the port's torch (2.13 CPU) saturates float32 -> e4m3fn."""
    torch = pytest.importorskip("torch")
    t = torch.tensor([448.0, 464.0, 470.0, 2688.0, 1e30, float("inf"), -1e30, 2.0**-10, 3 * 2.0**-11])
    got = t.to(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(got, [448, 448, 448, 448, 448, 448, -448, 0, 2.0**-9])


def sylvester(n):
    """The n × n Hadamard matrix of Sylvester's construction in float64: H_1 = [1], H_2m = [[H, H], [H, -H]]."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


@pytest.mark.parametrize("n", [2, 32, 128])
def test_hadamard_is_sylvesters_matrix_normalised(n):
    """V4's indexer rotation (`rotate_activation`: the Walsh–Hadamard transform scaled by n^-½) against the
    float64 matrix product, to float32 rounding, and orthonormal: dot products survive it."""
    x = np.random.default_rng(n).standard_normal((3, 5, n)).astype(F32)
    want = x.astype(F64) @ sylvester(n).T / np.sqrt(n)
    got = np.asarray(jax.jit(quant.hadamard)(x), F64)
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-7 * np.abs(want).max() * np.log2(n))
    np.testing.assert_allclose(got[0] @ got[1].T, x[0].astype(F64) @ x[1].T.astype(F64), atol=1e-4 * n)
    with pytest.raises(ValueError, match="power of two"):
        quant.hadamard(np.zeros((2, 48), F32))
