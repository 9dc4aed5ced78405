"""The training forward through the Pallas kernels (issue 22): with `quant: qat` the whole-sequence forward's
values are the cache's formats, so `runtime.kernels` runs its Full layers' selection through the prefill
indexer kernels and its attention through the chunk kernel (forward; the gradients are the reference's), as the
cached steps do. Here the kernels run in interpret mode (their TPU body on this CPU) against the XLA path:
`scripts/compile_train.py --set runtime.kernels=pallas` compiles them into the TPU train step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41
from dsv41 import kv_store, quant, train, xla_options
from conftest import kernels_mode
from trees import global_rel

# 16 indexer heads (the project's rule for comparing selections: with 4, ReLU scores tie at 0).
OVERRIDES = ["quant=qat", "runtime.query_block=32", "csa2.indexer.query_heads=16"]
# Compiled on a GPU the chunk kernel is Triton's, whose dots need 16 heads or more (else the reference runs).
NATIVE = kernels_mode() == "pallas"
if NATIVE:
    OVERRIDES.append("architecture.num_heads=16")


@pytest.mark.parametrize("fmt", [quant.FP8_UE8M0_32, quant.FP4_E4M3_16, quant.MXFP4])
def test_the_kernels_read_the_forwards_fake_quantised_values(fmt):
    """What the kernel path packs dequantises to what the XLA path computes with, bit for bit. The window keys
    (FP8, UE8M0 scales) and indexer keys (MXFP4) are packed from the fake-quantised values: with power-of-two
    scales packing them again is exact. The entries (FP4, E4M3 scales) are packed from the values before: an
    E4M3 scale in its subnormal range can come out smaller when fake-quantised values are packed again."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 128)) * np.exp2(rng.integers(-12, 12, (64, 1)))
    x[3, :32] = 0.0  # an all-zero block
    x[5, 7] = 6.0 * 2.0 ** 3  # a block whose largest value sits on the grid's top
    x = jnp.asarray(x, jnp.float32)
    fq = quant.fake_quant(x, fmt)
    if fmt == quant.FP8_UE8M0_32:
        vals, scales = quant.quantize_fp8_ue8m0_32(fq)
        back = kv_store.dequant_window(quant.to_bytes(vals), quant.to_bytes(scales))
    elif fmt == quant.FP4_E4M3_16:
        back = kv_store.dequant_entries(*kv_store.quant_entries(x, fmt))
    else:
        back = kv_store.dequant_keys(*kv_store.quant_keys(fq))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(fq))


@pytest.mark.slow
def test_a_training_step_through_the_kernels_equals_the_xla_path():
    """configs/passkey.json with qat, 100 tokens in blocks of 32 (the last padded): the sparse stage's loss and
    gradients through the kernels (interpret mode) equal the XLA path's — loss to 1e-6, gradients to 1e-5 of
    their norm (the kernels sum in another order: ~1e-6) — and the traced step holds the selection and
    attention kernels."""
    ref, kern = (dsv41.load_config("passkey", overrides=[*OVERRIDES, f"runtime.kernels={k}"])
                 for k in ("reference", kernels_mode()))
    variables = dsv41.init_params(ref, jax.random.key(0))
    tok = np.asarray(jax.random.randint(jax.random.key(1), (2, 101), 0, ref.architecture.vocab_size))
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:], "loss_mask": np.ones((2, 100), np.float32)}
    tc = train.TrainConfig(kl_over="selected", remat="block")

    # The Pallas calls are in the train step the CLI runs.
    jaxpr = str(train.make_train_step(kern, tc).jitted.trace(train.abstract_state(kern, tc), batch).jaxpr)
    assert "name=sparse_attention" in jaxpr and "name=indexer_scores" in jaxpr
    want, want_g = train.loss_and_grads(ref, tc, variables, batch)
    got, got_g = train.loss_and_grads(kern, tc, variables, batch)
    assert float(want["kl"]) > 1e-3
    rel = {k: abs(float(got[k]) - float(want[k])) / abs(float(want[k])) for k in ("loss", "ce", "kl")}
    assert rel["loss"] <= 1e-6 and rel["ce"] <= 1e-6, rel
    assert global_rel(want_g, got_g) <= 1e-5
    if rel["kl"] > 1e-6 and not xla_options.dots_round_rows_alike():
        # 2.0e-6 on an AVX2 AMD EPYC, whose GEMM rounds a dot's last rows by the row count; 3.3e-7 there at 96
        # tokens in blocks of 24, whose row counts are multiples of 6 — which points at those rows, not proven
        # (docs/batch_invariance.md).
        pytest.xfail(f"kl within {rel['kl']:.1e} of the XLA path's, not 1e-6, on a GEMM that rounds by the row count")
    assert rel["kl"] <= 1e-6, rel
