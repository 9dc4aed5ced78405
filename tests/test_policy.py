"""The dtype policy: bf16 storage and compute keep the fp32-critical parameters and math in fp32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv41
from dsv41 import model

BF16 = ["runtime.param_dtype=bfloat16", "runtime.compute_dtype=bfloat16"]


def test_bf16_parameters_except_the_fp32_critical_ones():
    cfg = dsv41.load_config("tiny", overrides=BF16)
    for path, var in nnx.to_flat_state(model.abstract_params(cfg)):
        name = "/".join(map(str, path))
        fp32 = any(k in name for k in ("hc_attn", "hc_ffn", "attn_sink", "ffn/bias", "q_weight", "k_weight")) \
            or name.endswith("norm/weight")
        assert var.get_value().dtype == (jnp.float32 if fp32 else jnp.bfloat16), name


@pytest.mark.slow
def test_bf16_forward_tracks_fp32():
    """Same weights (rounded to bf16 once) and no hard thresholds to flip (quantisation off, every
    entry and expert selected): the bf16 compute policy stays within bf16 rounding of the fp32 one."""
    smooth = ["quant=none", "csa2.indexer.top_k=128", "csa2.indexer.hierarchical.max_blocks=16",
              "csa2.indexer.hierarchical.candidate_pool_size=128", "architecture.moe.top_k=8"]
    cfg32 = dsv41.load_config("tiny", overrides=smooth)
    cfg16 = dsv41.load_config("tiny", overrides=smooth + BF16)
    p16 = model.init_params(cfg16, jax.random.key(0))
    p32 = jax.tree.map(lambda x: x.astype(jnp.float32), p16)
    tokens = np.random.default_rng(1).integers(0, 256, (1, 64))
    l32 = np.asarray(model.forward(p32, cfg32, tokens))
    l16 = np.asarray(model.forward(p16, cfg16, tokens))
    assert l16.dtype == np.float32
    rel = np.abs(l16 - l32).max() / l32.std()
    assert rel < 0.05, rel
