"""The one softmax every attention path runs (DESIGN §3.2): window keys, each query's selected entries
and, for V4's HCA layers, entries every query of the row may see, with a per-head sink in the
denominator; and `Handoff`, what a layer hands the later layers that read it.

The teacher-forced layers (`attention.Attention`), the cached step (`Attention.step`) and the Pallas
kernels' references (`dsv41.kernels`) all call `attend_step`; it depends on JAX alone.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

NEG_INF = -jnp.inf
HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Handoff:
    """What a layer hands the later layers that name it as a source (`LayerRecord.kv_source`,
    `index_source`, `candidate_source`): returned by its attention, passed along keyed by its layer
    number, never mutated. Fields a layer does not produce are None.

    entries [B, T, K], index_keys [B, T, dI]: a compressing layer's rotated entries and indexer keys
    (the whole-sequence form; the cached step's layers read them from the store instead).
    picks [B, S, k]: an index source's top-k entry ids (−1: none); selected [B, S, T]: the same as a mask
    (whole-sequence form). pool_ids [B, S, M]: the candidate source's pool as block ids, ascending then
    −1 (cached step); pool [B, S, T]: the pool as an entry mask (whole-sequence form). stored: the entries as
    the cache stores them, (bytes [B, T, K/2], scale bytes [B, T, K/16]), where the whole-sequence forward's
    attention kernel reads them (`Attention.training_kernel`)."""

    entries: jax.Array | None = None
    index_keys: jax.Array | None = None
    picks: jax.Array | None = None
    selected: jax.Array | None = None
    pool_ids: jax.Array | None = None
    pool: jax.Array | None = None
    stored: tuple | None = None


jax.tree_util.register_dataclass(Handoff, data_fields=[f.name for f in dataclasses.fields(Handoff)],
                                 meta_fields=[])


def window_mask(q_pos_BS, k_pos_BT, window: int):
    """[B, S, T] bool: key position in (q - window, q]."""
    delta = q_pos_BS[..., :, None] - k_pos_BT[..., None, :]
    return (delta >= 0) & (delta < window)


def window_keys(keys_BTK, key_pos_BT, key_ok_BT, positions_BS, window: int):
    """The window keys of S queries and their mask, from [ring (W) | new tokens (S)].

    S < 2W: every query against all W + S keys ([B, W+S, K], mask [B, S, W+S]). Longer chunks are
    banded: the queries of block n (W of them) only reach keys n·W … n·W + 2W − 1 of that list, so the
    keys come as blocks [B, n, 2W, K] with a mask [B, n·W, 2W] — the cost grows as S·W, not S²."""
    s = positions_BS.shape[1]
    if s < 2 * window:
        delta = positions_BS[:, :, None] - key_pos_BT[:, None, :]
        return keys_BTK, key_ok_BT[:, None, :] & (delta >= 0) & (delta < window)
    nb = -(-s // window)
    pad = window + nb * window - keys_BTK.shape[1]
    keys = jnp.pad(keys_BTK, [(0, 0), (0, pad), (0, 0)])
    pos = jnp.pad(key_pos_BT, [(0, 0), (0, pad)], constant_values=-1)
    ok = jnp.pad(key_ok_BT, [(0, 0), (0, pad)])

    def blocks(x):
        lo = x[:, : nb * window].reshape(x.shape[0], nb, window, *x.shape[2:])
        hi = x[:, window: window + nb * window].reshape(x.shape[0], nb, window, *x.shape[2:])
        return jnp.concatenate([lo, hi], axis=2)

    qpos = jnp.pad(positions_BS, [(0, 0), (0, nb * window - s)], constant_values=-1).reshape(-1, nb, window)
    delta = qpos[..., None] - blocks(pos)[:, :, None, :]
    mask = blocks(ok)[:, :, None, :] & (delta >= 0) & (delta < window)
    return blocks(keys), mask.reshape(mask.shape[0], nb * window, 2 * window)


def band_source(kv_BSK, positions_BS, window: int, length: int, start_B=None):
    """(keys [B, W + L, K], their positions, their validity) of a whole sequence's window keys for
    `over_query_blocks`: W invalid keys in front and the sequence padded to L (≥ S) behind, so that the
    queries of block n (block size Q) find their window band at keys n·Q … n·Q + Q + W − 1. start_B: keys
    before row b's start[b] are not valid (`window_from`)."""
    b, s = positions_BS.shape
    pad = [(0, 0), (window, length - s)]
    return (jnp.pad(kv_BSK, pad + [(0, 0)]), jnp.pad(positions_BS, pad, constant_values=-1),
            jnp.pad(window_from(positions_BS, start_B), pad))


def window_from(positions_BS, start_B=None):
    """[B, S] bool: the tokens a window may hold, those at or after row b's start_B[b] (all when None): the
    CED split's decoder layers see the replayed span of each row's prompt and what follows (DESIGN §3.5)."""
    if start_B is None:
        return jnp.ones(positions_BS.shape, bool)
    return positions_BS >= start_B[:, None]


def spec_entry(names: tuple[str, ...]):
    """The PartitionSpec entry of a dimension split over mesh axes `names`: None, one name or the tuple."""
    return None if not names else names[0] if len(names) == 1 else names


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """Sequence (context) parallelism on a mesh (`Lowering.sequence`): the token rows split over `batch_axes`,
    each row's tokens cut into `lanes` contiguous spans over `seq_axes` (major first). The whole-sequence
    forward then runs its query blocks one per lane at a time (`over_query_blocks`), each lane on the devices
    holding its span, and the keys every lane reads (window keys, compressed entries, indexer keys: one shared
    head's width per token or per compressed group, small beside the residual streams) are gathered whole once
    per layer (`whole`)."""
    mesh: Mesh
    batch_axes: tuple[str, ...]
    seq_axes: tuple[str, ...]

    @property
    def lanes(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.seq_axes)

    def _constrain(self, x, dims: dict):
        spec = [None] * x.ndim
        for dim, names in dims.items():
            spec[dim] = spec_entry(names)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(*spec)))

    def split(self, x, seq_dim: int = 1, batch_dim: int = 0):
        """x [B, S, ...] (or None) held as its rows over the batch axes and its tokens over the sequence axes
        (dims batch_dim and seq_dim)."""
        return None if x is None else self._constrain(x, {batch_dim: self.batch_axes, seq_dim: self.seq_axes})

    def whole(self, x):
        """x [B, T, ...] (or None) held whole on every lane (its rows still over the batch axes)."""
        return None if x is None else self._constrain(x, {0: self.batch_axes})


def lanes_of(sequence) -> int:
    return 1 if sequence is None else sequence.lanes


def blocks_length(s: int, block: int, sequence=None) -> int:
    """The length `over_query_blocks` pads a sequence of s tokens to: whole blocks, as many per lane."""
    per = block * lanes_of(sequence)
    return -(-s // per) * per


def over_query_blocks(fn, block: int, *arrays, pads, remat: bool = True, sequence: SequenceLayout | None = None):
    """fn(n, *blocks) over the blocks of `block` queries of a sequence, as one `lax.scan`: each array [B, S, …]
    (or None) is padded to a whole number of blocks with its value in `pads` and cut into blocks [B, Q, …];
    fn returns a pytree of [B, Q, …] arrays (or None), stitched back to [B, S, …]. remat: each block under
    `jax.checkpoint`, so that the backward pass keeps a block's inputs only (memory linear in S).

    sequence (a `SequenceLayout` of L lanes): the sequence is cut into L contiguous spans of M blocks each and
    the scan runs M steps, each applying fn to one block of every span at once (vmapped; block n = l·M + m),
    every span on the devices that hold it: the same blocks and results, L at a time."""
    s = next(a for a in arrays if a is not None).shape[1]
    lanes = lanes_of(sequence)
    total = blocks_length(s, block, sequence)
    nb = total // (block * lanes)  # scan steps (blocks per lane)
    body = jax.checkpoint(fn, prevent_cse=False) if remat else fn
    if lanes > 1:
        # The lanes live on the sequence axes: a kernel's shard_map inside the body (`modes.per_device`) then
        # runs each lane's block on the devices that hold it.
        body = jax.vmap(body, in_axes=(0,) + (1,) * len(arrays), out_axes=1, spmd_axis_name=sequence.seq_axes)

    def cut(a, value):  # [B, S, …] -> [nb, B, Q, …], or [nb, B, L, Q, …] over lanes
        if a is None:
            return None
        a = jnp.pad(a, [(0, 0), (0, total - s)] + [(0, 0)] * (a.ndim - 2), constant_values=value)
        if lanes == 1:
            return jnp.moveaxis(a.reshape(a.shape[0], nb, block, *a.shape[2:]), 1, 0)
        a = jnp.moveaxis(a.reshape(a.shape[0], lanes, nb, block, *a.shape[2:]), 2, 0)
        return sequence.split(a, seq_dim=2, batch_dim=1)

    def stitch(o):  # back to [B, S, …]
        if lanes == 1:
            return jnp.moveaxis(o, 0, 1).reshape(o.shape[1], total, *o.shape[3:])[:, :s]
        o = jnp.moveaxis(o, 0, 2)
        return sequence.split(o.reshape(o.shape[0], total, *o.shape[4:])[:, :s])

    ids = jnp.arange(nb, dtype=jnp.int32)
    if lanes > 1:
        ids = ids[:, None] + nb * jnp.arange(lanes, dtype=jnp.int32)[None, :]
    xs = (ids, *(cut(a, v) for a, v in zip(arrays, pads, strict=True)))
    _, out = jax.lax.scan(lambda carry, x: (carry, body(*x)), None, xs)
    return jax.tree.map(stitch, out)


def attend_step(q_BSHK, keys_w, mask_w, sel_BSkK, sel_ok_BSk, sink_H, scale: float, shared=None):
    """One softmax with the sink over the window keys (shared by the chunk, or banded blocks from
    `window_keys`), each query's own selected entries and, when given, `shared` = (keys [B, T, K],
    mask [B, S, T]) that every query of the row may see (a V4 HCA layer's entries); a row with nothing
    valid gives 0.

    Every part keeps the queries' layout [B, S, H, ·] (banded: [B, n, W, H, 2W]), so each einsum is a
    plain batched matmul with no transposes, and the parts share one max and one denominator instead of
    being concatenated."""
    b, s, h, k = q_BSHK.shape
    banded = keys_w.ndim == 4
    if banded:
        nb, span = keys_w.shape[1], keys_w.shape[2]
        padded = nb * (span // 2)
        qb = jnp.pad(q_BSHK, [(0, 0), (0, padded - s), (0, 0), (0, 0)]).reshape(b, nb, span // 2, h, k)
        lw = jnp.einsum("bnqhk,bntk->bnqht", qb, keys_w, preferred_element_type=jnp.float32, precision=HI)
        lw = lw.reshape(b, padded, h, span)
        mask_w = jnp.pad(mask_w[:, :s], [(0, 0), (0, padded - s), (0, 0)])
    else:
        lw = jnp.einsum("bshk,btk->bsht", q_BSHK, keys_w, preferred_element_type=jnp.float32, precision=HI)

    def pad(x):  # [B, S, ...] -> [B, padded, ...] (banded), for the parts that meet the window's logits
        return jnp.pad(x, [(0, 0), (0, lw.shape[1] - s)] + [(0, 0)] * (x.ndim - 2))

    # (logits [B, S', H, ·], the values they weigh, the einsum that weighs them); the window's first.
    parts = [(jnp.where(mask_w[:, :, None], lw * scale, NEG_INF), keys_w, None)]
    if sel_BSkK is not None:
        lc = jnp.einsum("bshk,bsjk->bshj", q_BSHK, sel_BSkK, preferred_element_type=jnp.float32, precision=HI)
        parts.append((pad(jnp.where(sel_ok_BSk[:, :, None], lc * scale, NEG_INF)), sel_BSkK, "bshj,bsjk->bshk"))
    if shared is not None:
        keys_s, mask_s = shared
        ls = jnp.einsum("bshk,btk->bsht", q_BSHK, keys_s, preferred_element_type=jnp.float32, precision=HI)
        parts.append((pad(jnp.where(mask_s[:, :, None], ls * scale, NEG_INF)), keys_s, "bsht,btk->bshk"))
    sink = sink_H.astype(jnp.float32)
    top = sink
    for logits, _, _ in parts:
        top = jnp.maximum(top, jnp.max(logits, axis=-1))
    top = jax.lax.stop_gradient(top)[..., None]                       # [B, S', H, 1]
    exps = [jnp.exp(logits - top) for logits, _, _ in parts]
    denominator = jnp.exp(sink[:, None] - top) + sum(jnp.sum(e, axis=-1, keepdims=True) for e in exps)
    probs = [e / denominator for e in exps]
    if banded:
        p = probs[0].reshape(b, nb, span // 2, h, span).astype(keys_w.dtype)
        out = jnp.einsum("bnqht,bntk->bnqhk", p, keys_w, precision=HI).reshape(b, padded, h, k)
    else:
        out = jnp.einsum("bsht,btk->bshk", probs[0].astype(keys_w.dtype), keys_w, precision=HI)
    out = out[:, :s]
    for p, (_, values, spec) in zip(probs[1:], parts[1:]):
        out = out + jnp.einsum(spec, p[:, :s].astype(values.dtype), values, precision=HI)
    return out
