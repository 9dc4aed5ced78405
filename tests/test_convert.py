"""Checkpoint conversion: official FP8 / MXFP4 files dequantise exactly, bad files are listed, round trips.

The official files are written here from random parameters of the tiny config (plus one Engram layer),
laid out and quantised as the release stores them by code independent of dsv41.convert: the layout from
the naming of the V4.1 release, the quantisers with NumPy / ml_dtypes, and the oracle decodes the written
bytes bit by bit in float64.
"""

import argparse
import json
import re

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from conftest import DATA
from dsv41 import convert, model, stacking, transformers_io
from dsv41.config import load_config
from dsv41.errors import ConfigError
from dsv41.transformers_io import CheckpointError

ENGRAM = {"layers": [1], "max_ngram": 3, "heads_per_ngram": 2, "row_dim": 32, "compressed_vocab_size": 256,
          "prime_floor": 50, "pad_id": 2}

FP8 = re.compile(r"attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|ffn\.shared_experts\.w[123]\.weight$"
                 r"|engram\.wkv\.weight$")
MXFP4 = re.compile(r"ffn\.experts\.\d+\.w[123]\.weight$")
FP8_ROWS = re.compile(r"engram\.embed\.weight$")
BF16 = re.compile(r"^(embed|head)\.weight$|ffn\.gate\.weight$|compressor\.(wkv|wgate)\.weight$"
                  r"|indexer\.(wk|weights_proj)\.weight$")


# ------------------------------------------------------------------------------------------------
# The release's layout of each dsv41 parameter, and the formats


def official_layout(path):
    """dsv41 path -> (official names, kind): kind "id" as is, "T" transposed ([in, out] -> [out, in]),
    "wo_a" ([g, in, o] -> [g·o, in]), "experts" (one [out, in] tensor per expert)."""
    if path == ("embed",):
        return ["embed.weight"], "id"
    if path == ("head", "w"):
        return ["head.weight"], "T"
    if path == ("norm", "weight"):
        return ["norm.weight"], "id"
    layer, rest = f"layers.{path[1]}.", list(path[2:])
    if rest[0] in ("hc_attn", "hc_ffn"):
        return [layer + "_".join(rest)], "id"
    if rest == ["attn", "wo_a"]:
        return [layer + "attn.wo_a.weight"], "wo_a"
    if rest[0] == "ffn" and rest[1] in ("w1", "w2", "w3"):
        return [f"{layer}ffn.experts.{{}}.{rest[1]}.weight"], "experts"
    if rest == ["ffn", "gate"]:
        return [layer + "ffn.gate.weight"], "T"
    if rest == ["ffn", "bias"]:
        return [layer + "ffn.gate.bias"], "id"
    if rest == ["engram", "table"]:
        return [layer + "engram.embed.weight"], "id"
    if rest[:2] == ["ffn", "shared"]:
        rest = ["ffn", "shared_experts", *rest[2:]]
    if rest[-1] == "w":
        return [layer + ".".join(rest[:-1]) + ".weight"], "T"
    return [layer + ".".join(rest)], "id"


def to_official(path, a):
    (name,), kind = official_layout(path)
    if kind == "experts":
        return {name.format(e): np.ascontiguousarray(a[e].T) for e in range(a.shape[0])}
    if kind == "wo_a":
        return {name: np.ascontiguousarray(a.transpose(0, 2, 1).reshape(-1, a.shape[1]))}
    return {name: np.ascontiguousarray(a.T if kind == "T" else a)}


def from_official(path, shape, values):
    (name,), kind = official_layout(path)
    if kind == "experts":
        return np.stack([values[name.format(e)].T for e in range(shape[0])])
    if kind == "wo_a":
        return values[name].reshape(shape[0], -1, shape[1]).transpose(0, 2, 1)
    return values[name].T if kind == "T" else values[name]


def quantize_fp8(w, block):
    """float [R, C] -> (E4M3 [R, C], UE8M0 [⌈R/b0⌉, ⌈C/b1⌉]), scale 2^ceil(log2(amax/448)) per block."""
    (r, c), (b0, b1) = w.shape, block
    n0, n1 = -(-r // b0), -(-c // b1)
    padded = np.zeros((n0 * b0, n1 * b1))
    padded[:r, :c] = np.abs(w)
    amax = padded.reshape(n0, b0, n1, b1).max(axis=(1, 3))
    k = np.clip(np.ceil(np.log2(np.maximum(amax, 2.0**-100) / 448)), -127, 127).astype(np.int64)
    per = np.repeat(np.repeat(2.0**k, b0, 0), b1, 1)[:r, :c]
    return (w / per).astype(ml_dtypes.float8_e4m3fn), (k + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)


def quantize_mxfp4(w):
    """float [R, C] -> (int8 [R, C/2] two E2M1 a byte, even element low; UE8M0 [R, C/32])."""
    r, c = w.shape
    amax = np.abs(w).reshape(r, c // 32, 32).max(axis=-1)
    k = np.ceil(np.log2(np.maximum(amax, 2.0**-100) / 6)).astype(np.int64)
    codes = (w / np.repeat(2.0**k, 32, 1)).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    return packed, (k + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)


def encode(name, w):
    """One float32 tensor [out, in] -> its tensors as the release stores them."""
    scale = name[: -len("weight")] + "scale"
    if FP8.search(name):
        q, s = quantize_fp8(w, (32, 32))
    elif FP8_ROWS.search(name):
        q, s = quantize_fp8(w, (1, 32))
    elif MXFP4.search(name):
        q, s = quantize_mxfp4(w)
    else:
        return {name: w.astype(ml_dtypes.bfloat16 if BF16.search(name) else np.float32)}
    return {name: q, scale: s}


# ------------------------------------------------------------------------------------------------
# The oracle: the written bytes decoded bit by bit in float64


def e4m3_f64(codes):
    b = np.asarray(codes).view(np.uint8).astype(np.int64)
    sign, exponent, mantissa = np.where(b >> 7, -1.0, 1.0), (b >> 3) & 0xF, b & 7
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return sign * np.where((exponent == 15) & (mantissa == 7), np.nan, magnitude)


def e2m1_f64(codes):
    sign, exponent, mantissa = np.where(codes >> 3, -1.0, 1.0), (codes >> 1) & 3, codes & 1
    return sign * np.where(exponent == 0, mantissa * 0.5, 2.0 ** (exponent - 1.0) * (1 + mantissa / 2))


def per_element(scales, block, shape):
    s = 2.0 ** (np.asarray(scales).view(np.uint8).astype(np.float64) - 127)
    return np.kron(s, np.ones(block))[: shape[0], : shape[1]]


def decode(tensors):
    """Official tensors -> float32 values of every weight (scales consumed), via float64."""
    out = {}
    for name, a in tensors.items():
        if name.endswith(".scale"):
            continue
        s = tensors.get(name[: -len("weight")] + "scale")
        if a.dtype == np.int8:
            b = a.view(np.uint8)
            codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[0], -1)
            out[name] = (e2m1_f64(codes) * per_element(s, (1, 32), codes.shape)).astype(np.float32)
        elif a.dtype == ml_dtypes.float8_e4m3fn:
            block = (1, 32) if FP8_ROWS.search(name) else (32, 32)
            out[name] = (e4m3_f64(a) * per_element(s, block, a.shape)).astype(np.float32)
        else:
            out[name] = a.astype(np.float32)
    return out


def flat(params):
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params)}


# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(cfg, official tensors, their directory of two shards + index, the oracle's dsv41 parameters)."""
    cfg = load_config("tiny", [f"architecture.engram={json.dumps(ENGRAM)}"])
    abstract = model.abstract_params(cfg)
    rng = np.random.default_rng(0)
    tensors, shapes = {}, {}
    for path, var in stacking.per_layer(abstract, cfg):  # the official names speak of layers
        shape = shapes[path] = var.get_value().shape
        # Norms near 1, everything else small, as a trained model's; the values only need a sane forward.
        a = 1 + 0.1 * rng.standard_normal(shape) if path[-1] == "weight" else 0.05 * rng.standard_normal(shape)
        for name, w in to_official(path, a.astype(np.float32)).items():
            tensors.update(encode(name, w))
    root = tmp_path_factory.mktemp("official")
    names = sorted(tensors)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(root / file))
    (root / convert.INDEX).write_text(json.dumps({"weight_map": {n: f for f, part in shards.items() for n in part}}))
    values = decode(tensors)
    oracle = stacking.from_per_layer({p: from_official(p, shapes[p], values) for p in shapes}, abstract, cfg)
    return cfg, tensors, root, oracle


def test_dequantisers_match_a_float64_decoding_of_every_code_with_edge_blocks():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 256, (40, 70), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # the E4M3 NaN codes
    values = codes.view(ml_dtypes.float8_e4m3fn)
    for block in ((32, 32), (1, 32)):
        scales = rng.integers(0, 200, convert.scale_shape(values.shape, block), dtype=np.uint8)
        want = (e4m3_f64(values) * per_element(scales, block, values.shape)).astype(np.float32)
        got = convert.dequantize_fp8(values, scales.view(ml_dtypes.float8_e8m0fnu), block)
        np.testing.assert_array_equal(got, want)
    packed = rng.integers(-128, 128, (5, 48), dtype=np.int8)  # 96 inputs: three scales a row
    scales = rng.integers(0, 200, (5, 3), dtype=np.uint8)
    b = packed.view(np.uint8)
    want = e2m1_f64(np.stack([b & 0xF, b >> 4], -1).reshape(5, 96)) * per_element(scales, (1, 32), (5, 96))
    np.testing.assert_array_equal(convert.dequantize_mxfp4(packed, scales), want.astype(np.float32))


@pytest.mark.slow
def test_official_shards_convert_exactly_and_run_forward(case):
    cfg, tensors, root, oracle = case
    seen = []
    params = convert.load_official(root, cfg, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1][0] == seen[-1][1] == len([n for n in tensors if not n.endswith(".scale")])
    want = flat(oracle)
    for path, value in flat(params).items():
        np.testing.assert_array_equal(value, want[path], err_msg=str(path))
    assert {type(v) for _, v in nnx.to_flat_state(params)} == {type(v) for _, v in nnx.to_flat_state(oracle)}
    tokens = np.random.default_rng(2).integers(0, 256, (2, 12))
    logits = np.asarray(model.forward(params, cfg, tokens))
    assert np.isfinite(logits).all()
    np.testing.assert_array_equal(logits, np.asarray(model.forward(oracle, cfg, tokens)))


@pytest.mark.parametrize("edit,fragments", [
    ("missing", ["layers.5.ffn.experts.7.w2.weight", "layers.5.ffn.w2: experts [7] missing of 8",
                 "layers.2.attn.indexer.k_norm.weight", "layers.4.attn.wq_b.scale"]),
    ("unknown", ["layers.0.attn.made_up.weight", "layers.0.attn.made_up.scale",
                 "layers.3.attn.compressor.wkv.weight", "layers.1.ffn.experts.8.w1.weight", "vision_tower.x"]),
    ("misshaped", ["layers.4.attn.wq_a.w: got (64, 31), expected (64, 32)",
                   "layers.6.attn.wkv.scale: got (1, 2), expected (2, 2)",
                   "layers.1.engram.embed.scale: got"]),
])
def test_bad_checkpoints_list_every_offending_name(case, edit, fragments):
    cfg, tensors, _, _ = case
    bad = dict(tensors)
    if edit == "missing":
        del bad["layers.5.ffn.experts.7.w2.weight"]  # its scale stays
        del bad["layers.2.attn.indexer.k_norm.weight"]
        del bad["layers.4.attn.wq_b.scale"]
    elif edit == "unknown":
        made_up = quantize_fp8(np.ones((32, 32)), (32, 32))
        bad["layers.0.attn.made_up.weight"], bad["layers.0.attn.made_up.scale"] = made_up
        bad["layers.3.attn.compressor.wkv.weight"] = np.zeros((64, 64), np.float32)  # a Reuse layer has no compressor
        bad.update({n.replace("experts.0.", "experts.8."): a  # one past the last expert
                    for n, a in tensors.items() if ".1.ffn.experts.0.w1." in n})
        bad["vision_tower.x"] = np.zeros(2, np.float32)
    else:
        bad["layers.4.attn.wq_a.weight"], bad["layers.4.attn.wq_a.scale"] = quantize_fp8(np.ones((31, 64)), (32, 32))
        bad["layers.6.attn.wkv.scale"] = bad["layers.6.attn.wkv.scale"][:1]
        bad["layers.1.engram.embed.scale"] = bad["layers.1.engram.embed.scale"][:-1]
    with pytest.raises(CheckpointError) as e:
        convert.params_from_official(bad, cfg)
    for fragment in fragments:
        assert fragment in str(e.value), str(e.value)


def test_out_of_scope_tensors_are_skipped(case):
    cfg, tensors, _, oracle = case
    extra = dict(tensors, **{"mtp.0.attn.wq_a.weight": np.zeros((4, 4), np.float32),
                             "vision.patch_embed.weight": np.zeros((4, 4), np.float32),
                             "layers.0.ffn.gate.bias_vl": np.zeros((8,), np.float32)})
    params = convert.params_from_official(extra, cfg)
    np.testing.assert_array_equal(flat(params)[("embed",)], flat(oracle)[("embed",)])


def test_saved_params_load_back_exactly(case, tmp_path):
    cfg, _, _, oracle = case
    assert convert.save_params(oracle, cfg, tmp_path / "p.safetensors") == (tmp_path / "p.safetensors").stat().st_size
    want, got = flat(oracle), flat(convert.load_params(tmp_path / "p.safetensors", cfg))
    for path, value in got.items():
        np.testing.assert_array_equal(value, want[path], err_msg=str(path))
    with pytest.raises(CheckpointError) as e:
        convert.load_params(tmp_path / "p.safetensors", load_config("tiny"))  # no Engram layer
    assert "unknown tensors (4)" in str(e.value) and "layers.1.engram.table" in str(e.value)
    with pytest.raises(CheckpointError, match=r"missing.safetensors: no such file: expected a .safetensors file"):
        convert.load_params(tmp_path / "missing.safetensors", cfg)


def test_cli_converts_official_shards_to_a_bfloat16_file(case, tmp_path):
    cfg, _, root, oracle = case
    parser = argparse.ArgumentParser()
    convert.add_parser(parser.add_subparsers())
    out = tmp_path / "v41.safetensors"
    args = parser.parse_args(["convert", "--config", "tiny", "--set", f"architecture.engram={json.dumps(ENGRAM)}",
                              "--from", "official", str(root), "--out", str(out), "--dtype", "bfloat16"])
    assert convert.run(args) == 0
    assert {a.dtype for a in convert.read_safetensors(out).values()} == {np.dtype(ml_dtypes.bfloat16)}
    want = flat(oracle)
    for path, value in flat(convert.load_params(out, cfg)).items():
        assert value.dtype == np.float32
        rounded = want[path].astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(value, rounded, err_msg=str(path))


def test_transformers_files_load_as_their_state_dict(tmp_path):
    d = np.load(DATA / "v41_port_caseA.npz", allow_pickle=False)
    cfg = transformers_io.config_from_transformers(json.loads(str(d["config_json"][0])))
    state_dict = {n: d[n] for n in d["param_names"]}
    half = sorted(state_dict)[: len(state_dict) // 2]
    save_file({n: state_dict[n].astype(ml_dtypes.bfloat16) for n in half}, str(tmp_path / "a.safetensors"))
    save_file({n: a for n, a in state_dict.items() if n not in half}, str(tmp_path / "b.safetensors"))
    want = flat(transformers_io.params_from_transformers(
        {n: a.astype(ml_dtypes.bfloat16).astype(np.float32) if n in half else a for n, a in state_dict.items()}, cfg))
    got = flat(convert.load_transformers(tmp_path, cfg))
    for path, value in got.items():
        np.testing.assert_array_equal(value, want[path], err_msg=str(path))


def test_unsupported_sources_are_refused_by_name():
    with pytest.raises(ConfigError, match="'architecture.family' = 'v4'"):
        convert.params_from_official({}, load_config("tiny_v4"))
    with pytest.raises(CheckpointError, match=r"FP8 tensors .*'model.layers.0.attn.wq_a.weight'"):
        convert.params_from_transformers_tensors(
            {"model.layers.0.attn.wq_a.weight": np.zeros((32, 64), ml_dtypes.float8_e4m3fn)}, load_config("tiny"))


def test_shard_directories_are_checked(tmp_path):
    one = np.zeros(2, np.float32)
    (tmp_path / "twice").mkdir()
    for f in ("a", "b"):
        save_file({"x": one, f: one}, str(tmp_path / "twice" / f"{f}.safetensors"))
    with pytest.raises(CheckpointError, match=r"b.safetensors: tensors also stored in an earlier shard \(1\)") as e:
        convert.read_checkpoint(tmp_path / "twice")
    assert str(e.value).endswith("['x']")
    (tmp_path / "indexed").mkdir()
    save_file({"x": one}, str(tmp_path / "indexed" / "s.safetensors"))
    (tmp_path / "indexed" / convert.INDEX).write_text(json.dumps({"weight_map": {"x": "s.safetensors",
                                                                                 "y": "s.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"absent from their shard \(1\): \['y'\]"):
        convert.read_checkpoint(tmp_path / "indexed")
    assert list(convert.read_checkpoint(tmp_path / "indexed" / "s.safetensors")) == ["x"]
