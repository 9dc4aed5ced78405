"""The quantise+pack / unpack+dequantise kernels (interpret mode) against dsv41.quant, bit for bit."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41 import quant
from dsv41.kernels import dispatch
from dsv41.kernels import quant_pack as qp


def _inputs(k=64):
    """Rows of random magnitudes over 2^-43..2^17 and the edge cases (195 rows: not a multiple of the tile)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((70, k)).astype(np.float32) * np.exp2(rng.uniform(-43, 17, (70, 1))).astype(np.float32)
    x[0] = 0.0
    x[1, ::2] = -0.0                                   # signed zeros keep their E2M1/E4M3 sign
    x[2] *= np.float32(1e-38)                          # subnormal-scale rows: the scale floors
    x[3] = np.float32(2.0**-130) * np.sign(x[3])       # float32 subnormals
    x[4] = np.float32(6 * 448 * 3)                     # above the largest E4M3 scale: saturates
    x[5] = -np.abs(x[5])
    x[6] = rng.integers(-24, 25, k) * np.float32(0.25)  # exact E2M1 ties
    x[7] = rng.integers(-16, 17, k) * np.float32(6 * 2.0**-9 / 16)  # ties at the scale floor
    # Block maxima 1-2 ulp beside 6 × an E4M3 midpoint: there a·(1/6) and the IEEE a/6 can round to
    # different E4M3 scales (a kernel that multiplies by 1/6 without settling the tie fails here).
    e4m3 = np.arange(1, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    six_mid = 3 * (e4m3[:-1] + e4m3[1:])
    near = np.concatenate([(six_mid.view(np.int32) + d).view(np.float32) for d in (-2, -1, 1, 2)])
    blocks = np.resize(near, (-(-near.size // (k // 16)) * (k // 16), 1))
    rows = (blocks * rng.uniform(-1, 1, (blocks.shape[0], 16)).astype(np.float32))
    rows[:, 0] = blocks[:, 0]
    return jnp.asarray(np.concatenate([x, rows.reshape(-1, k)]))


# The GPU body quantises a tile 128 columns at a time (qp._columns): K = 384 takes three steps.
BODIES = [pytest.param(None, 64, id="whole-rows"), pytest.param("gpu", 384, id="gpu-columns")]


@pytest.mark.parametrize("backend, k", BODIES)
@pytest.mark.parametrize("fmt", qp.FORMATS)
def test_quantize_pack_is_bit_exact(fmt, backend, k):
    x = _inputs(k)
    want_v, want_s = jax.jit(qp.quantize_pack_reference, static_argnums=1)(x, fmt)
    got_v, got_s = qp.quantize_pack(x, fmt, block_rows=32, interpret=True, backend=backend)
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    np.testing.assert_array_equal(np.asarray(got_s), np.asarray(want_s))


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    nan = np.isnan(b)
    np.testing.assert_array_equal(np.isnan(a), nan)
    np.testing.assert_array_equal(a.view(np.uint32)[~nan], b.view(np.uint32)[~nan])


@pytest.mark.parametrize("backend, k", BODIES)
@pytest.mark.parametrize("fmt", qp.FORMATS)
def test_unpack_dequantize_is_bit_exact_on_every_byte(fmt, backend, k):
    # Every value byte and every scale byte (NaN codes, UE8M0 byte 0 = 2^-127 and 255 included), 3-D input.
    kv = k // 2 if fmt != quant.FP8_UE8M0_32 else k
    rng = np.random.default_rng(1)
    values = rng.integers(0, 256, (2, 40, kv), dtype=np.uint8)
    scales = rng.integers(0, 256, (2, 40, k // quant.BLOCK[fmt]), dtype=np.uint8)
    values[0, 0, :] = np.arange(kv) % 256
    scales[0, 1] = np.resize([0, 1, 254, 255], scales.shape[-1])
    scales[0, 2] = np.resize([255, 254, 1, 0], scales.shape[-1])
    want = jax.jit(qp.unpack_dequantize_reference, static_argnums=2)(jnp.asarray(values), jnp.asarray(scales), fmt)
    got = qp.unpack_dequantize(jnp.asarray(values), jnp.asarray(scales), fmt, block_rows=32, interpret=True,
                               backend=backend)
    _same_bits(got, want)


def test_dispatch_reference_and_interpret_agree():
    x = _inputs()[:8]
    ref = dispatch.quantize_pack(x, quant.FP4_E4M3_16, mode="reference")
    ker = dispatch.quantize_pack(x, quant.FP4_E4M3_16, mode="pallas_interpret")
    np.testing.assert_array_equal(np.asarray(ref[0]), np.asarray(ker[0]))
    np.testing.assert_array_equal(np.asarray(ref[1]), np.asarray(ker[1]))
    _same_bits(dispatch.unpack_dequantize(*ref, quant.FP4_E4M3_16, mode="auto"),
               quant.dequantize_fp4_e4m3_16(*quant.quantize_fp4_e4m3_16(x)))


@pytest.mark.parametrize("call, match", [
    (lambda: qp.quantize_pack(jnp.zeros((4, 64)), "fp6"), "fmt='fp6'"),
    (lambda: qp.quantize_pack(jnp.zeros((4, 40)), quant.MXFP4), r"x.shape\[-1\]=40"),
    (lambda: qp.quantize_pack(jnp.zeros((4, 64)), quant.MXFP4, block_rows=48), "block_rows=48"),
    (lambda: qp.unpack_dequantize(jnp.zeros((4, 32), jnp.uint8), jnp.zeros((4, 3), jnp.uint8), quant.MXFP4),
     r"scales.shape=\(4, 3\)"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()
