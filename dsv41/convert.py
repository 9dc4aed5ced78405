"""Checkpoints on disk -> dsv41 parameters (DESIGN §2 "weights as shipped", §10, §11 `dsv41 convert`).

Three sources, one parameter tree:
- the official DeepSeek-V4.1 release (`load_official`): safetensors shards in DeepSeek's own naming,
  quantised as shipped, held so under the weight format `shipped` (`dsv41.nn.weights`), else dequantised here
  to float32;
- transformers-style checkpoints (`load_transformers`): the released V4 and the V4.1 port, through
  `transformers_io.params_from_transformers`;
- dsv41's own tree (`save_params` / `load_params`): one safetensors file keyed by the dotted parameter
  paths ("layers.2.attn.wq_a.w"), float32 or bfloat16, so a converted checkpoint reloads fast.

The official naming is the one DeepSeek's inference code reads: github deepseek-ai/DeepSeek-V3,
`inference/convert.py`, renames the Hugging Face tensors to it (`model.` dropped, `embed_tokens` -> `embed`,
`lm_head` -> `head`, `self_attn` -> `attn`, `mlp` -> `ffn`, `weight_scale_inv` -> `scale`), and the V4 and
V4.1 releases ship in it directly (`layers.3.attn.wq_a.weight` + `layers.3.attn.wq_a.scale`). The
transformers V4.1 port keeps the same names under `model.` (`lm_head` for `head`): `transformers_io.V41_RULES`
places them, so an official name goes through those rules once renamed. The formats are those of the
released V4.1-Flash files (DESIGN §2 "weights as shipped", §3.7; public loaders of that release list the
same dtypes and shapes), the layer tensors below under `layers.{i}.`:

- `attn.{wq_a,wq_b,wkv,wo_a,wo_b}`, `attn.indexer.wq_b`, `ffn.shared_experts.w{1,2,3}`, `engram.wkv`:
  `.weight` F8_E4M3 [out, in] and `.scale` F8_E8M0 [⌈out/32⌉, ⌈in/32⌉]; w = e4m3 · 2^(s−127) per 32×32
  block, edge blocks covering the remainder;
- the routed experts `ffn.experts.{e}.w{1,2,3}`, MXFP4: `.weight` I8 [out, in/2], two E2M1 codes a byte with
  the even element in the low nibble, and `.scale` F8_E8M0 [out, in/32]; w = e2m1 · 2^(s−127) per 32 inputs;
- the Engram table `engram.embed`: `.weight` F8_E4M3 [rows, row_dim] and `.scale` F8_E8M0
  [rows, row_dim/32], a scale per 32 of a row;
- everything else (`embed`, `head`, the norms, `hc_*`, sinks, the router, the compressors, the indexer's
  `wk`/`weights_proj`, Engram `q_weight`/`k_weight`): BF16 or F32, read as is.

A tensor's format is read off its dtype, so a BF16 re-export of the release (DeepSeek's `fp8_cast_bf16.py`)
loads too; its scale layout off its name (only the Engram table scales rows). Out-of-scope tensors (the
vision path, the DSpark drafter) are skipped by name, as in the port.

safetensors' NumPy backend (0.8) reads neither BF16 nor the FP8 dtypes, so files are memory-mapped and
their header parsed here (8-byte little-endian header length, JSON header, raw little-endian data).
Dequantisation runs on the host in float64 and rounds once to float32: every product of an E4M3 or E2M1
value and a power of two is exact there, and XLA CPU would flush subnormal results to zero.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import struct
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from dsv41 import stacking, transformers_io
from dsv41.errors import ConfigError
from dsv41.nn import weights as weights_lib
from dsv41.nn.policy import weight_format
from dsv41.transformers_io import CheckpointError

INDEX = "model.safetensors.index.json"
BLOCK = 32
# Every E2M1 code (sign, 2 exponent bits, 1 mantissa bit) as its value.
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)
_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_ROW_SCALED = re.compile(r"\.engram\.embed\.weight$")  # the Engram table: a UE8M0 scale per 32 of a row
_PACKED = (np.dtype(np.int8), np.dtype(np.uint8))  # MXFP4, two E2M1 codes a byte
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_SCALE_DTYPES = (np.dtype(ml_dtypes.float8_e8m0fnu), np.dtype(np.uint8))
_FLOATS = tuple(np.dtype(d) for d in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16))
_RULES = [(re.compile(p + "$"), target, how) for p, target, how in transformers_io.V41_RULES]

Progress = Callable[[int, int], None]  # (tensors done, tensors in all)


# ------------------------------------------------------------------------------------------------
# Files


def weights_file(option: str, path) -> Path:
    """`path` as given to a command-line `option` (e.g. --init-from), checked to be an existing file."""
    if not Path(path).is_file():
        raise ConfigError(option, str(path), "expected an existing .safetensors weights file "
                          "(written by `dsv41 train --export` or `dsv41 convert`)")
    return Path(path)


def read_safetensors(path) -> dict[str, np.ndarray]:
    """Every tensor of one .safetensors file as a read-only memory-mapped NumPy array (read when used)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file: expected a .safetensors file (`dsv41 train --export`, "
                              "`dsv41 convert`, or the official release's shards)")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    size = path.stat().st_size - 8 - n
    data = np.memmap(path, np.uint8, mode="r", offset=8 + n) if size else np.zeros(0, np.uint8)
    tensors = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {info['dtype']}: "
                                  f"expected one of {list(_DTYPES)}")
        begin, end = info["data_offsets"]
        tensors[name] = data[begin:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return tensors


def read_checkpoint(path_or_dir) -> dict[str, np.ndarray]:
    """The tensors of a .safetensors file, or of a directory's shards: those its `model.safetensors.index.json`
    lists (name -> shard), else every `*.safetensors` in it."""
    root = Path(path_or_dir)
    if root.is_file():
        return read_safetensors(root)
    if (root / INDEX).is_file():
        weight_map = json.loads((root / INDEX).read_text())["weight_map"]
        shards = {f: read_safetensors(root / f) for f in sorted(set(weight_map.values()))}
        absent = sorted(name for name, f in weight_map.items() if name not in shards[f])
        if absent:
            raise CheckpointError(f"{root / INDEX} lists tensors absent from their shard ({len(absent)}): {absent}")
        return {name: shards[f][name] for name, f in weight_map.items()}
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: expected a .safetensors file, or a directory of shards (with {INDEX})")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        shard = read_safetensors(f)
        twice = sorted(set(shard) & set(tensors))
        if twice:
            raise CheckpointError(f"{f}: tensors also stored in an earlier shard ({len(twice)}): {twice}")
        tensors.update(shard)
    return tensors


# ------------------------------------------------------------------------------------------------
# Formats


def scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The UE8M0 scale grid of a [R, C] tensor in blocks of block[0] × block[1]: [⌈R/b0⌉, ⌈C/b1⌉]."""
    return tuple(-(-n // b) for n, b in zip(shape, block))


def _powers(scales, block: tuple[int, int], shape: tuple[int, int]) -> np.ndarray:
    """UE8M0 scales [⌈R/b0⌉, ⌈C/b1⌉] -> float64 2^(s−127) per element [R, C] (edge blocks cropped)."""
    p = np.ldexp(1.0, np.asarray(scales).view(np.uint8).astype(np.int32) - 127)
    return np.repeat(np.repeat(p, block[0], axis=0), block[1], axis=1)[: shape[0], : shape[1]]


def dequantize_fp8(values, scales, block: tuple[int, int] = (BLOCK, BLOCK)) -> np.ndarray:
    """E4M3 values [R, C] and UE8M0 scales [⌈R/b0⌉, ⌈C/b1⌉] -> float32 [R, C], w = e4m3 · 2^(s−127)."""
    return (np.asarray(values).astype(np.float64) * _powers(scales, block, values.shape)).astype(np.float32)


def dequantize_mxfp4(packed, scales) -> np.ndarray:
    """MXFP4 [R, C/2] (int8 or uint8, the even element in the low nibble) and UE8M0 scales [R, ⌈C/32⌉]
    -> float32 [R, C], w = e2m1 · 2^(s−127) per 32 along C."""
    codes = np.asarray(packed).view(np.uint8)
    codes = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(codes.shape[0], 2 * codes.shape[1])
    return (E2M1_VALUES[codes] * _powers(scales, (1, BLOCK), codes.shape)).astype(np.float32)


def _check_quantised(name: str, values: np.ndarray, scale_name: str, scales: np.ndarray) -> str | None:
    """What is wrong with a quantised weight and its scales, or None."""
    if values.ndim != 2:
        return f"{name}: got shape {values.shape}, expected a 2-D quantised weight"
    if scales.dtype not in _SCALE_DTYPES:
        return f"{scale_name}: got dtype {scales.dtype}, expected UE8M0 (F8_E8M0 or U8)"
    if values.dtype == _FP8:
        block, shape = ((1, BLOCK) if _ROW_SCALED.search(name) else (BLOCK, BLOCK)), values.shape
    else:
        block, shape = (1, BLOCK), (values.shape[0], 2 * values.shape[1])
    want = scale_shape(shape, block)
    if tuple(scales.shape) != want:
        return (f"{scale_name}: got {tuple(scales.shape)}, expected {want} "
                f"({block[0]}×{block[1]} blocks of {name} {tuple(values.shape)})")
    return None


def _dequantize(name: str, values: np.ndarray, scale_name: str, scales: np.ndarray):
    """(float32 weight, None), or (None, what is wrong) for a quantised weight and its scales."""
    problem = _check_quantised(name, values, scale_name, scales)
    if problem:
        return None, problem
    if values.dtype == _FP8:
        return dequantize_fp8(values, scales, (1, BLOCK) if _ROW_SCALED.search(name) else (BLOCK, BLOCK)), None
    return dequantize_mxfp4(values, scales), None


def _as_held(values: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A quantised weight and its scales as the `shipped` format holds them: E4M3 or uint8 (MXFP4 pairs) values,
    F8_E8M0 scales (the same bytes)."""
    if values.dtype in _PACKED:
        values = np.asarray(values).view(np.uint8)
    return values, np.asarray(scales).view(ml_dtypes.float8_e8m0fnu)


# ------------------------------------------------------------------------------------------------
# The official release


def port_name(name: str) -> str | None:
    """The V4.1 port's name (`transformers_io.V41_RULES`) of an official tensor; None when it has none."""
    if name == "head.weight":
        return "lm_head.weight"
    if name in ("embed.weight", "norm.weight") or name.startswith("layers."):
        return "model." + name
    return None


def _placed(port: str, expected: set, num_experts: int) -> bool:
    """Whether a port-named tensor lands on a parameter of this config."""
    for pattern, target, how in _RULES:
        m = pattern.match(port)
        if m:
            # The port's float Engram tables carry a per-row scale of their own; the official scale is the
            # FP8 table's, consumed with it.
            if how == "engram_scale":
                return False
            return target(m) in expected and (how != "expert" or int(m[2]) < num_experts)
    return False


@functools.lru_cache(maxsize=8)
def _abstract(key: str) -> tuple:
    """(path, abstract variable) of every parameter of a config (by `model.config_key`): tracing the
    model for its shapes takes seconds, and a conversion checks against them more than once."""
    from dsv41 import config as config_lib
    from dsv41 import model as model_lib

    cfg = config_lib.build(json.loads(key))
    return tuple(stacking.per_layer(model_lib.abstract_params(cfg), cfg))


def _raise(unknown, missing, misshaped, more: str = "") -> None:
    if unknown or missing or misshaped or more:
        raise CheckpointError(
            "checkpoint does not match the config:"
            + (f"\n  unknown tensors ({len(unknown)}): {sorted(unknown)}" if unknown else "")
            + (f"\n  missing tensors ({len(missing)}): {sorted(missing)}" if missing else "")
            + (f"\n  misshaped tensors ({len(misshaped)}): {misshaped}" if misshaped else "")
            + (f"\n{more}" if more else ""))


def params_from_official(tensors: Mapping[str, np.ndarray], cfg, progress: Progress | None = None) -> nnx.State:
    """dsv41 parameters for a V4.1 `cfg` from tensors in the official naming and formats (module docstring).

    tensors: official name -> array (NumPy, ml_dtypes for BF16/FP8, as `read_checkpoint` returns them).
    Unknown names, missing tensors or scales, and misshaped tensors or scales are all listed in one
    CheckpointError (official names; missing parameters by their dsv41 path).
    """
    from dsv41 import model as model_lib

    if cfg.architecture.family != "v41":
        raise ConfigError("architecture.family", cfg.architecture.family,
                          "expected 'v41' for the official V4.1 naming (convert V4 from its transformers release)")
    expected = {path for path, _ in _abstract(model_lib.config_key(cfg))}
    num_experts = cfg.architecture.moe.num_experts
    skip = transformers_io.V41_IGNORED
    names = [n for n in tensors if not n.endswith(".scale") and not skip.search(n)]
    scales = {n for n in tensors if n.endswith(".scale") and not skip.search(n)}
    unknown, missing, misshaped, used = [], [], [], set()
    port: dict[str, np.ndarray] = {}
    held = weight_format(cfg) == "shipped"  # keep the quantised weights as shipped, else dequantise them here
    port_scales: dict[str, np.ndarray] = {}
    for done, name in enumerate(names, 1):
        target, array = port_name(name), tensors[name]
        scale_name = name.removesuffix("weight") + "scale"
        if target is None or not _placed(target, expected, num_experts):
            unknown.append(name)
        elif name.endswith(".weight") and (array.dtype == _FP8 or array.dtype in _PACKED):
            if scale_name not in tensors:
                missing.append(scale_name)
            else:
                used.add(scale_name)
                if held:
                    problem = _check_quantised(name, array, scale_name, tensors[scale_name])
                    if not problem:
                        port[target], port_scales[target] = _as_held(array, tensors[scale_name])
                else:
                    array, problem = _dequantize(name, array, scale_name, tensors[scale_name])
                    if not problem:
                        port[target] = array
                if problem:
                    misshaped.append(problem)
        elif array.dtype in _FLOATS:
            # under `shipped` a float matrix the release quantises is refused where it is placed (dtype check)
            port[target] = np.asarray(array, np.float32)
        else:
            misshaped.append(f"{name}: got dtype {array.dtype}, "
                             "expected BF16/F32, or a FP8/MXFP4 weight and its scale")
        if progress is not None:
            progress(done, len(names))
    for scale_name in sorted(scales - used):
        weight = scale_name.removesuffix("scale") + "weight"
        if weight in tensors:
            unknown.append(scale_name)  # beside an unquantised or unknown weight
        else:
            missing.append(weight)
    try:
        params = transformers_io.params_from_transformers(port, cfg, scales=port_scales if held else None)
    except CheckpointError as e:
        # The port's loader lists the parameters left unset and the shapes after placement.
        _raise(unknown, missing, misshaped, str(e).partition("\n")[2])
    _raise(unknown, missing, misshaped)
    return params


def load_official(path_or_dir, cfg, progress: Progress | None = None) -> nnx.State:
    """dsv41 parameters from official V4.1 safetensors (a file, or a directory of shards with or without
    `model.safetensors.index.json`): held as shipped under the config's weight format `shipped`, else dequantised
    to float32 (module docstring)."""
    return params_from_official(read_checkpoint(path_or_dir), cfg, progress)


# ------------------------------------------------------------------------------------------------
# transformers checkpoints


def params_from_transformers_tensors(tensors: Mapping[str, np.ndarray], cfg,
                                     progress: Progress | None = None) -> nnx.State:
    """dsv41 parameters from tensors in a transformers naming (released V4, V4.1 port), unquantised."""
    quantised = sorted(n for n, a in tensors.items() if a.dtype in (_FP8, np.dtype(ml_dtypes.float8_e8m0fnu)))
    if quantised:
        raise CheckpointError(f"FP8 tensors without a transformers meaning ({len(quantised)}): {quantised}: "
                              "expected BF16/F32 weights (the official release loads with --from official)")
    state_dict = {}
    for done, (name, array) in enumerate(tensors.items(), 1):
        state_dict[name] = np.array(array)
        if progress is not None:
            progress(done, len(tensors))
    return transformers_io.params_from_transformers(state_dict, cfg)


def load_transformers(path_or_dir, cfg, progress: Progress | None = None) -> nnx.State:
    """dsv41 parameters from transformers-style safetensors (a file, or a directory of shards)."""
    return params_from_transformers_tensors(read_checkpoint(path_or_dir), cfg, progress)


# ------------------------------------------------------------------------------------------------
# dsv41's own tree


def _key(path) -> str:
    return ".".join(map(str, path))


def save_params(params: nnx.State, cfg, path, dtype: str = "float32") -> int:
    """Writes a parameter tree to one safetensors file (keys: dotted per-layer parameter paths,
    `layers.{i}.attn.wq_a.w`, whatever the stacks; floating leaves in `dtype`, "float32" or "bfloat16", except
    the weights held as shipped, written as they are held with their `_scale`s; integer leaves as they are), so
    a file reads back whatever the stacks (`dsv41.stacking`). Returns the bytes written."""
    from safetensors.numpy import save_file

    dtypes = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
    if dtype not in dtypes:
        raise ValueError(f"dtype: {dtype!r}: expected one of {list(dtypes)}")
    tensors = {}
    for p, var in stacking.per_layer(params, cfg):
        a = np.asarray(var.get_value())
        floating = jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize > 1  # not FP8 values or scales
        tensors[_key(p)] = np.ascontiguousarray(a.astype(dtypes[dtype]) if floating else a)
    save_file(tensors, str(path), metadata={"format": "dsv41", "dtype": dtype})
    return Path(path).stat().st_size


def load_params(path, cfg) -> nnx.State:
    """The parameter tree `save_params` wrote, checked against `cfg` and cast to its parameter dtypes. A file of
    weights held as shipped loads into a config of a wider weight format dequantised (`weights.widened`);
    the reverse is refused, naming the tensors (quantising is a choice: `dsv41 convert` from the release)."""
    from dsv41 import model as model_lib
    from dsv41.nn import weights as weights_lib

    tensors = read_safetensors(path)
    expected = {_key(p): (p, var) for p, var in _abstract(model_lib.config_key(cfg))}
    held = {k for k in tensors if k.endswith("_scale") and k.removesuffix("_scale") in tensors}
    if held and not any(k.endswith("_scale") for k in expected):
        for k in held:  # a shipped file, a wider config: dequantise each held weight here
            name = k.removesuffix("_scale")
            kind = weights_lib.kind_of_scale(k.rpartition(".")[2], tensors[name], tensors[k])
            tensors[name] = np.asarray(weights_lib.dequantize(kind, tensors[name], tensors.pop(k)))
    misshaped = [f"{k}: got {tuple(tensors[k].shape)}, expected {tuple(var.get_value().shape)}"
                 for k, (_, var) in expected.items()
                 if k in tensors and tuple(tensors[k].shape) != tuple(var.get_value().shape)]
    misshaped += [f"{k}: got dtype {tensors[k].dtype}, expected {jnp.dtype(var.get_value().dtype)} (weight format "
                  f"'shipped' holds the release's bytes; convert them from the release)"
                  for k, (_, var) in expected.items()
                  if k in tensors and jnp.dtype(var.get_value().dtype).itemsize == 1
                  and np.dtype(tensors[k].dtype) != jnp.dtype(var.get_value().dtype)]
    _raise(sorted(set(tensors) - set(expected)), sorted(set(expected) - set(tensors)), misshaped)
    return stacking.from_per_layer({p: tensors[k] for k, (p, _) in expected.items()},
                                   model_lib.abstract_params(cfg), cfg)


def command_params(cfg, config: str, weights=None, *, seed: int = 0, option: str = "--weights"):
    """The parameters a command runs with: the weights file `weights` (a `save_params` file, checked as the
    command-line `option`), else the weights shipped beside the config named `config` (`configs/NAME.safetensors`,
    `config.shipped_weights`), else random ones from `seed`. Returns (params, the file read or None)."""
    import jax

    from dsv41 import config as config_lib
    from dsv41 import model as model_lib

    if weights is not None:
        path = weights_file(option, weights)
    else:
        found = config_lib.resolve(config).resolve()
        shipped = found.parent == config_lib.configs_dir().resolve()
        path = config_lib.shipped_weights(found.stem) if shipped else None
        if path is not None and not path.is_file():
            path = None
    if path is None:
        return model_lib.init_params(cfg, jax.random.key(seed)), None
    return load_held(path, cfg), path


def load_held(path, cfg) -> nnx.State:
    """`load_params`, except that a file of plain weights loads into a config of the `shipped` weight format
    quantised to the release's formats (`weights.quantized`; said on stderr): the user's --weight-format."""
    from dsv41 import config as config_lib
    from dsv41 import model as model_lib

    if weight_format(cfg) != "shipped" or any(k.endswith("_scale") for k in read_safetensors(path)):
        return load_params(path, cfg)
    plain = config_lib.build(cfg.to_dict(), config_lib.weight_format_overrides(
        "f32" if cfg.runtime.param_dtype == "float32" else "bf16"))
    print(f"{path}: plain weights, quantised to the shipped formats (weight format 'shipped')", file=sys.stderr)
    return weights_lib.quantized(load_params(path, plain), model_lib.abstract_params(cfg))


# ------------------------------------------------------------------------------------------------
# Command line


def add_parser(subparsers):
    """Registers `convert` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "convert", help="a checkpoint (official DeepSeek or transformers) -> dsv41 parameters in one file",
        description="Reads safetensors in the official DeepSeek-V4.1 naming (FP8 32x32 blocks, MXFP4 experts, "
                    "FP8 Engram tables, kept so or dequantised: --weight-format) or in a transformers naming (released V4, "
                    "V4.1 port) and writes dsv41's parameter tree to one safetensors file that "
                    "dsv41.convert.load_params reads back. Any unknown, missing or misshaped tensor is listed.",
        epilog="example: dsv41 convert --config v41_flash --from official /ckpt/DeepSeek-V4.1-Flash "
               "--out v41_flash.safetensors")
    p.add_argument("--config", required=True, help="config name in configs/ or a .json/.toml/.py path")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (repeatable)")
    p.add_argument("--from", dest="source", required=True, choices=("official", "transformers"),
                   help="the naming of SRC")
    p.add_argument("src", metavar="SRC", help="a .safetensors file, or a directory of shards")
    p.add_argument("--out", required=True, metavar="DST.safetensors", help="where to write the parameters")
    p.add_argument("--weight-format", choices=weights_lib.FORMATS, default=None,
                   help="how the written weights are held: 'shipped' keeps the release's FP8 / MXFP4 weights and "
                        "their scales as they are (the default from the release), 'bf16' / 'f32' dequantises "
                        "every one (the default from transformers: the config's)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help=argparse.SUPPRESS)  # old name
    return p


def _weight_format(args) -> str | None:
    """--weight-format, or its old spelling --dtype (float32 / bfloat16), or None (the source's default)."""
    old = {"float32": "f32", "bfloat16": "bf16"}.get(args.dtype)
    if old and args.weight_format and old != args.weight_format:
        raise ConfigError("--dtype", args.dtype, f"expected it to agree with --weight-format {args.weight_format} "
                                                 "(--dtype is its old name: give one)")
    return args.weight_format or old or ("shipped" if args.source == "official" else None)


def run(args) -> int:
    from dsv41 import progress as progress_lib
    from dsv41.config import load_config

    from dsv41.config import weight_format_overrides

    fmt = _weight_format(args)
    cfg = load_config(args.config, [*args.set, *weight_format_overrides(fmt)])
    fmt = weight_format(cfg)
    start = time.perf_counter()
    tensors = read_checkpoint(args.src)
    bar = progress_lib.bar(total=len(tensors), desc=f"convert ({args.source})", unit="tensor", leave=False)

    def progress(done, total):
        bar.total = total
        bar.update(done - bar.n)

    convert = params_from_official if args.source == "official" else params_from_transformers_tensors
    try:
        params = convert(tensors, cfg, progress)
    finally:
        bar.close()
    dtype = "float32" if fmt == "f32" else "bfloat16" if fmt == "bf16" else cfg.runtime.param_dtype
    size = save_params(params, cfg, args.out, dtype)
    count = sum(int(np.prod(var.get_value().shape)) for _, var in nnx.to_flat_state(params))
    print(f"{args.out}: {count:,} parameter values ({size / 1e6:.1f} MB, weight format {fmt}) from {len(tensors)} tensors "
          f"in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0
