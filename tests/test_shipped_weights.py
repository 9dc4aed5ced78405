"""Weights held as the release ships them (issue 55, `dsv41.nn.weights`): FP8 E4M3 with UE8M0 32×32 block
scales, MXFP4 routed experts, FP8 Engram rows, dequantised inside the program.

Independent references: the same model with those weights dequantised to float32 (KV `quant: none`, so the two
paths compare exactly), the formats' bytes written out here from the release's layout, and ml_dtypes' grids.
"""

import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from dsv41 import cache as cache_lib
from dsv41 import config as config_lib
from dsv41 import convert, model, steps
from dsv41.config import load_config
from dsv41.errors import ConfigError
from dsv41.nn import weights

SHIPPED = ['runtime.weight_format="shipped"', 'quant="none"']
PLAIN = ['runtime.weight_format="f32"', 'quant="none"']
ENGRAM = ('architecture.engram={"layers": [1], "max_ngram": 3, "heads_per_ngram": 2, "row_dim": 32, '
          '"compressed_vocab_size": 256, "prime_floor": 50, "pad_id": 2}')

# The release's formats by dsv41 parameter path (per layer or stacked), written out from its file layout.
FP8 = re.compile(r"attn\.(wq_a\.w|wq_b\.w|wkv\.w|wo_a|wo_b\.w|indexer\.wq_b\.w)$|ffn\.shared\.w[123]\.w$"
                 r"|engram\.\d+\.wkv\.w$")
MXFP4 = re.compile(r"ffn\.w[123]$")
ROWS = re.compile(r"engram\.\d+\.table$")


def dotted(path) -> str:
    return ".".join(map(str, path))


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def pair(name: str, extra=(), weights_from=None):
    """(shipped cfg, shipped params, plain cfg, the same weights dequantised to float32)."""
    cfg = load_config(name, [*SHIPPED, *extra])
    plain_cfg = load_config(name, [*PLAIN, *extra])
    if weights_from is None:
        params = model.init_params(cfg, jax.random.key(3))
    else:  # trained plain weights, quantised to the shipped formats
        params = weights.quantized(convert.load_params(weights_from, plain_cfg), model.abstract_params(cfg))
    return cfg, params, plain_cfg, weights.widened(params)


@pytest.mark.parametrize("name,extra", [("tiny", (ENGRAM,)), ("small", ()), ("passkey", ())])
def test_shipped_weights_equal_their_float32_dequantisation_in_every_step(name, extra):
    """Forward, prefill in two chunks and decode: the shipped model and the same weights dequantised to
    float32, within 1e-5 of the largest logit (measured: 0 on this CPU)."""
    weights_from = config_lib.shipped_weights("passkey") if name == "passkey" else None
    cfg, params, plain_cfg, plain = pair(name, extra, weights_from)
    held = {jnp.dtype(x.dtype) for x in jax.tree.leaves(params)}
    assert {jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e8m0fnu), jnp.dtype(jnp.uint8)} <= held
    vocab = cfg.architecture.vocab_size
    tokens = np.random.default_rng(0).integers(0, min(vocab, 256), (2, 36))
    assert rel(model.forward(params, cfg, tokens), model.forward(plain, plain_cfg, tokens)) <= 1e-5
    errors = []
    runs = [steps.bind(params, cfg), steps.bind(plain, plain_cfg)]
    caches = [cache_lib.init_cache(c, 2, 64) for c in (cfg, plain_cfg)]
    for chunk in (tokens[:, :16], tokens[:, 16:32]):  # two chunks of one shape: one program each
        out = [run.prefill(c, chunk) for run, c in zip(runs, caches)]
        caches = [c for _, c in out]
        errors.append(rel(out[0][0], out[1][0]))
    for t in range(32, 36):
        out = [run.decode(c, tokens[:, t]) for run, c in zip(runs, caches)]
        caches = [c for _, c in out]
        errors.append(rel(out[0][0], out[1][0]))
    assert max(errors) <= 1e-5, errors


def test_device_bytes_of_shipped_parameters_equal_the_formats_formula():
    """tiny with an Engram layer, bf16 elsewhere: the bytes on device of every parameter equal, per weight the
    release quantises, E4M3 R·C + UE8M0 ⌈R/32⌉·⌈C/32⌉ (FP8 blocks), E2M1 R·C/2 + UE8M0 R/32·C (MXFP4 experts,
    R the inputs), E4M3 R·C + UE8M0 R·C/32 (Engram rows), and the other parameters as the bf16 model holds them;
    so are the parameters of the decode step `verify --full-size-contexts` lowers as shipped."""
    bf16 = ['runtime.param_dtype="bfloat16"', ENGRAM]
    cfg = load_config("tiny", ['runtime.weight_format="shipped"', *bf16])
    params = model.init_params(cfg, jax.random.key(0))
    got = sum(x.nbytes for x in jax.tree.leaves(params))
    want, kinds = 0, {"fp8": 0, "mxfp4": 0, "rows": 0}
    for path, var in nnx.to_flat_state(model.abstract_params(load_config("tiny", bf16))):
        x, name = var.get_value(), dotted(path)
        *lead, r, c = x.shape if x.ndim >= 2 else (1, 1, 1)
        n = math.prod(lead)
        if FP8.search(name):
            want += n * (r * c + math.ceil(r / 32) * math.ceil(c / 32))
            kinds["fp8"] += 1
        elif MXFP4.search(name):
            want += n * (r * c // 2 + r // 32 * c)
            kinds["mxfp4"] += 1
        elif ROWS.search(name):
            want += n * (r * c + r * c // 32)
            kinds["rows"] += 1
        else:
            want += x.size * jnp.dtype(x.dtype).itemsize
    assert all(kinds.values()), kinds
    assert got == want, (got, want)
    # `verify --full-size-contexts` lowers the decode step with the weights as held: the same bytes go in
    from dsv41 import verify
    held = verify.full_size_flops([64], config="tiny", overrides=bf16)[0]["held"]
    assert held["param_bytes"] == want, (held, want)


def test_the_formats_decode_as_ml_dtypes_grids_say():
    """Every E4M3 code and every E2M1 code with UE8M0 scales, decoded by `weights.dequantize`, against ml_dtypes'
    float64 values times 2^(s − 127) (edge FP8 blocks of a 40 × 70 matrix; MXFP4 pairs low nibble first)."""
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 256, (40, 70), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # the E4M3 NaN codes
    s = rng.integers(100, 150, (2, 3), dtype=np.uint8)
    e4m3 = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    scale = np.ldexp(1.0, np.repeat(np.repeat(s.astype(int) - 127, 32, 0), 32, 1)[:40, :70])
    got = weights.dequantize("fp8", jnp.asarray(codes.view(ml_dtypes.float8_e4m3fn)),
                             jnp.asarray(s.view(ml_dtypes.float8_e8m0fnu)))
    np.testing.assert_array_equal(np.asarray(got), (e4m3 * scale).astype(np.float32))
    packed = rng.integers(0, 256, (3, 32, 5), dtype=np.uint8)           # [E, R/2, C]: R = 64 inputs
    s4 = rng.integers(100, 150, (3, 2, 5), dtype=np.uint8)
    grid = np.arange(16, dtype=np.uint8).view(np.uint8)
    e2m1 = np.array([float(ml_dtypes.float4_e2m1fn(v)) for v in
                     [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]])[grid]
    rows = np.stack([e2m1[packed & 0xF], e2m1[packed >> 4]], axis=2).reshape(3, 64, 5)
    want = rows * np.ldexp(1.0, np.repeat(s4.astype(int) - 127, 32, axis=1))
    got = weights.dequantize("mxfp4", jnp.asarray(packed), jnp.asarray(s4.view(ml_dtypes.float8_e8m0fnu)))
    np.testing.assert_array_equal(np.asarray(got), want.astype(np.float32))


def test_shipped_values_quantise_to_themselves():
    """A shipped weight's values, quantised again, are the same values (a smaller block maximum may take a smaller
    scale and doubled codes: the same numbers), for each kind; and a quantised weight is within half a step."""
    w = jax.random.normal(jax.random.key(0), (2, 64, 96)) * 0.02
    for kind in weights.KINDS:
        once = weights.dequantize(kind, *weights.quantize(kind, w))
        twice = weights.dequantize(kind, *weights.quantize(kind, once))
        np.testing.assert_array_equal(np.asarray(once), np.asarray(twice), err_msg=kind)
        # the relative step of E4M3 is 2^-3 (half: 1/16), of E2M1 up to 1/2 of the block scale's grid
        err = np.abs(np.asarray(once) - np.asarray(w)).max() / np.abs(np.asarray(w)).max()
        assert err <= (0.0625 if kind != "mxfp4" else 0.25), (kind, err)


@pytest.mark.parametrize("edit,fragment", [
    ("scale_shape", "weight scales: shape (2, 2): expected (2, 3) for fp8 values of shape (64, 96)"),
    ("value_dtype", "weight values: dtype float32: expected float8_e4m3fn for fp8 weights"),
    ("scale_dtype", "weight scales: dtype uint8: expected float8_e8m0fnu for fp8 weights"),
    ("mxfp4_width", "'moe.w1 input width' = 48: expected a multiple of 32 for MXFP4 weights"),
])
def test_bad_held_weights_are_refused_by_name(edit, fragment):
    values, scales = weights.quantize("fp8", jnp.ones((64, 96)))
    with pytest.raises((ValueError, ConfigError)) as e:
        if edit == "scale_shape":
            weights.dequantize("fp8", values, scales[:, :2])
        elif edit == "value_dtype":
            weights.dequantize("fp8", values.astype(jnp.float32), scales)
        elif edit == "scale_dtype":
            weights.dequantize("fp8", values, jax.lax.bitcast_convert_type(scales, jnp.uint8))
        else:
            weights.check_shape("mxfp4", (8, 48, 32), "moe.w1")
    assert fragment in str(e.value), str(e.value)


def test_weight_format_config_errors_name_the_field():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ['runtime.weight_format="fp8"'])
    assert "runtime.weight_format" in str(e.value) and "'fp8'" in str(e.value) and "shipped" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ['runtime.weight_format="bf16"'])  # param_dtype float32
    assert "runtime.param_dtype 'float32'" in str(e.value), str(e.value)
    assert config_lib.weight_format_overrides("bf16") == ['runtime.weight_format="bf16"',
                                                           'runtime.param_dtype="bfloat16"']


def test_training_refuses_the_shipped_format_and_loads_a_shipped_file_dequantised(tmp_path):
    """Training's master weights are plain: a shipped config is refused by name; a shipped file loads into the
    plain config dequantised, equal to `weights.widened`."""
    from dsv41 import train
    cfg = load_config("tiny", SHIPPED)
    with pytest.raises(ConfigError) as e:
        train.init_state(cfg, train.TrainConfig(), jax.random.key(0))
    assert "runtime.weight_format" in str(e.value) and "'f32' or 'bf16' for training" in str(e.value)
    params = model.init_params(cfg, jax.random.key(1))
    convert.save_params(params, cfg, tmp_path / "shipped.safetensors")
    plain = convert.load_params(tmp_path / "shipped.safetensors", load_config("tiny", PLAIN))
    want = dict(nnx.to_flat_state(weights.widened(params)))
    for path, var in nnx.to_flat_state(plain):
        np.testing.assert_array_equal(np.asarray(var.get_value()), np.asarray(want[path].get_value()), err_msg=str(path))
