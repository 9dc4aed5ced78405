"""Pallas matmuls that read weights held as shipped (`dsv41.nn.weights`, DESIGN §2, §8, §9) and dequantise
each tile in VMEM: a block-scaled FP8 matmul, and for the routed experts an MXFP4 grouped matmul (prefill's
ragged groups) and an MXFP4 batched matmul (decode's dense form: every held expert over the step's few tokens).

| kernel        | x                 | weight bytes                          | UE8M0 scale bytes        | out      |
|---------------|-------------------|---------------------------------------|--------------------------|----------|
| `fp8_matmul`  | [M, K]            | E4M3 uint8 [K, N]                     | [⌈K/32⌉, ⌈N/32⌉]         | [M, N]   |
| `mxfp4_gmm`   | [M, K], rows sorted by group | E2M1 pairs uint8 [G, K/2, N] (inputs 2j low nibble, 2j+1 high) | [G, K/32, N] | [M, N] |
| `mxfp4_bmm`   | [1 or G, M, K]    | as `mxfp4_gmm`                        | [G, K/32, N]             | [G, M, N] |

Each grid step decodes its weight tile from integer bit operations (`quant_pack.decode_e4m3` / `decode_e2m1`, as
the cache kernels do: no float8 / float4 dtype in the kernel), multiplies it by its scales (spread over the block
by a 0/1 matmul, exact: powers of two times one), casts it to x's dtype (exact: an E4M3 or E2M1 value times a
power of two is a bfloat16) and accumulates `dot(x tile, w tile)` in float32 over the K tiles in order; the
widened tile lives only in VMEM. The MXFP4 kernel contracts the even inputs with the low nibbles and the odd
inputs with the high ones (x's columns split by the wrapper), so no lane interleaving is needed. The grouped
matmul pads each group's rows to whole row tiles (the tiles' groups reach the weight index map by scalar
prefetch, as a ragged matmul's groups do in tpu-inference's megablox); rows of no group give zeros.

The plain-JAX references beside them (`*_reference`) compute the same tiles in the same order, so in interpret
mode the kernels equal them bit for bit; both equal a dequantise-then-dot within float32 rounding.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from dsv41.kernels.quant_pack import decode_e2m1, decode_e4m3, decode_ue8m0

BLOCK = 32


def _spread(n: int, blocks: int):
    """float32 [n, blocks] 0/1: row i belongs to block i // (n / blocks)."""
    per = n // blocks
    i, j = lax.broadcasted_iota(jnp.int32, (n, blocks), 0), lax.broadcasted_iota(jnp.int32, (n, blocks), 1)
    return (i // per == j).astype(jnp.float32)


def _hi(a, b):
    return jnp.dot(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _fp8_chunk(w_bytes, s_tile, dtype):
    """E4M3 bytes [kc, bn] and their scales (float32 powers of two [⌈kc/32⌉, bn/32]) -> the weights in `dtype`."""
    kc, bn = w_bytes.shape
    full = _hi(_hi(_spread(kc, s_tile.shape[0]), s_tile), _spread(bn, s_tile.shape[1]).T)
    return (decode_e4m3(w_bytes.astype(jnp.int32)) * full).astype(dtype)


def _column_scales(s_bytes, j, bn: int):
    """The UE8M0 scales [⌈K/32⌉, ⌈N/32⌉] of a whole weight -> float32 those of column tile j [⌈K/32⌉, bn/32], picked
    by a 0/1 matmul (exact; no lane slicing at a dynamic offset)."""
    s = decode_ue8m0(s_bytes.astype(jnp.int32))
    cols = bn // BLOCK if bn % BLOCK == 0 else s.shape[1]
    c, b = lax.broadcasted_iota(jnp.int32, (s.shape[1], cols), 0), lax.broadcasted_iota(jnp.int32, (s.shape[1], cols), 1)
    return _hi(s, (c == j * cols + b).astype(jnp.float32))


def _chunks(k: int, chunk: int):
    """Static (start, size) of the K chunks a tile decodes one at a time (whole 32-blocks; the last may be short)."""
    return [(c, min(chunk, k - c)) for c in range(0, k, chunk)]


def _mxfp4_tiles(p_bytes, s_bytes, dtype):
    """Packed bytes [bk2, bn] (rows: input pairs) and UE8M0 bytes [bk2/16, bn] -> (even inputs' weights, odd
    inputs') in `dtype`, each [bk2, bn]."""
    b = p_bytes.astype(jnp.int32)
    s = _hi(_spread(b.shape[0], s_bytes.shape[0]), decode_ue8m0(s_bytes.astype(jnp.int32)))
    return (decode_e2m1(b & 15) * s).astype(dtype), (decode_e2m1(b >> 4) * s).astype(dtype)


def _fp8_kernel(x_ref, w_ref, s_ref, o_ref, *, chunk):
    """One (row tile, column tile): its whole K, decoded `chunk` rows at a time (the widened chunk lives in VMEM);
    the weight's scales are held whole (1/1024 of its bytes)."""
    x = x_ref[...]
    s = _column_scales(s_ref[...], pl.program_id(1), o_ref.shape[1])
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    for c, n in _chunks(x.shape[1], chunk):
        w = _fp8_chunk(w_ref[c:c + n, :], s[c // BLOCK:-(-(c + n) // BLOCK)], x.dtype)
        acc = acc + jnp.dot(x[:, c:c + n], w, preferred_element_type=jnp.float32, precision=_precision(x.dtype))
    o_ref[...] = acc.astype(o_ref.dtype)


def _gmm_kernel(groups_ref, used_ref, xe_ref, xo_ref, p_ref, s_ref, o_ref, acc_ref):
    del groups_ref  # read by the index maps
    k = pl.program_id(2)

    @pl.when(pl.program_id(0) < used_ref[0])   # row tiles past the groups' own: no work (and no new weight tile)
    def _():
        _accumulate(xe_ref[...], xo_ref[...], p_ref, s_ref, acc_ref, k, o_ref, ...)


def _accumulate(xe, xo, p_ref, s_ref, acc_ref, k, o_ref, out_at):
    """One K tile of an MXFP4 matmul: acc += xe @ even + xo @ odd of the decoded tile (acc zeroed at K tile 0);
    at the last K tile, o_ref[out_at] = acc in the output's dtype."""
    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    even, odd = _mxfp4_tiles(p_ref[0], s_ref[0], xe.dtype)
    pr = _precision(xe.dtype)
    acc_ref[...] += (jnp.dot(xe, even, preferred_element_type=jnp.float32, precision=pr)
                     + jnp.dot(xo, odd, preferred_element_type=jnp.float32, precision=pr))

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        o_ref[out_at] = acc_ref[...].astype(o_ref.dtype)


def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _tile(n: int, want: int, multiple: int) -> int:
    """The tile along a dimension of n: `want` (a multiple of `multiple`) or the whole padded dimension."""
    return min(want, -(-n // multiple) * multiple)


def _pad_to(a, axis: int, size: int, value=0):
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, pad, constant_values=value)


def _check(name, x, dtype):
    if jnp.dtype(x.dtype) != jnp.dtype(dtype):
        raise ValueError(f"{name}: dtype {jnp.dtype(x.dtype)}: expected {jnp.dtype(dtype)} bytes")


def _divisor_tile(n: int, want: int, multiple: int) -> int:
    """The largest multiple of `multiple` at most `want` that divides n, else n itself (a whole dimension is
    always a legal block): the weights are tiled in place, never padded (a padded copy would be a widened copy)."""
    for t in range(want - want % multiple, 0, -multiple):
        if n % t == 0:
            return t
    return n


def _fp8_layout(x, w, s, bm, bn):
    """Checks, tiles and operands of `fp8_matmul` / its reference: rows padded to whole row tiles (activations
    only), the weight and its scales in place."""
    (m, k), (k2, n) = x.shape, w.shape
    _check("weight", w, jnp.uint8)
    _check("scales", s, jnp.uint8)
    if k2 != k or s.shape != (-(-k // BLOCK), -(-n // BLOCK)):
        raise ValueError(f"weight {w.shape}, scales {s.shape}: expected [{k}, N] and [{-(-k // BLOCK)}, "
                         f"{-(-n // BLOCK)}] for x {x.shape} (E4M3 bytes with a UE8M0 byte per 32×32 block)")
    if bm % 8 or bn % 128:
        raise ValueError(f"tiles ({bm}, {bn}): expected rows a multiple of 8 and columns of 128")
    bm = _tile(m, bm, 8)
    bn = _divisor_tile(n, bn, 128) if n % BLOCK == 0 else n
    x = _pad_to(x, 0, -(-m // bm) * bm)
    return x, w, s, (bm, bn), (m, n)


def fp8_matmul(x, w_bytes, s_bytes, *, bm: int = 128, bn: int = 512, chunk: int = 512, out_dtype=jnp.float32,
               interpret: bool = False):
    """x [M, K] @ the FP8 weight (E4M3 bytes [K, N], UE8M0 bytes per 32×32 block) -> [M, N] (module doc)."""
    x, w, s, (bm, bn), (m, n) = _fp8_layout(x, w_bytes, s_bytes, bm, bn)
    mp, k = x.shape
    out = pl.pallas_call(
        functools.partial(_fp8_kernel, chunk=chunk),
        out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype),
        grid=(mp // bm, n // bn),
        in_specs=[pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((k, bn), lambda i, j: (0, j)),
                  pl.BlockSpec(s.shape, lambda i, j: (0, 0))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret,
        compiler_params=None if interpret else _params(2),
        cost_estimate=pl.CostEstimate(flops=2 * mp * k * n, transcendentals=0,
                                      bytes_accessed=x.size * x.dtype.itemsize * (n // bn) + w.size * (mp // bm)
                                      + s.size + mp * n * jnp.dtype(out_dtype).itemsize),
        name="fp8_block_matmul",
    )(x, w, s)
    return out[:m]


def fp8_matmul_reference(x, w_bytes, s_bytes, *, bm: int = 128, bn: int = 512, chunk: int = 512,
                         out_dtype=jnp.float32):
    """`fp8_matmul` in plain JAX: the same tiles and chunks decoded the same way and summed in the same order."""
    x, w, s, (bm, bn), (m, n) = _fp8_layout(x, w_bytes, s_bytes, bm, bn)
    rows = []
    for i in range(0, x.shape[0], bm):
        cols = []
        for j in range(0, n, bn):
            xt, acc = x[i:i + bm], jnp.zeros((bm, bn), jnp.float32)
            st = _column_scales(s, j // bn, bn)
            for c, kc in _chunks(x.shape[1], chunk):
                wt = _fp8_chunk(w[c:c + kc, j:j + bn], st[c // BLOCK:-(-(c + kc) // BLOCK)], xt.dtype)
                acc = acc + jnp.dot(xt[:, c:c + kc], wt, preferred_element_type=jnp.float32,
                                    precision=_precision(xt.dtype))
            cols.append(acc.astype(out_dtype))
        rows.append(jnp.concatenate(cols, axis=1))
    return jnp.concatenate(rows, axis=0)[:m]


def _params(n_axes: int = 3):
    """Mosaic: the row and column tiles in any order, the K tiles (a third axis) in order (they accumulate)."""
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")[:n_axes])


def _vmem(shape):
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.VMEM(shape, jnp.float32)


def _gmm_layout(x, p, s, group_sizes, bm, bk2, bn):
    """Checks, tiles, the padded row layout (row r of x -> row `dest[r]`), each row tile's group, and the
    operands of `mxfp4_gmm` / its reference."""
    (m, k), (g, k2, n) = x.shape, p.shape
    _check("weight", p, jnp.uint8)
    _check("scales", s, jnp.uint8)
    if 2 * k2 != k or k % BLOCK or s.shape != (g, k // BLOCK, n):
        raise ValueError(f"weight {p.shape}, scales {s.shape}: expected [G, {k // 2}, N] and [G, {k // BLOCK}, N] for "
                         f"x {x.shape} (E2M1 pairs with a UE8M0 byte per 32 inputs)")
    if group_sizes.shape != (g,):
        raise ValueError(f"group_sizes {group_sizes.shape}: expected ({g},), one count per group")
    if bk2 % 512 or bn % 128 or bm % 8:
        raise ValueError(f"tiles ({bm}, {bk2}, {bn}): expected rows a multiple of 8, packed K of 512 (32 scale "
                         "rows: Mosaic's 8-bit tiles) and columns of 128")
    bk2, bn = _divisor_tile(k // 2, bk2, 512), _divisor_tile(n, bn, 128)   # in place: the weights are not padded
    kp2, np_ = k // 2, n
    tiles = -(-(m + g * (bm - 1)) // bm)                      # every group's rows padded to whole tiles
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    padded = -(-sizes // bm) * bm
    pstarts = jnp.cumsum(padded) - padded
    group_of_row = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(m), side="right")
    live = group_of_row < g
    gr = jnp.minimum(group_of_row, g - 1)
    dest = jnp.where(live, pstarts[gr] + jnp.arange(m) - starts[gr], tiles * bm)   # rows past the groups: dropped
    tile_group = jnp.minimum(jnp.searchsorted(jnp.cumsum(padded), jnp.arange(tiles) * bm, side="right"), g - 1)
    used = (jnp.sum(padded) // bm).reshape(1).astype(jnp.int32)     # the row tiles that hold a group's rows
    xs = jnp.zeros((tiles * bm, k), x.dtype).at[dest].set(x, mode="drop")
    xe, xo = xs[:, 0::2], xs[:, 1::2]
    return xe, xo, p, s, tile_group.astype(jnp.int32), used, dest, (bm, bk2, bn), (m, n)


def mxfp4_gmm(x, p_bytes, s_bytes, group_sizes, *, bm: int = 128, bk2: int = 512, bn: int = 512,
              out_dtype=jnp.float32, interpret: bool = False):
    """Rows of x [M, K] sorted by group (group_sizes [G], rows past their sum give zeros) times their group's
    MXFP4 weight (E2M1 pairs [G, K/2, N], UE8M0 bytes [G, K/32, N]) -> [M, N], as `lax.ragged_dot` (module doc)."""
    xe, xo, p, s, tile_group, used, dest, (bm, bk2, bn), (m, n) = _gmm_layout(x, p_bytes, s_bytes, group_sizes, bm,
                                                                              bk2, bn)
    mp, kp2 = xe.shape
    np_ = p.shape[2]
    nk, nn = kp2 // bk2, np_ // bn
    from jax.experimental.pallas import tpu as pltpu

    def at(i, j, k, used):
        """(k, j), or for a row tile past the groups' own the last block: one block for every such step, so the
        pipeline fetches no weight tile for them."""
        live = i < used[0]
        return jnp.where(live, k, nk - 1), jnp.where(live, j, nn - 1)

    def weight_map(i, j, k, grp, used):
        kk, jj = at(i, j, k, used)
        return grp[i], kk, jj

    def rows_map(i, j, k, grp, used):
        return i, at(i, j, k, used)[0]

    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(mp // bm, nn, nk),
        in_specs=[pl.BlockSpec((bm, bk2), rows_map), pl.BlockSpec((bm, bk2), rows_map),
                  pl.BlockSpec((1, bk2, bn), weight_map),
                  pl.BlockSpec((1, bk2 // (BLOCK // 2), bn), weight_map)],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, k, grp, used: (i, j)),
        scratch_shapes=[_vmem((bm, bn))])
    out = pl.pallas_call(
        _gmm_kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid_spec=spec,
        interpret=interpret,
        compiler_params=None if interpret else _params(),
        cost_estimate=pl.CostEstimate(flops=4 * mp * kp2 * np_, transcendentals=0,
                                      bytes_accessed=2 * xe.size * xe.dtype.itemsize * (np_ // bn)
                                      + (mp // bm) * bk2 * np_ * (kp2 // bk2) + mp * np_ * jnp.dtype(out_dtype).itemsize),
        name="mxfp4_grouped_matmul",
    )(tile_group, used, xe, xo, p, s)
    return jnp.take(out, dest, axis=0, mode="fill", fill_value=0)[:, :n]


def mxfp4_gmm_reference(x, p_bytes, s_bytes, group_sizes, *, bm: int = 128, bk2: int = 512, bn: int = 512,
                        out_dtype=jnp.float32):
    """`mxfp4_gmm` in plain JAX: the same padded row tiles, tiles decoded the same way and summed in the same
    order (the row tiles' groups read on the host: not for use inside a jit)."""
    xe, xo, p, s, tile_group, used, dest, (bm, bk2, bn), (m, n) = _gmm_layout(x, p_bytes, s_bytes, group_sizes, bm,
                                                                              bk2, bn)
    groups = [int(t) for t in tile_group][:int(used[0])]
    rows = []
    for t, grp in enumerate(groups):
        i = t * bm
        cols = []
        for j in range(0, p.shape[2], bn):
            acc = jnp.zeros((bm, bn), jnp.float32)
            for k in range(0, xe.shape[1], bk2):
                even, odd = _mxfp4_tiles(p[grp, k:k + bk2, j:j + bn],
                                         s[grp, k // (BLOCK // 2):(k + bk2) // (BLOCK // 2), j:j + bn], xe.dtype)
                pr = _precision(xe.dtype)
                acc = acc + (jnp.dot(xe[i:i + bm, k:k + bk2], even, preferred_element_type=jnp.float32, precision=pr)
                             + jnp.dot(xo[i:i + bm, k:k + bk2], odd, preferred_element_type=jnp.float32, precision=pr))
            cols.append(acc.astype(out_dtype))
        rows.append(jnp.concatenate(cols, axis=1))
    out = jnp.concatenate(rows + [jnp.zeros((xe.shape[0] - len(rows) * bm, p.shape[2]), out_dtype)], axis=0)
    return jnp.take(out, dest, axis=0, mode="fill", fill_value=0)[:, :n]


def _bmm_layout(x, p, s, bk2, bn):
    """Checks, tiles and operands of `mxfp4_bmm` / its reference: x's columns split into even and odd inputs."""
    (gx, m, k), (g, k2, n) = x.shape, p.shape
    _check("weight", p, jnp.uint8)
    _check("scales", s, jnp.uint8)
    if 2 * k2 != k or k % BLOCK or s.shape != (g, k // BLOCK, n):
        raise ValueError(f"weight {p.shape}, scales {s.shape}: expected [G, {k // 2}, N] and [G, {k // BLOCK}, N] for "
                         f"x {x.shape} (E2M1 pairs with a UE8M0 byte per 32 inputs)")
    if gx not in (1, g):
        raise ValueError(f"x {x.shape}: expected [1, M, K] (the same rows for every expert) or [{g}, M, K]")
    if bk2 % 512 or bn % 128:
        raise ValueError(f"tiles ({bk2}, {bn}): expected packed K of 512 (32 scale rows: Mosaic's 8-bit tiles) and "
                         "columns of 128")
    bk2, bn = _divisor_tile(k2, bk2, 512), _divisor_tile(n, bn, 128)
    return x[..., 0::2], x[..., 1::2], (bk2, bn)


def _bmm_kernel(xe_ref, xo_ref, p_ref, s_ref, o_ref, acc_ref):
    k = pl.program_id(2)
    bk2 = p_ref.shape[1]
    # the expert's rows are held whole: this K tile of them (one K tile: all of them, no lane slice to prove)
    at = slice(None) if bk2 == xe_ref.shape[2] else pl.ds(pl.multiple_of(k * bk2, bk2), bk2)
    _accumulate(xe_ref[0, :, at], xo_ref[0, :, at], p_ref, s_ref, acc_ref, k, o_ref, 0)


def mxfp4_bmm(x, p_bytes, s_bytes, *, bk2: int = 512, bn: int = 1024, out_dtype=jnp.float32,
              interpret: bool = False):
    """Every expert over a few rows (a decode step's dense experts): x [1, M, K] (the same rows for every expert)
    or [G, M, K] (each expert's own) times the MXFP4 weights [G, K/2, N] (scales [G, K/32, N]) -> [G, M, N].

    Each expert's weight is read once and its rows once (held whole in VMEM across its column and K tiles; x
    shared by all experts is read once in all), so the step moves the weight bytes and little else."""
    xe, xo, (bk2, bn) = _bmm_layout(x, p_bytes, s_bytes, bk2, bn)
    (gx, m, kh), (g, _, n) = xe.shape, p_bytes.shape
    nk, nn = kh // bk2, n // bn
    rows = (lambda e, j, k: (0, 0, 0)) if gx == 1 else (lambda e, j, k: (e, 0, 0))
    weight = lambda e, j, k: (e, k, j)
    itemsize = jnp.dtype(xe.dtype).itemsize
    return pl.pallas_call(
        _bmm_kernel,
        out_shape=jax.ShapeDtypeStruct((g, m, n), out_dtype),
        grid=(g, nn, nk),
        in_specs=[pl.BlockSpec((1, m, kh), rows), pl.BlockSpec((1, m, kh), rows),
                  pl.BlockSpec((1, bk2, bn), weight), pl.BlockSpec((1, bk2 // (BLOCK // 2), bn), weight)],
        out_specs=pl.BlockSpec((1, m, bn), lambda e, j, k: (e, 0, j)),
        scratch_shapes=[_vmem((m, bn))],
        interpret=interpret,
        compiler_params=None if interpret else _params(),
        cost_estimate=pl.CostEstimate(flops=4 * g * m * kh * n, transcendentals=0,
                                      bytes_accessed=2 * xe.size * itemsize + p_bytes.size + s_bytes.size
                                      + g * m * n * jnp.dtype(out_dtype).itemsize),
        name="mxfp4_batched_matmul",
    )(xe, xo, p_bytes, s_bytes)


def mxfp4_bmm_reference(x, p_bytes, s_bytes, *, bk2: int = 512, bn: int = 1024, out_dtype=jnp.float32):
    """`mxfp4_bmm` in plain JAX: the same tiles decoded the same way and summed in the same order."""
    xe, xo, (bk2, bn) = _bmm_layout(x, p_bytes, s_bytes, bk2, bn)
    g, n = p_bytes.shape[0], p_bytes.shape[2]
    pr = _precision(xe.dtype)
    out = []
    for e in range(g):
        a, b = xe[0 if xe.shape[0] == 1 else e], xo[0 if xo.shape[0] == 1 else e]
        cols = []
        for j in range(0, n, bn):
            acc = jnp.zeros((a.shape[0], bn), jnp.float32)
            for k in range(0, a.shape[1], bk2):
                even, odd = _mxfp4_tiles(p_bytes[e, k:k + bk2, j:j + bn],
                                         s_bytes[e, k // (BLOCK // 2):(k + bk2) // (BLOCK // 2), j:j + bn], a.dtype)
                acc = acc + (jnp.dot(a[:, k:k + bk2], even, preferred_element_type=jnp.float32, precision=pr)
                             + jnp.dot(b[:, k:k + bk2], odd, preferred_element_type=jnp.float32, precision=pr))
            cols.append(acc.astype(out_dtype))
        out.append(jnp.concatenate(cols, axis=1))
    return jnp.stack(out)
