"""Conversion from transformers-style checkpoints: bad input is listed, never silently dropped."""

import json

import numpy as np
import pytest

from dsv41 import transformers_io
from dsv41.errors import ConfigError
from conftest import DATA


@pytest.fixture(scope="module")
def port():
    d = np.load(DATA / "v41_port_caseA.npz", allow_pickle=False)
    config = json.loads(str(d["config_json"][0]))
    return config, {n: d[n] for n in d["param_names"]}


def test_unknown_missing_and_misshaped_tensors_are_all_listed(port):
    config, sd = port
    cfg = transformers_io.config_from_transformers(config)
    bad = dict(sd)
    bad["model.layers.3.attn.compressor.wkv.weight"] = np.zeros((64, 64), np.float32)  # Reuse layer: no compressor
    bad["model.layers.0.attn.made_up.weight"] = np.zeros((2,), np.float32)
    del bad["model.layers.5.ffn.experts.7.w2.weight"]
    del bad["model.layers.2.attn.indexer.k_norm.weight"]
    bad["model.layers.4.attn.wq_a.weight"] = np.zeros((31, 64), np.float32)
    with pytest.raises(transformers_io.CheckpointError) as e:
        transformers_io.params_from_transformers(bad, cfg)
    msg = str(e.value)
    for fragment in ("model.layers.3.attn.compressor.wkv.weight", "model.layers.0.attn.made_up.weight",
                     "layers.2.attn.indexer.k_norm.weight", "layers.5.ffn.w2: experts [7] missing",
                     "layers.4.attn.wq_a.w: got (64, 31), expected (64, 32)"):
        assert fragment in msg, msg


def test_out_of_scope_tensors_are_skipped_by_name(port):
    config, sd = port
    cfg = transformers_io.config_from_transformers(config)
    extra = dict(sd)
    extra["model.layers.0.ffn.gate.bias_vl"] = np.zeros((8,), np.float32)  # vision routing (out of scope)
    extra["mtp.0.attn.wq_a.weight"] = np.zeros((4, 4), np.float32)  # DSpark drafter
    extra["vision.patch_embed.weight"] = np.zeros((4, 4), np.float32)
    transformers_io.params_from_transformers(extra, cfg)


@pytest.mark.parametrize("field,value,fragment", [
    ("num_key_value_heads", 8, "one shared KV latent"),
    ("scoring_func", "softmax", "sqrt-softplus"),
    ("compress_ratios", [0, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1], "window-only (ratio 0) layers only at 0 and 1"),
    ("model_type", "llama", "deepseek_v41_text"),
])
def test_unsupported_configs_name_the_field(port, field, value, fragment):
    config = dict(port[0], **{field: value})
    with pytest.raises(ConfigError) as e:
        transformers_io.config_from_transformers(config)
    assert f"'{field}'" in str(e.value) and fragment in str(e.value)
