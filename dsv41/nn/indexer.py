"""The lightning indexer and the hierarchical candidate pool (DESIGN §3.4).

Keys (Full layers): kI = fp4(rope(k_norm(wk latent))) from the pre-RoPE compressed latent.
Queries (Full and Reindex layers): qI = fp4(rope(wq_b qr)) [B,S,J,dI]; weights w = weights_proj(x)·J^-½.
Score I[t, i] = Σ_j w[t, j] · relu(qI[t, j] · kI[i]) · dI^-½, −inf where entry i is not visible to t.
The candidate source keeps the best `max_blocks` blocks of `positions_per_block` entries (block score =
max over the block; the block of the newest visible entry is always kept); Reindex layers choose their
top-k inside that pool only.
V4 (compat, DESIGN §3.4): `IndexerV4`, 64 heads, keys from its own overlapped ratio-4 compressor;
its top-k is unsorted in the reference, which does not change the attended set.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dsv41 import quant
from dsv41.kv_store import LayerStore, dequant_keys
from dsv41.nn.attend import spec_entry
from dsv41.nn.compressor import CompressorV4
from dsv41.nn.linear import Dense
from dsv41.nn.norm import RMSNorm
from dsv41.nn.policy import Policy
from dsv41.nn.rope import apply_rope

NEG_INF = -jnp.inf


class Indexer(nnx.Module):
    rotate = False  # V4's indexer rotates keys and queries before FP4 (`IndexerV4`)

    def __init__(self, dim: int, q_lora: int, latent: int, heads: int, head_dim: int, owns_keys: bool,
                 eps: float, *, policy: Policy, rngs: nnx.Rngs):
        self.heads, self.head_dim = heads, head_dim
        self.unroll = policy.lowering.unroll_index_heads
        self.wq_b = Dense(q_lora, heads * head_dim, ("q_lora", "index_heads"), policy=policy, rngs=rngs, shipped=True)
        self.weights_proj = Dense(dim, heads, ("embed", "index_heads"), policy=policy, rngs=rngs)
        if owns_keys:
            self.wk = Dense(latent, head_dim, ("kv", "index_dim"), policy=policy, rngs=rngs)
            self.k_norm = RMSNorm(head_dim, eps, "index_dim")
        else:
            self.wk = self.k_norm = None

    def keys(self, latent_BTK, positions_BT, inv_freq, fake_quant: bool):
        """Indexer keys [B, T, dI] of compressed latents at their RoPE positions."""
        k = apply_rope(self.k_norm(self.wk(latent_BTK)), positions_BT, inv_freq)
        return self.fake_quant(k) if fake_quant else k

    def rotated(self, x):
        """Keys or queries [..., dI] as they are quantised: Hadamard-rotated where the indexer rotates (V4)."""
        return quant.hadamard(x) if self.rotate else x

    def fake_quant(self, x):
        """Keys or queries [..., dI] stored as MXFP4 and read back (`quant: qat`), rotated first where the indexer
        rotates; the rotation is orthonormal, so unquantised scores are the same with or without it."""
        return quant.fake_quant(self.rotated(x), quant.MXFP4)

    def query(self, x_BSD, qr_BSQ, positions_BS, inv_freq, fake_quant: bool = False):
        """(qI [B, S, J, dI], w [B, S, J]): the rotated queries (MXFP4 under fake-quant) and the head weights
        (the teacher-forced scores and the cached step's, which score them against stored keys)."""
        b, s, _ = x_BSD.shape
        q = apply_rope(self.wq_b(qr_BSQ).reshape(b, s, self.heads, self.head_dim), positions_BS, inv_freq)
        if fake_quant:
            q = self.fake_quant(q)
        return q, self.weights_proj(x_BSD)

    def scores(self, x_BSD, qr_BSQ, positions_BS, keys_BTd, visible_BST, inv_freq, fake_quant: bool = False):
        """Index scores I [B, S, T] in fp32, −inf where not visible."""
        q, w = self.query(x_BSD, qr_BSQ, positions_BS, inv_freq, fake_quant)
        return lightning_scores(q, keys_BTd, w, visible_BST, self.unroll)


class IndexerV4(Indexer):
    """The V4 (compat) indexer: its keys come from its own overlapped compressor over the layer input.

    kI = rope(CompressorV4(x)) at index_head_dim, rotated at the entries' positions; the query and the
    score are the V4.1 indexer's (`query`, `scores`). Under `quant: qat` keys and queries are Hadamard-rotated
    (`v4.indexer.hadamard`) and then MXFP4, as V4's official inference stores them; the released transformers
    V4 runs without fake quantisation, where the orthonormal rotation would change nothing.
    """

    def __init__(self, dim: int, q_lora: int, heads: int, head_dim: int, ratio: int, eps: float, *,
                 rotate: bool, policy: Policy, rngs: nnx.Rngs):
        self.heads, self.head_dim, self.ratio = heads, head_dim, ratio
        self.rotate = rotate  # `v4.indexer.hadamard`: rotate keys and queries before FP4
        self.unroll = policy.lowering.unroll_index_heads
        self.compressor = CompressorV4(dim, head_dim, ratio, True, eps, policy=policy, rngs=rngs)
        self.wq_b = Dense(q_lora, heads * head_dim, ("q_lora", "index_heads"), policy=policy, rngs=rngs, shipped=True)
        self.weights_proj = Dense(dim, heads, ("embed", "index_heads"), policy=policy, rngs=rngs)

    def keys(self, x_BSD, inv_freq, fake_quant: bool = False):
        """Indexer keys [B, S // ratio, dI] of the complete windows of x, entry i rotated at ratio·i (with
        `fake_quant`, as stored: Hadamard-rotated and MXFP4)."""
        latent = self.compressor(x_BSD)
        k = apply_rope(latent, entry_positions(latent, self.ratio), inv_freq)
        return self.fake_quant(k) if fake_quant else k



def lightning_scores(q_BSJd, keys_BTd, w_BSJ, visible_BST, unroll: bool = False, group: int | None = None):
    """I[t, i] = Σ_j w[t, j]·J^-½ · relu(q[t, j] · k[i]) · dI^-½ in fp32, −inf where not visible.

    Accumulated over groups of heads (`_accumulate`): the per-head scores [B, S, J, T] are materialised only
    where they are small. unroll: the head loop traced unrolled (`Lowering.unroll_index_heads`: XLA's cost
    analysis counts a loop body once, so FLOP reports trace it unrolled); the arithmetic is the same. group: the
    heads scored at once (None: `heads_per_group`); 1 suits XLA:CPU, which sums the heads of a group
    [B, S, c, T] an order of magnitude slower than it adds one head's [B, S, T] scores at a time."""
    keys = keys_BTd.astype(jnp.float32)
    return _accumulate(q_BSJd, w_BSJ, visible_BST, lambda q_BScd: jnp.einsum(
        "bscd,btd->bsct", q_BScd, keys, precision=jax.lax.Precision.HIGHEST), unroll, group)


@jax.custom_vjp
def lightning_scores_trained(q_BSJd, keys_BTd, w_BSJ, visible_BST):
    """`lightning_scores(..., group=1)` (the same values) for the indexer's KL, whose gradient this forms itself,
    one head at a time: per head h, with g the scores' cotangent where visible and s = q_h · k,
    dw_h = c·Σ_t g·relu(s), ds = c·w_h·g·[s > 0], dq_h = ds · K, dK += ds^T · q_h (c = J^-½·dI^-½). XLA:CPU's
    own derivative of the head loop sums dw_h with a slow reduce fusion and copies each head's [S, T] cotangent
    transposed for dK: one block of 512 queries against 16,384 keys, forward and backward, 382 → 209 ms on
    this 2-core machine (the same gradients to 2e-7 of their largest); the passkey model's dense warm-up KL alone
    at 16K tokens, 14.7 → 11.7 s, though the whole train step moved within its spread (docs/training_memory.md)."""
    return lightning_scores(q_BSJd, keys_BTd, w_BSJ, visible_BST, group=1)


def _trained_fwd(q_BSJd, keys_BTd, w_BSJ, visible_BST):
    return lightning_scores_trained(q_BSJd, keys_BTd, w_BSJ, visible_BST), (q_BSJd, keys_BTd, w_BSJ, visible_BST)


def _trained_bwd(res, g_BST):
    q_BSJd, keys_BTd, w_BSJ, visible_BST = res
    heads, head_dim = q_BSJd.shape[-2:]
    c = heads ** -0.5 * head_dim ** -0.5
    hi = jax.lax.Precision.HIGHEST
    q, keys, w = (a.astype(jnp.float32) for a in (q_BSJd, keys_BTd, w_BSJ))
    g = jnp.where(visible_BST, g_BST, 0.0)

    def head(h, acc):
        dq, dk, dw = acc
        q_h = jax.lax.dynamic_index_in_dim(q, h, axis=2, keepdims=False)  # [B, S, d]
        w_h = jax.lax.dynamic_index_in_dim(w, h, axis=2, keepdims=False)  # [B, S]
        s = jnp.einsum("bsd,btd->bst", q_h, keys, precision=hi)
        g_s = jnp.where(s > 0, g, 0.0)
        dw_h = jnp.einsum("bst,bst->bs", g_s, s, precision=hi) * c  # a dot, not a reduce (above)
        ds = g_s * (w_h * c)[..., None]
        dq = jax.lax.dynamic_update_index_in_dim(dq, jnp.einsum("bst,btd->bsd", ds, keys, precision=hi), h, axis=2)
        dk = dk + jnp.einsum("bsd,bst->btd", q_h, ds, precision=hi)
        return dq, dk, jax.lax.dynamic_update_index_in_dim(dw, dw_h, h, axis=2)

    dq, dk, dw = jax.lax.fori_loop(0, heads, head, (jnp.zeros_like(q), jnp.zeros_like(keys), jnp.zeros_like(w)))
    return dq.astype(q_BSJd.dtype), dk.astype(keys_BTd.dtype), dw.astype(w_BSJ.dtype), None


lightning_scores_trained.defvjp(_trained_fwd, _trained_bwd)


def lightning_scores_per_query(q_BSJd, keys_BSPd, w_BSJ, visible_BSP, unroll: bool = False,
                               group: int | None = None):
    """`lightning_scores` against keys gathered per query (the candidate pool): [B, S, P]."""
    keys = keys_BSPd.astype(jnp.float32)
    return _accumulate(q_BSJd, w_BSJ, visible_BSP, lambda q_BScd: jnp.einsum(
        "bscd,bspd->bscp", q_BScd, keys, precision=jax.lax.Precision.HIGHEST), unroll, group)


# The head groups of `_accumulate` hold at most this many per-head scores (fp32, the whole step's rows): a
# decode step scores every head at once and reads its keys once (one head at a time, full-size V4.1-Flash
# decode read each Reindex layer's gathered pool keys 32 times: 4.3 of its 125 GB per chip per step); a
# prefill chunk's scores, hundreds of times larger, go one head at a time.
SCORES_PER_GROUP = 2**25


def heads_per_group(batch: int, seq: int, heads: int, keys: int) -> int:
    """The largest number of heads dividing `heads` whose scores [B, S, c, T] stay within SCORES_PER_GROUP."""
    return max([c for c in range(1, heads + 1) if heads % c == 0 and batch * seq * c * keys <= SCORES_PER_GROUP],
               default=1)


def _accumulate(q_BSJd, w_BSJ, visible_BST, dots, unroll: bool, group: int | None = None):
    """Σ_j w_j·J^-½ · relu(dots(q_j)) · dI^-½ over the heads j, in groups of `group` heads (None:
    `heads_per_group`): dots maps queries [B, S, c, d] to their scores [B, S, c, T]."""
    heads, head_dim = q_BSJd.shape[-2:]
    b, s, t = visible_BST.shape
    c = heads_per_group(b, s, heads, t) if group is None else group
    q = q_BSJd.astype(jnp.float32).reshape(b, s, heads // c, c, head_dim)
    w = (w_BSJ.astype(jnp.float32) * heads ** -0.5).reshape(b, s, heads // c, c)

    def group(g, acc):
        scores = jax.nn.relu(dots(q[:, :, g])) * head_dim ** -0.5 * w[:, :, g, :, None]
        return acc + scores.sum(axis=2)

    init = jnp.zeros(visible_BST.shape, jnp.float32)
    if unroll or heads == c:
        scores = init
        for g in range(heads // c):
            scores = group(g, scores)
    else:
        scores = jax.lax.fori_loop(0, heads // c, group, init)
    return jnp.where(visible_BST, scores, NEG_INF)


def entry_positions(entries_BTK, ratio: int):
    """[B, T] RoPE positions of compressed entries: entry i sits at its window's first token, ratio·i."""
    return ratio * jnp.broadcast_to(jnp.arange(entries_BTK.shape[1]), entries_BTK.shape[:2])


def visible_entries(positions_BS, ratio: int, num_entries: int):
    """[B, S, T] bool: entry i is visible to the query at position p iff i < (p + 1) // ratio."""
    return jnp.arange(num_entries)[None, None, :] < ((positions_BS + 1) // ratio)[..., None]


def top_k_indices(scores_BST, k: int, top_k=jax.lax.top_k):
    """The top-k entries per query, sorted ascending, −1 where fewer than k are reachable. [B, S, k]. top_k: the
    `jax.lax.top_k` to use (`RowSplit.top_k` on a mesh)."""
    k_eff = min(k, scores_BST.shape[-1])
    values, idx = top_k(scores_BST, k_eff)
    idx = jnp.where(values > NEG_INF, idx, scores_BST.shape[-1])
    idx = jnp.sort(idx, axis=-1)
    idx = jnp.where(idx == scores_BST.shape[-1], -1, idx)
    if k_eff < k:
        idx = jnp.pad(idx, [(0, 0)] * (idx.ndim - 1) + [(0, k - k_eff)], constant_values=-1)
    return idx


def pool_top_k(scores_BSP, entry_BSP, k: int):
    """`top_k_indices` over scores of gathered candidates (the candidate pool's entries, ascending; −inf where
    not usable): the entry ids [B, S, k] of the best k, sorted ascending, −1 padded. Among equal scores the
    lower entry id wins, as over the whole store."""
    local = top_k_indices(scores_BSP, k)
    picks = jnp.where(local >= 0, jnp.take_along_axis(entry_BSP, jnp.maximum(local, 0), axis=-1), -1)
    picks = jnp.sort(jnp.where(picks < 0, jnp.iinfo(jnp.int32).max, picks), axis=-1)
    return jnp.where(picks == jnp.iinfo(jnp.int32).max, -1, picks)


def visible_picks(visible_count_BS, num_entries: int, k: int):
    """`top_k_indices` of scores finite on each query's visible entries when k ≥ num_entries: every visible
    entry, ascending, then −1s ([B, S, k]; the scores cannot change the set, so none are computed)."""
    idx = jnp.arange(num_entries, dtype=jnp.int32)
    picks = jnp.where(idx < visible_count_BS[..., None], idx, -1)
    return jnp.pad(picks, [(0, 0)] * (picks.ndim - 1) + [(0, k - num_entries)], constant_values=-1)


def indices_to_mask(idx_BSk, num_entries: int):
    """[B, S, T] bool mask of the picked entries (−1 picks nothing)."""
    return block_ids_to_mask(idx_BSk, num_entries)


def candidate_block_ids(scores_BST, visible_count_BS, max_blocks: int, block: int, top_k=jax.lax.top_k):
    """[B, S, max_blocks] int32: the blocks kept in the candidate pool, ascending, −1 padded (DESIGN §3.4).

    Block score = max of I over its `block` entries; the block of the newest visible entry is always kept.
    top_k: as `top_k_indices`'.
    """
    t = scores_BST.shape[-1]
    pad = -t % block
    padded = jnp.pad(scores_BST, [(0, 0), (0, 0), (0, pad)], constant_values=NEG_INF)
    block_scores = padded.reshape(*scores_BST.shape[:-1], -1, block).max(axis=-1)
    n_blocks = block_scores.shape[-1]
    newest = (visible_count_BS - 1) // block  # −1 (nothing visible) pins nothing
    block_scores = jnp.where(jnp.arange(n_blocks) == newest[..., None], jnp.inf, block_scores)
    values, idx = top_k(block_scores, min(max_blocks, n_blocks))
    ids = jnp.sort(jnp.where(values > NEG_INF, idx, n_blocks), axis=-1)
    ids = jnp.where(ids == n_blocks, -1, ids).astype(jnp.int32)
    if ids.shape[-1] < max_blocks:
        ids = jnp.pad(ids, [(0, 0), (0, 0), (0, max_blocks - ids.shape[-1])], constant_values=-1)
    return ids


def _merge_best(best, values, ids, n: int, top_k=jax.lax.top_k):
    """The best n of the running best (values, ids) and a new set's, one top-k over both: the running best
    come first, so among equal values they keep their place (`jax.lax.top_k` keeps the earlier), and with
    them the lower ids wherever each new set holds higher ids than the sets before it."""
    cat_v, cat_i = jnp.concatenate([best[0], values], -1), jnp.concatenate([best[1], ids], -1)
    v, i = top_k(cat_v, n)
    return v, jnp.take_along_axis(cat_i, i, -1)


@dataclasses.dataclass(frozen=True)
class RowSplit:
    """Token rows [B, …] split over mesh axes (B a multiple of their size): `filled_top_k`'s running best is
    held so and merged one device's rows at a time (`top_k`), so its loop holds no collective."""
    mesh: Mesh
    axes: tuple[str, ...]

    @property
    def _spec(self):
        return P(spec_entry(self.axes))

    def place(self, x):
        """x [B, …] held as the rows are."""
        spec = P(*self._spec, *([P.UNCONSTRAINED] * (x.ndim - 1)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def top_k(self, values, n: int):
        """`jax.lax.top_k` on each device's rows: left to itself, XLA gathers every row onto every device
        for a top_k (it partitions a sort over split rows, not a top_k)."""
        return jax.shard_map(lambda v: tuple(jax.lax.top_k(v, n)), mesh=self.mesh, in_specs=self._spec,
                             out_specs=(self._spec, self._spec))(values)

    def per_device(self, fn, *args):
        """fn(*args) -> [B, …] run on each device's rows (a `jax.shard_map`): args are arrays [B, …] split as
        the rows are, or `LayerStore`s whose leaves are [B, …] or stacked [G, B, …] (the layer index the
        same on every device). fn sees only its device's rows, so it needs no collective (a gather from a
        store's split rows, left to XLA, all-gathered its indices and all-reduced what it read)."""
        entry = spec_entry(self.axes)
        parts, specs = [], []
        for a in args:
            if isinstance(a, LayerStore):  # its rows (or row groups, `LayerStore.split_rows`) split
                lead = () if a.layer is None else (None,)
                index = lambda i: None if i is None else jnp.asarray(i, jnp.int32)
                parts.append((a.leaves, index(a.layer), index(a.row)))
                specs.append(({k: P(*lead, entry) for k in a.leaves}, None if a.layer is None else P(),
                              None if a.row is None else P()))
            else:
                parts.append(a)
                specs.append(P(entry))

        def local(*xs):  # each device's rows; its own loop trip counts (check_vma: they differ by device)
            return fn(*(LayerStore(*x) if isinstance(a, LayerStore) else x for a, x in zip(args, xs)))

        return jax.shard_map(local, mesh=self.mesh, in_specs=tuple(specs), out_specs=P(entry),
                             check_vma=False)(*parts)


def _empty_best(rows_BS: tuple, n: int, sentinel: int):
    return jnp.full((*rows_BS, n), NEG_INF, jnp.float32), jnp.full((*rows_BS, n), sentinel, jnp.int32)


def _finish_best(best, sentinel: int, width: int):
    """The running best's ids with a finite score, ascending, −1 padded to `width`."""
    ids = jnp.sort(jnp.where(best[0] > NEG_INF, best[1], sentinel), axis=-1)
    ids = jnp.where(ids == sentinel, -1, ids).astype(jnp.int32)
    return jnp.pad(ids, [(0, 0), (0, 0), (0, width - ids.shape[-1])], constant_values=-1)


def filled_top_k(tile_scores, rows_BS: tuple, num_entries: int, tile: int, filled, k: int, pool=None, rows=None):
    """`top_k_indices` (and `candidate_block_ids`) over the filled tiles of a store only (DESIGN §6: a row's
    cost follows its length, not the cache's capacity).

    tile_scores(start) -> [B, S, tile] scores of entries start … start + tile − 1 (−inf where not
    selectable), rows_BS = (B, S); num_entries: the store's capacity T (≥ tile; the last tile starts at
    T − tile and drops what earlier tiles saw); filled: a traced count of the entries any query may see, so
    ceil(filled / tile) tiles run (a loop with that trip count). pool: None, or (max_blocks, block,
    visible_count_BS) to also choose the candidate pool (tile and T multiples of block). rows: None, or the
    `RowSplit` of the rows on a mesh: the loop then holds no collective (with a plain `jax.lax.top_k` XLA
    gathered every row's scores onto every device each trip, and on simulated CPU devices a collective in
    this loop could deadlock the program: docs/simulated_devices.md).
    Returns (picks [B, S, k], pool block ids [B, S, max_blocks] or None), equal to scoring every entry:
    top-k keeps the lowest index among equal scores, and so does each merge of the running best with a
    tile's (the running best come first and hold lower indices)."""
    b, s = rows_BS
    k_eff = min(k, num_entries)
    state = {"picks": _empty_best(rows_BS, k_eff, num_entries)}
    if pool is not None:
        max_blocks, block, visible_count = pool
        n_blocks = num_entries // block
        newest = (visible_count - 1) // block
        state["pool"] = _empty_best(rows_BS, min(max_blocks, n_blocks), n_blocks)
    pick = jax.lax.top_k
    if rows is not None:
        state, pick = jax.tree.map(rows.place, state), rows.top_k

    def step(t, state):
        start = jnp.minimum(t * tile, num_entries - tile)  # the last tile may overlap the one before
        entry = start + jnp.arange(tile, dtype=jnp.int32)
        scores = jnp.where(entry >= t * tile, tile_scores(start), NEG_INF)  # each entry once
        ids = jnp.broadcast_to(entry, scores.shape)
        out = {"picks": _merge_best(state["picks"], scores, ids, k_eff, pick)}
        if pool is not None:
            block_ids = start // block + jnp.arange(tile // block, dtype=jnp.int32)
            block_scores = scores.reshape(b, s, -1, block).max(-1)
            block_scores = jnp.where(block_ids == newest[..., None], jnp.inf, block_scores)
            block_scores = jnp.where(block_ids * block >= t * tile, block_scores, NEG_INF)
            out["pool"] = _merge_best(state["pool"], block_scores, jnp.broadcast_to(block_ids, block_scores.shape),
                                      state["pool"][0].shape[-1], pick)
        return out

    trips = (jnp.minimum(filled, num_entries) + tile - 1) // tile
    state = jax.lax.fori_loop(0, trips, step, state)
    picks = _finish_best(state["picks"], num_entries, k)
    return picks, (None if pool is None else _finish_best(state["pool"], n_blocks, max_blocks))


def pool_chunks_top_k(q_BSJd, w_BSJ, keys, block_ids_BSn, block: int, visible_BS, k: int, chunk_blocks: int,
                      unroll: bool = False, group: int | None = None, rows=None):
    """`pool_top_k` of the lightning scores over a candidate pool's entries (block ids [B, S, n], ascending,
    −1 padded), `chunk_blocks` pool blocks at a time with a running top-k: the gathered keys held at once
    are [B, S, chunk_blocks·block, dI], not the whole pool's, and only the chunks some query's pool reaches
    run (a loop with that trip count; the −1 padding is at the end). Equal to `pool_top_k` over the whole
    pool: the chunks' entries ascend, so each merge keeps the lower id among equal scores, as it does.
    keys: the keys [B, T, dI], or the index store (`kv_store.LayerStore`) of the pool's Full layer, read a
    chunk's entries at a time (a Reindex layer's decode: one chunk's code, not the whole pool's, and a
    chunk's keys in memory). rows: None, or the `RowSplit` of the rows on a mesh: each device then scores its
    own rows' pools, the store's rows it holds (`RowSplit.per_device`)."""
    if rows is not None:  # each device its own rows' pool: no collective in the loop (`RowSplit.per_device`)
        return rows.per_device(lambda q, w_, keys_, ids_, vis: pool_chunks_top_k(
            q, w_, keys_, ids_, block, vis, k, chunk_blocks, unroll, group), q_BSJd, w_BSJ, keys, block_ids_BSn,
            visible_BS)
    n = block_ids_BSn.shape[-1]
    chunk = min(chunk_blocks, n)
    n_chunks = -(-n // chunk)
    ids = jnp.pad(block_ids_BSn, [(0, 0), (0, 0), (0, n_chunks * chunk - n)], constant_values=-1)
    if isinstance(keys, LayerStore):
        num = keys.leaves["index_keys"].shape[-2]
        gather_keys = functools.partial(store_keys, keys)
    else:
        num = keys.shape[1]
        gather_keys = functools.partial(jax.vmap(lambda t, i: t[i]), keys)
    k_eff = min(k, n * block)

    def step(c, best):
        entry, ok = pool_entries(jax.lax.dynamic_slice_in_dim(ids, c * chunk, chunk, axis=-1), block, visible_BS)
        entry = jnp.where(ok, entry, num)  # an unusable entry scores −inf and is never kept
        scores = lightning_scores_per_query(q_BSJd, gather_keys(jnp.minimum(entry, num - 1)), w_BSJ, ok,
                                            unroll, group)
        return _merge_best(best, scores, entry, k_eff, pick)

    best, pick = _empty_best(block_ids_BSn.shape[:2], k_eff, num), jax.lax.top_k
    trips = (jnp.max(jnp.sum(block_ids_BSn >= 0, axis=-1)) + chunk - 1) // chunk
    best = jax.lax.fori_loop(0, trips, step, best)
    return _finish_best(best, num, k)


def block_ids_to_mask(ids_BSn, n_blocks: int):
    """[B, S, n_blocks] bool of the kept blocks (−1 keeps nothing)."""
    return jnp.zeros((*ids_BSn.shape[:-1], n_blocks + 1), bool).at[
        jnp.arange(ids_BSn.shape[0])[:, None, None], jnp.arange(ids_BSn.shape[1])[None, :, None],
        jnp.where(ids_BSn < 0, n_blocks, ids_BSn)].set(True)[..., :n_blocks]


def candidate_blocks(scores_BST, visible_count_BS, max_blocks: int, block: int):
    """[B, S, ceil(T / block)] bool: the blocks kept in the candidate pool."""
    n_blocks = -(-scores_BST.shape[-1] // block)
    return block_ids_to_mask(candidate_block_ids(scores_BST, visible_count_BS, max_blocks, block), n_blocks)


def blocks_to_entries(blocks_BSn, block: int, num_entries: int):
    """[B, S, T] bool: the entries of the kept blocks."""
    return jnp.repeat(blocks_BSn, block, axis=-1)[..., :num_entries]


def pool_entries(block_ids_BSn, block: int, visible_BS):
    """(entry ids [B, S, n·block], usable [B, S, n·block]): a pool block's entries, usable unless the
    block is −1 or the entry is not yet visible."""
    entry = (block_ids_BSn[..., None] * block + jnp.arange(block)).reshape(*block_ids_BSn.shape[:-1], -1)
    ok = jnp.repeat(block_ids_BSn >= 0, block, axis=-1) & (entry < visible_BS[..., None])
    return entry, ok


def pool_gather_scores(q_BSJd, w_BSJ, store, block_ids_BSn, block: int, visible_BS, unroll: bool = False):
    """Reindex scores over the gathered pool keys only: ([B, S, P] scores, [B, S, P] entry ids).

    `store` is the Full layer's `kv_store.LayerStore`; only its index_keys and index_scales are read."""
    entry, ok = pool_entries(block_ids_BSn, block, visible_BS)
    return lightning_scores_per_query(q_BSJd, store_keys(store, entry), w_BSJ, ok, unroll), jnp.where(ok, entry, -1)


def store_keys(store, entry_BSP):
    """The indexer keys of entries [B, S, P] of a Full layer's `kv_store.LayerStore`, dequantised: [B, S, P, dI]."""
    return dequant_keys(store.gather("index_keys", entry_BSP), store.gather("index_scales", entry_BSP))
