"""Weights as the release ships them (DESIGN §2 "weights as shipped", §9), held as shipped and dequantised
inside the program that reads them.

A weight format names how every weight of a model is stored, the one name across the library and every
command (`runtime.weight_format`, `--weight-format`):
- `f32`, `bf16`: every parameter a plain array of that dtype;
- `shipped`: the released V4.1-Flash formats for the matrices the release quantises, the rest (embeddings,
  head, norms, router, compressors, the indexer's `wk` / `weights_proj`) in `runtime.param_dtype`:

| kind    | tensors                                                    | values                     | scales (UE8M0)        |
|---------|------------------------------------------------------------|----------------------------|-----------------------|
| `fp8`   | attention `wq_a wq_b wkv wo_a wo_b`, indexer `wq_b`, shared experts, Engram `wkv` | E4M3 [.., R, C] | [.., ⌈R/32⌉, ⌈C/32⌉]: per 32×32 block |
| `mxfp4` | routed experts `w1 w2 w3`                                  | E2M1 pairs, uint8 [.., R/2, C]: rows 2j (low nibble) and 2j+1 (high) | [.., R/32, C]: per 32 inputs |
| `rows`  | Engram tables                                              | E4M3 [rows, W]             | [rows, W/32]: per 32 of a row |

dsv41 stores a matrix [in, out] (the release: [out, in]); R is the input (contracted) axis, so MXFP4 packs
and scales along the inputs as the release does, and an FP8 block covers the same 32 × 32 entries. Each
weight is two parameters, `w` (or `table`) and `scale`, carrying the same logical axes: the rules shard them
alike, so a chip holds the scales of the values it holds. A value is e · 2^(s − 127) (s the UE8M0 byte); the
products are exact in bfloat16 and float32, so a matmul reading a shipped weight in the compute dtype sees
exactly its dequantised values. A UE8M0 byte 0 (2^-127, below float32's normal range) reads as 0, as XLA:CPU
reads every subnormal; 255 (NaN) reads as infinity.

qwix's `QArray` (and Tokamax's `ragged_dot`, which takes it) was evaluated for this and not used: its scale's
dtype is also the dequantised dtype (`dequantize` returns `scale.dtype`), so UE8M0 scales cannot be held as
one byte, and its FP4 values are `float4_e2m1fn` arrays whose byte packing is XLA's, not the release's; the
current Tokamax needs Python >= 3.12 (dsv41 supports 3.11).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax import lax

from dsv41 import quant
from dsv41.errors import ConfigError
from dsv41.kernels import modes, weight_matmul

FORMATS = ("shipped", "bf16", "f32")
FP8, MXFP4, ROWS = "fp8", "mxfp4", "rows"
KINDS = (FP8, MXFP4, ROWS)
BLOCK = 32
VALUE_DTYPE = {FP8: jnp.float8_e4m3fn, MXFP4: jnp.uint8, ROWS: jnp.float8_e4m3fn}
SCALE_DTYPE = jnp.float8_e8m0fnu


def dtype_of(fmt: str):
    """The plain dtype of weight format `fmt` ("f32" / "bf16"), None for "shipped"."""
    return {"f32": jnp.float32, "bf16": jnp.bfloat16, "shipped": None}[fmt]


def shapes(kind: str, shape) -> tuple[tuple, tuple]:
    """(values shape, scales shape) of a weight of logical shape `shape` stored as `kind`."""
    *lead, r, c = shape
    if kind == FP8:
        return tuple(shape), (*lead, -(-r // BLOCK), -(-c // BLOCK))
    if kind == MXFP4:
        return (*lead, r // 2, c), (*lead, r // BLOCK, c)
    if kind == ROWS:
        return tuple(shape), (*lead, r, c // BLOCK)
    raise ValueError(f"kind: {kind!r}: expected one of {KINDS}")


def check_shape(kind: str, shape, what: str) -> None:
    """Raises ConfigError unless a weight of logical `shape` can be stored as `kind` (MXFP4: whole blocks of 32
    inputs; Engram rows: whole blocks of 32 of a row)."""
    r, c = shape[-2:]
    if kind == MXFP4 and r % BLOCK:
        raise ConfigError(f"{what} input width", r, f"expected a multiple of {BLOCK} for MXFP4 weights")
    if kind == ROWS and c % BLOCK:
        raise ConfigError(f"{what} row width", c, f"expected a multiple of {BLOCK} for FP8 rows")


def _pow2(scales):
    """float32 2^(s − 127) of UE8M0 scales (module doc: byte 0 reads as 0)."""
    s = lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.int32)
    return lax.bitcast_convert_type(s << 23, jnp.float32)


def _ue8m0(k):
    return lax.bitcast_convert_type((jnp.clip(k, -127, 127) + 127).astype(jnp.uint8), SCALE_DTYPE)


def _expand(s, axis: int, size: int):
    """Per-block values repeated over their block along `axis`, cropped to `size` (edge blocks)."""
    return lax.slice_in_dim(jnp.repeat(s, BLOCK, axis=axis), 0, size, axis=axis % s.ndim)


def _code_values(codes):
    """E2M1 codes (uint8 0..15) -> float32 values."""
    return lax.bitcast_convert_type(codes.astype(jnp.uint4), jnp.float4_e2m1fn).astype(jnp.float32)


def check_held(kind: str, values, scales, what: str = "weight") -> None:
    """Raises ValueError unless (values, scales) are a `kind` pair: their dtypes and the scales' shape for the
    values' (naming `what`, the shapes and dtypes found and those expected)."""
    if kind not in KINDS:
        raise ValueError(f"{what}: kind {kind!r}: expected one of {KINDS}")
    for part, x, want in (("values", values, VALUE_DTYPE[kind]), ("scales", scales, SCALE_DTYPE)):
        if jnp.dtype(x.dtype) != jnp.dtype(want):
            raise ValueError(f"{what} {part}: dtype {jnp.dtype(x.dtype)}: expected {jnp.dtype(want)} for {kind} weights")
    logical = (*values.shape[:-2], 2 * values.shape[-2], values.shape[-1]) if kind == MXFP4 else values.shape
    want = shapes(kind, logical)[1]
    if tuple(scales.shape) != tuple(want):
        raise ValueError(f"{what} scales: shape {tuple(scales.shape)}: expected {tuple(want)} for {kind} values of "
                         f"shape {tuple(values.shape)}")


def dequantize(kind: str, values, scales, dtype=jnp.float32, what: str = "weight"):
    """The weight a `kind` (values, scales) pair stores, as `dtype` (exact for float32 and bfloat16)."""
    check_held(kind, values, scales, what)
    if kind == MXFP4:
        lead, (half, c) = values.shape[:-2], values.shape[-2:]
        codes = jnp.stack([values & 0xF, values >> 4], axis=-2)         # [.., R/2, 2, C]: row 2j low, 2j+1 high
        v = _code_values(codes).reshape(*lead, 2 * half, c)
        return (v * _expand(_pow2(scales), -2, 2 * half)).astype(dtype)
    v = values.astype(jnp.float32)
    p = _pow2(scales)
    if kind == FP8:
        p = _expand(_expand(p, -2, v.shape[-2]), -1, v.shape[-1])
    elif kind == ROWS:
        p = _expand(p, -1, v.shape[-1])
    else:
        raise ValueError(f"kind: {kind!r}: expected one of {KINDS}")
    return (v * p).astype(dtype)


def quantize(kind: str, w):
    """(values, scales) of float weights `w` [.., R, C] as `kind`: the scale of a block is 2^⌈log2(amax/max)⌉
    (448 for E4M3, 6 for E2M1; `quant`'s UE8M0 rules), values rounded to nearest even."""
    w = jnp.asarray(w, jnp.float32)
    check_shape(kind, w.shape, "weight")
    if kind == ROWS:
        return quant.quantize_fp8_ue8m0(w, BLOCK)
    if kind == MXFP4:
        t = jnp.swapaxes(w, -1, -2)                                       # [.., C, R]: the blocks along R
        values, scales = quant.quantize_mxfp4(t)
        packed = quant.pack_fp4(values)                                   # [.., C, R/2]
        return jnp.swapaxes(packed, -1, -2), jnp.swapaxes(scales, -1, -2)
    if kind != FP8:
        raise ValueError(f"kind: {kind!r}: expected one of {KINDS}")
    *lead, r, c = w.shape
    pr, pc = -r % BLOCK, -c % BLOCK
    b = jnp.pad(w, [(0, 0)] * len(lead) + [(0, pr), (0, pc)])
    b = b.reshape(*lead, (r + pr) // BLOCK, BLOCK, (c + pc) // BLOCK, BLOCK)
    amax = jnp.maximum(jnp.max(jnp.abs(b), axis=(-3, -1)), jnp.float32(1e-4))
    k = quant._ceil_log2(amax * jnp.float32(1 / quant.E4M3_MAX))
    scales = _ue8m0(k)
    p = _expand(_expand(_pow2(scales), -2, r), -1, c)
    values = jnp.clip(w / p, -quant.E4M3_MAX, quant.E4M3_MAX).astype(jnp.float8_e4m3fn)
    return values, scales


def stored_bytes(kind: str | None, shape, dtype=jnp.float32) -> int:
    """Bytes a weight of logical `shape` takes stored as `kind` (None: a plain `dtype` array)."""
    if kind is None:
        return math.prod(shape) * jnp.dtype(dtype).itemsize
    v, s = shapes(kind, shape)
    return math.prod(v) + math.prod(s)


def kind_for(policy, kind: str | None) -> str | None:
    """The storage kind of a weight the release ships as `kind` under `policy` (None: a plain array)."""
    return kind if policy.weight_format == "shipped" else None


def make(rngs: nnx.Rngs, shape, axes, policy, kind: str | None = None, *, dtype=None, what: str = "weight"):
    """(values, scales) parameters of one matrix (or a stack of them, leading axes first), both with the logical
    axes `axes` (module doc; scales None for a plain array). The draw is normal(0, policy.init_std); with a kind
    under the `shipped` format it is stored quantised, else as `dtype` (default `policy.param_dtype`)."""
    kind = kind_for(policy, kind)
    init = jax.nn.initializers.normal(policy.init_std)
    meta = dict(out_sharding=tuple(axes), eager_sharding=False)
    if kind is None:
        return nnx.Param(init(rngs.params(), tuple(shape), dtype or policy.param_dtype), **meta), None
    check_shape(kind, shape, what)
    values, scales = quantize(kind, init(rngs.params(), tuple(shape), jnp.float32))
    return nnx.Param(values, **meta), nnx.Param(scales, **meta)


def read(values, scales, kind: str | None, axes, policy, dtype=None):
    """The weight as its matmul reads it, in `dtype` (default: the compute dtype): gathered at use
    (`Policy.at_use`) before it is widened, so only the stored bytes move; dequantised inside the program."""
    dtype = dtype or policy.compute_dtype
    w = policy.at_use(values, tuple(axes))
    if scales is None:
        return w.astype(dtype)
    return dequantize(kind, w, policy.at_use(scales, tuple(axes)), dtype)


@struct.dataclass
class Stored:
    """A weight as held (values and scales, `kind`; module doc), passed whole to the code that reads it (the
    routed experts, inside their shard_map): `shape` is the weight's, `read` widens it there."""
    values: jax.Array
    scales: jax.Array
    kind: str = struct.field(pytree_node=False)

    @property
    def shape(self):
        *lead, r, c = self.values.shape
        return (*lead, 2 * r, c) if self.kind == MXFP4 else tuple(self.values.shape)

    def read(self, dtype):
        return dequantize(self.kind, self.values, self.scales, dtype)

    def take(self, idx, axis: int = 0):
        return Stored(jnp.take(self.values, idx, axis=axis), jnp.take(self.scales, idx, axis=axis), self.kind)


def held(values, scales, kind: str | None):
    """The array itself (plain), or a `Stored` pair."""
    return values if scales is None else Stored(values, scales, kind)


def widen(w, dtype):
    """A plain array or a `Stored` weight as `dtype`."""
    return w.read(dtype) if isinstance(w, Stored) else w.astype(dtype)


def kind_of_scale(name: str, values, scales) -> str:
    """The kind of a held (values, scales) pair from its scale's parameter name and the values' dtype."""
    if name == "table_scale":
        return ROWS
    return MXFP4 if values.dtype == jnp.uint8 else FP8


def is_scale(path, flat) -> bool:
    """Whether the parameter at `path` is the scales of a held weight: `X_scale` beside an `X` (flat: path -> leaf)."""
    name = path[-1]
    return isinstance(name, str) and name.endswith("_scale") and (*path[:-1], name.removesuffix("_scale")) in flat


def widened(state: nnx.State, dtype=jnp.float32) -> nnx.State:
    """Parameters held as shipped with every (values, scales) pair dequantised to `dtype` and the scales
    dropped: the tree of the same model in the plain format of `dtype` (the other leaves as they are, except that
    float32 widens bfloat16 ones)."""
    flat = dict(nnx.to_flat_state(state))
    out = []
    for path, var in flat.items():
        name = path[-1]
        if is_scale(path, flat):
            continue
        x = var.get_value()
        scale = flat.get((*path[:-1], f"{name}_scale"))
        if scale is not None:
            s = scale.get_value()
            x = dequantize(kind_of_scale(f"{name}_scale", x, s), x, s, dtype)
        elif jnp.issubdtype(x.dtype, jnp.floating) and dtype == jnp.float32:
            x = x.astype(jnp.float32)
        out.append((path, var.replace(x)))
    return nnx.from_flat_state(out)


def quantized(state: nnx.State, abstract: nnx.State) -> nnx.State:
    """Plain parameters `state` as the tree `abstract` (the same model under the `shipped` format) holds them:
    each weight with a scale there quantised (`quantize`), the others cast to its dtype."""
    plain = dict(nnx.to_flat_state(state))
    flat = dict(nnx.to_flat_state(abstract))
    held = {}
    for path, var in flat.items():
        if is_scale(path, flat):
            name = path[-1].removesuffix("_scale")
            kind = kind_of_scale(path[-1], flat[(*path[:-1], name)].get_value(), None)
            held[(*path[:-1], name)], held[path] = quantize(kind, plain[(*path[:-1], name)].get_value())
    return nnx.from_flat_state([
        (path, var.replace(held[path] if path in held else jnp.asarray(plain[path].get_value(), var.get_value().dtype)))
        for path, var in flat.items()])


def _bytes(a):
    return lax.bitcast_convert_type(a, jnp.uint8)


def kernel_impl(policy) -> str:
    """How the matmuls of weights held as shipped run under `policy` (`kernels.weight_matmul`): 'pallas',
    'pallas_interpret', or 'reference' (the XLA path: dequantised in the program)."""
    return modes.resolve(policy.kernels, modes.platform(policy.lowering.layout), "weights")


def fp8_matmul(x, values, scales, policy):
    """x [..., K] @ an FP8 weight (values [K, N], scales) in the compute dtype by the Pallas kernel where
    `policy.kernels` picks it (dequantised in VMEM; per device over the token rows, the weight whole on each),
    else None (the caller's XLA path)."""
    impl = kernel_impl(policy)
    if impl == "reference":
        return None
    check_held(FP8, values, scales)
    lead = x.shape[:-1]
    dtype = policy.compute_dtype
    y = modes.per_device(
        lambda a, w, s: weight_matmul.fp8_matmul(a, w, s, out_dtype=dtype, interpret=impl == "pallas_interpret"),
        x.reshape(-1, x.shape[-1]).astype(dtype), _bytes(values), _bytes(scales), layout=policy.lowering.layout,
        replicated=(1, 2))
    return y.reshape(*lead, -1)


def _mxfp4_kernel(w, policy) -> str | None:
    """The MXFP4 kernels' mode ('pallas' or 'pallas_interpret') for the routed experts `w` under `policy`, after
    checking the held pair; None where the XLA path runs (reference mode, or experts not held as MXFP4)."""
    impl = kernel_impl(policy)
    if impl == "reference" or not isinstance(w, Stored) or w.kind != MXFP4:
        return None
    check_held(MXFP4, w.values, w.scales, "routed experts")
    return impl


def mxfp4_ragged_dot(x, w: "Stored", sizes, policy):
    """`lax.ragged_dot(x, w, sizes)` for routed experts held as MXFP4, by the Pallas grouped matmul where
    `policy.kernels` picks it (per device: the caller runs inside the experts' shard_map), else None."""
    impl = _mxfp4_kernel(w, policy)
    if impl is None:
        return None
    g = w.values.shape[0]
    bm = 16 if x.shape[0] <= 16 * g else 128          # few rows a group: short row tiles, little padding
    return weight_matmul.mxfp4_gmm(x.astype(policy.compute_dtype), w.values, _bytes(w.scales), sizes, bm=bm,
                                   out_dtype=policy.compute_dtype, interpret=impl == "pallas_interpret")


def mxfp4_bmm(x, w: "Stored", policy):
    """x [1 or G, M, K] (the same rows for every expert, or each expert's own) @ the routed experts' MXFP4 weights
    -> [G, M, N] by the Pallas batched matmul where `policy.kernels` picks it (decode's dense form, inside the
    experts' shard_map), else None."""
    impl = _mxfp4_kernel(w, policy)
    if impl is None:
        return None
    return weight_matmul.mxfp4_bmm(x.astype(policy.compute_dtype), w.values, _bytes(w.scales),
                                   out_dtype=policy.compute_dtype, interpret=impl == "pallas_interpret")
