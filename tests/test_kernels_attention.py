"""The sparse attention kernel (interpret mode) against its reference (dequantise + attend_step).

Tolerances: float32 q, |kernel - reference| <= 1e-5 (rtol and atol; measured ~1.5e-6 on outputs of size ~8:
the kernel sums tiles in another order); bfloat16 q, 3e-2 (the unnormalised probabilities are rounded to
bfloat16 before the value matmul, the reference rounds the normalised ones).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41.kernels import dispatch
from dsv41.kernels import quant_pack as qp
from dsv41.kernels import sparse_attention as sa

B, H, K, W, N, TOP_K = 3, 4, 64, 40, 50, 13   # W, TOP_K not multiples of the 64-key tile


def _jit(f, *static):
    """Jitted: eager dispatch of the references' many small ops dominates these tiny tests otherwise."""
    return jax.jit(f, static_argnums=static)


def _store(rng, rows, fmt):
    return _jit(qp.quantize_pack_reference, 1)(jnp.asarray(rng.standard_normal((B, rows, K)) * 2, jnp.float32), fmt)


def _decode_case(rng):
    # Row 0 has wrapped around the ring twice, row 1 is shorter than the window, row 2 sees nothing
    # (empty ring, every pick -1): its output must be exactly 0.
    lengths = jnp.asarray([2 * W + 7, 9, 0], jnp.int32)
    window_ok = sa.ring_valid(lengths, jnp.asarray([W + 20, 0, 0], jnp.int32), W)
    picks = rng.integers(-1, N, (B, TOP_K)).astype(np.int32)
    picks[2] = -1
    return window_ok, jnp.asarray(picks)


def test_ring_valid_follows_the_ring_positions():
    lengths, start = np.array([2 * W + 7, 9, 0]), np.array([W + 20, 0, 0])
    want = np.zeros((B, W), bool)
    for b in range(B):
        for p in range(max(0, lengths[b] - W), lengths[b]):   # slot p % W holds position p
            want[b, p % W] = p >= start[b]
    np.testing.assert_array_equal(np.asarray(sa.ring_valid(jnp.asarray(lengths), jnp.asarray(start), W)), want)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_decode_matches_reference(dtype, tol):
    rng = np.random.default_rng(0)
    window_ok, picks = _decode_case(rng)
    args = (jnp.asarray(rng.standard_normal((B, H, K)), dtype), *_store(rng, W, qp.quant.FP8_UE8M0_32), window_ok,
            *_store(rng, N, qp.quant.FP4_E4M3_16), picks, jnp.asarray(rng.standard_normal(H), jnp.float32),
            K ** -0.5)
    want = _jit(sa.sparse_decode_attention_reference, 8)(*args)
    got = _jit(lambda *a: sa.sparse_decode_attention(*a, block_keys=64, interpret=True), 8)(*args)
    assert got.shape == (B, H, K) and got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    assert not np.asarray(got[2], np.float32).any()
    assert np.abs(np.asarray(want[:2], np.float32)).max() > 0.1


def _chunk_case(rng, h):
    """A prefill chunk's arguments: S = 3 queries a row, each with its own window mask and picks, over [ring |
    new tokens] keys; row 1's last query sees nothing."""
    s, t = 3, W + 3
    window_ok = jnp.asarray(rng.random((B, s, t)) < 0.6).at[1, 2].set(False)
    picks = jnp.asarray(rng.integers(-1, N, (B, s, TOP_K)), jnp.int32).at[1, 2].set(-1)
    return (jnp.asarray(rng.standard_normal((B, s, h, K)), jnp.float32), *_store(rng, t, qp.quant.FP8_UE8M0_32),
            window_ok, *_store(rng, N, qp.quant.FP4_E4M3_16), picks,
            jnp.asarray(rng.standard_normal(h), jnp.float32), 0.3)


def test_prefill_chunk_matches_reference():
    args = _chunk_case(np.random.default_rng(1), H)
    want = _jit(sa.sparse_attention_reference, 8)(*args)
    got = _jit(lambda *a: dispatch.sparse_attention_chunk(*a, mode="pallas_interpret", block_keys=64), 8)(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert not np.asarray(got[1, 2]).any()


def test_the_gpu_body_matches_reference():
    """The GPU's shape of the kernel (heads in blocks of 16 a program, the key tiles in a fori_loop, 32-key tiles)
    computes the same as the reference: 32 heads (two blocks), a chunk of 3 queries a row."""
    args = _chunk_case(np.random.default_rng(2), 32)
    want = _jit(sa.sparse_attention_reference, 8)(*args)
    got = _jit(lambda *a: sa.sparse_attention(*a, block_keys=sa.default_block_keys("gpu"), interpret=True,
                                              head_block=sa.GPU_HEAD_BLOCK, tile_loop=True), 8)(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert not np.asarray(got[1, 2]).any() and np.abs(np.asarray(want)).max() > 0.1
    with pytest.raises(ValueError, match="head_block=12: expected a positive divisor of the 32 heads"):
        sa.sparse_attention(*args, interpret=True, head_block=12)


def test_dispatch_modes():
    assert dispatch.resolve("auto", "cpu") == "reference"
    assert dispatch.resolve("auto", "tpu") == "pallas" and dispatch.resolve("auto", "gpu") == "pallas"
    # On a GPU `auto` runs only the indexer's kernels (dispatch's module doc): the others failed on an H200.
    for kind, want in [("indexer", "pallas"), ("attention", "reference"), ("quant", "reference")]:
        assert dispatch.resolve("auto", "gpu", kind) == want and dispatch.resolve("auto", "tpu", kind) == "pallas"
        assert dispatch.resolve("pallas", "gpu", kind) == "pallas"
    with pytest.raises(ValueError, match="kind='mlp'"):
        dispatch.resolve("auto", "gpu", "mlp")
    assert dispatch.resolve("pallas_interpret", "cpu") == "pallas_interpret"
    with pytest.raises(ValueError, match=r"runtime.kernels='triton'.*'auto', 'pallas', 'pallas_interpret', 'reference'"):
        dispatch.resolve("triton")
    with pytest.raises(ValueError, match="runtime.kernels='pallas' on backend 'cpu'"):
        dispatch.resolve("pallas", "cpu")


def test_gpu_variant_lowers_for_cuda():
    # Triton lowering runs on this CPU machine (compiling the PTX needs a GPU): every op of the kernel body
    # must have a Triton lowering. Power-of-two tiles, 16 heads (Triton's smallest dot).
    h, k, w, n, top = 16, 64, 32, 64, 32
    spec = jax.ShapeDtypeStruct
    u8 = jnp.uint8
    f = lambda *a: sa.sparse_decode_attention(*a, K ** -0.5, block_keys=32, backend="gpu")  # noqa: E731
    lowered = jax.jit(f).trace(
        spec((2, h, k), jnp.bfloat16), spec((2, w, k), u8), spec((2, w, k // 32), u8), spec((2, w), jnp.bool_),
        spec((2, n, k // 2), u8), spec((2, n, k // 16), u8), spec((2, top), jnp.int32), spec((h,), jnp.float32),
    ).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text().lower()
    # and at V4.1-Flash's widths (64 heads × 512, window 128, 512 picks), a prefill chunk of 4 queries a row,
    # with the GPU's defaults (16 heads a program, 32-key tiles in a loop): an H200 refused all 64 heads at once
    h, k, w, top, s = 64, 512, 128, 512, 4
    f = lambda *a: sa.sparse_attention(*a, k ** -0.5, backend="gpu")  # noqa: E731
    lowered = jax.jit(f).trace(
        spec((2, s, h, k), jnp.bfloat16), spec((2, w + s, k), u8), spec((2, w + s, k // 32), u8),
        spec((2, s, w + s), jnp.bool_), spec((2, 4096, k // 2), u8), spec((2, 4096, k // 16), u8),
        spec((2, s, top), jnp.int32), spec((h,), jnp.float32),
    ).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text().lower()
