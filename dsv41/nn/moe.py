"""Mixture of experts (DESIGN §3.6): sqrt-softplus router, top-k, clamped SwiGLU experts, shared expert.

Scores s = sqrt(softplus(x W_g)) in fp32; the picks are the top-k of s + bias, where the bias is a
balancing term updated outside the gradient (a `BalanceBias` variable, stop-gradient here); the
weights are s at the picks, normalised (+1e-20) and scaled by the route scale. An expert computes
w2((silu(min(w1 x, L)) · clip(w3 x, ±L)) · weight). Routed tokens are sorted by expert and run
through `jax.lax.ragged_dot`: no dense all-experts compute. On CPU, where XLA expands a ragged_dot into
a dot of every pick against every group (N·k·G rows, and every weight transposed for it each call), a
one-token step (decode) runs every held expert over its tokens instead (N·G rows, the weights read in their
stored layout), weighted by each token's gate for it: k times less arithmetic than that expansion and no
weight copies. On TPU and GPU a decode step does the same while an expert group holds few tokens
(`DENSE_DECODE_TOKENS`): ragged_dot's TPU kernel would read bf16 copies of the FP8 weights.
Expert parallelism (DESIGN §9): built with a layout (`Policy.lowering.layout`, part of the module
structure and so of the jit key) on a mesh, the routed experts run in a `jax.shard_map`: each device gathers the tokens of its expert group, runs the picks that name
its own experts (and its slice of the intermediate width), and the partial sums go back to the tokens'
owners with a reduce-scatter. Exact: the same sums as on one device, in another order.
V4 (compat, DESIGN §3.6): the first `hash_layers` layers pick their experts from a fixed token → experts
table (`tid2eid`, a `HashRoute` variable) instead of the top-k; the weights are computed as above.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from dsv41.errors import ConfigError
from dsv41.kernels import dispatch
from dsv41.nn import weights
from dsv41.nn.attend import over_query_blocks, spec_entry
from dsv41.nn.linear import Dense, param
from dsv41.nn.policy import Policy


class BalanceBias(nnx.Variable):
    """The router's selection bias: not a parameter of the loss, updated from expert load."""


class HashRoute(nnx.Variable):
    """A hash-routed layer's token id → expert ids table [vocab, k] (int32): fixed, never trained."""


class MoE(nnx.Module):
    def __init__(self, dim: int, experts: int, top_k: int, inter: int, shared: int, route_scale: float,
                 swiglu_limit: float, hash_vocab: int = 0, *, policy: Policy, rngs: nnx.Rngs):
        """hash_vocab > 0: a hash-routed layer (V4) with a table of that many token ids, no balance bias."""
        self.top_k, self.route_scale, self.limit, self.policy = top_k, route_scale, swiglu_limit, policy
        self.num_experts = experts
        self.gate = param(rngs, (dim, experts), ("embed", "experts"), policy.param_dtype, policy.init_std)
        if hash_vocab:
            # Distinct random experts per token until a checkpoint brings the real table.
            order = jnp.argsort(jax.random.uniform(rngs.params(), (hash_vocab, experts)), axis=-1)
            self.tid2eid = HashRoute(order[:, :top_k].astype(jnp.int32), out_sharding=("vocab", None),
                                     eager_sharding=False)
            self.bias = None
        else:
            self.tid2eid = None
            self.bias = BalanceBias(jnp.zeros((experts,), jnp.float32), out_sharding=("experts",),
                                    eager_sharding=False)
        # The release ships the routed experts as MXFP4 (`dsv41.nn.weights`): `w1` packed E2M1 and `w1_scale` UE8M0.
        self.kind = weights.kind_for(policy, weights.MXFP4)
        up, down = ("experts", "embed", "mlp"), ("experts", "mlp", "embed")
        self.w1, self.w1_scale = weights.make(rngs, (experts, dim, inter), up, policy, self.kind, what="moe.w1")
        self.w3, self.w3_scale = weights.make(rngs, (experts, dim, inter), up, policy, self.kind, what="moe.w3")
        self.w2, self.w2_scale = weights.make(rngs, (experts, inter, dim), down, policy, self.kind, what="moe.w2")
        self.shared = SwiGLU(dim, inter * shared, swiglu_limit, policy=policy, rngs=rngs) if shared else None

    def route(self, x_ND, tokens_N=None, experts_Nk=None):
        """(weights [N, k] fp32, expert ids [N, k]) for tokens x (a hash-routed layer reads their ids).
        experts_Nk: the ids to take instead of the top-k (selection replay); the weights stay the scores'."""
        logits = jnp.dot(x_ND.astype(jnp.float32), self.gate[...].astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)
        scores = jnp.sqrt(jax.nn.softplus(logits))
        if experts_Nk is not None:
            idx = experts_Nk.astype(jnp.int32)
        elif self.tid2eid is not None:
            idx = jnp.take(self.tid2eid[...], tokens_N, axis=0)
        else:
            _, idx = jax.lax.top_k(scores + jax.lax.stop_gradient(self.bias[...]), self.top_k)
        weights = jnp.take_along_axis(scores, idx, axis=-1)
        if self.top_k > 1:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return weights * self.route_scale, idx

    def __call__(self, x_BSD, tokens_BS=None, token_block: int = 0, experts=None):
        """The layer's FFN output [B, S, D]. token_block > 0 (the whole-sequence forward, `runtime.query_block`):
        on one device, rows of more tokens run their routed experts over blocks of that many tokens, each
        under `jax.checkpoint`, so that the expansion and the values saved for the backward pass last one
        block; per token, so the same sums. experts [B, S, k]: the routed experts to take (selection replay)."""
        shape = x_BSD.shape
        x = x_BSD.reshape(-1, shape[-1])
        weights, idx = self.route(x, None if tokens_BS is None else tokens_BS.reshape(-1),
                                  None if experts is None else experts.reshape(x.shape[0], -1))
        self.sow(nnx.Intermediate, "experts", idx.reshape(*shape[:-1], -1))
        form = expert_form(self.policy, shape[1], group_tokens(self.policy.lowering.layout, x.shape[0]))
        y = self.routed(x, weights, idx, form, token_block if 0 < token_block < shape[1] else 0, rows=shape[:2])
        if self.shared is not None:
            y = y + self.shared(x).astype(jnp.float32)
        return y.astype(x_BSD.dtype).reshape(shape)

    def routed(self, x_ND, weights_Nk, idx_Nk, form=None, token_block: int = 0, rows=None):
        """Σ_k weight_k · expert_{idx_k}(x) [N, D] fp32: on one device, or expert-parallel when built with
        a layout (`Policy.lowering.layout`) on a mesh of more than one device (form: `experts`'). rows: the
        (B, S) the N tokens flatten (a sequence-parallel layout splits both)."""
        layout = self.policy.lowering.layout
        w = tuple(weights.held(v[...], None if sc is None else sc[...], self.kind)
                  for v, sc in ((self.w1, self.w1_scale), (self.w3, self.w3_scale), (self.w2, self.w2_scale)))
        if layout is None or layout.mesh.size == 1:
            if token_block:  # padding picks name an expert held nowhere (idx = G: no work)
                def block(n, x_b, weights_b, idx_b):
                    return experts(x_b[0], weights_b[0], idx_b[0], *w, limit=self.limit, policy=self.policy,
                                   form=form)[None]

                return over_query_blocks(block, token_block, x_ND[None], weights_Nk[None], idx_Nk[None],
                                         pads=(0, 0, self.num_experts))[0]
            return experts(x_ND, weights_Nk, idx_Nk, *w, limit=self.limit, policy=self.policy, form=form)
        return experts_parallel(layout, x_ND, weights_Nk, idx_Nk, *w, limit=self.limit, policy=self.policy, form=form,
                                rows=rows)


# A decode step's experts run dense while one expert group holds at most this many tokens: every held
# expert's weights are read once either way, and dense adds 2·N multiply-adds per weight entry, under the
# compute / bandwidth balance of a TPU v5p (~83 per FP8 byte), v6e (~280) or H200 (~100) for N ≤ 64.
# `ragged_dot`'s TPU kernel takes bf16 weights, so XLA first writes bf16 copies of the FP8 experts to HBM
# every step; the dense einsums read the FP8 weights as stored (the convert fuses into the dot): full-size
# V4.1-Flash decode on v5p:2x2x2, batch 32: XLA's bytes accessed 8.65e10 -> 3.81e10 (loop bodies counted
# once), temporaries 4.30 -> 3.49 GiB, 42 -> 0 bf16 expert copies.
DENSE_DECODE_TOKENS = 64


def expert_form(policy: Policy, tokens_per_row: int | None = None, group_tokens: int | None = None) -> str:
    """How `experts` computes: "per_pick" (`Lowering.experts_per_pick`, for FLOP reports); "dense" for a
    one-token step (decode) on CPU (module doc), and elsewhere while an expert group holds at most
    `DENSE_DECODE_TOKENS` tokens (group_tokens: the tokens a device's expert group computes over);
    else "ragged" (`ragged_dot`; the whole-sequence forward and prefill chunks keep it on CPU too, so that
    they round exactly alike)."""
    if policy.lowering.experts_per_pick:
        return "per_pick"
    if tokens_per_row != 1:
        return "ragged"
    if dispatch.platform(policy.lowering.layout) == "cpu":
        return "dense"
    return "dense" if group_tokens is not None and group_tokens <= DENSE_DECODE_TOKENS else "ragged"


def group_tokens(layout, tokens: int) -> int:
    """The tokens one device's expert group computes over, of `tokens` in the step (the rows split over the
    token axes, gathered over those of them the group spans; `experts_parallel`)."""
    if layout is None:
        return tokens
    group = layout.expert_axes + layout.tensor_axes
    apart = math.prod(layout.mesh.shape[a] for a in layout.token_axes + layout.seq_axes if a not in group)
    return -(-tokens // apart)


def experts(x_ND, weights_Nk, idx_Nk, w1_GDI, w3_GDI, w2_GID, *, limit: float, policy: Policy, form=None):
    """Σ_k weight_k · expert_{idx_k}(x) [N, D] fp32 over the G experts held here. A pick with idx == G names an
    expert held elsewhere and contributes nothing. form (default `expert_form(policy)`): "ragged" sorts the
    (token, k) picks by expert for `ragged_dot` (a pick held elsewhere sorts past the last group, gets no
    work and is dropped when the rows go back to their tokens); "dense" runs every held expert over every
    token, weighted by the token's gate for it; "per_pick" traces one matmul per pick against that
    expert's gathered weights (what XLA's cost analysis counts as computed: it counts a ragged_dot as if
    every row met every group). The results are the same sums, in another order. Each matmul returns the
    compute dtype, as `Policy.matmul` does (bf16: one pick's output is a bf16 value; the picks add up in fp32),
    so that a training step's [N·k, D] per-pick buffers and their cotangents are half the size."""
    form = form or expert_form(policy)
    if form == "per_pick":
        return _experts_per_pick(x_ND, weights_Nk, idx_Nk.reshape(-1), w1_GDI, w3_GDI, w2_GID, limit=limit,
                                 policy=policy)
    if form == "dense":
        return _experts_dense(x_ND, weights_Nk, idx_Nk, w1_GDI, w3_GDI, w2_GID, limit=limit, policy=policy)
    if form != "ragged":
        raise ValueError(f"form: {form!r}: expected 'ragged', 'dense' or 'per_pick'")
    n, k = idx_Nk.shape
    g = w1_GDI.shape[0]
    flat = idx_Nk.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=g + 1)[:g].astype(jnp.int32)
    xs = x_ND[order // k].astype(policy.compute_dtype)
    def dot(a, w):
        y = weights.mxfp4_ragged_dot(a, w, sizes, policy)   # the Pallas grouped matmul, where it runs
        return y if y is not None else jax.lax.ragged_dot(a, weights.widen(w, policy.compute_dtype), sizes,
                                                          precision=policy.precision,
                                                          preferred_element_type=policy.compute_dtype)
    h = swiglu(dot(xs, w1_GDI), dot(xs, w3_GDI), limit) * weights_Nk.reshape(-1)[order][:, None]
    ys = dot(h.astype(policy.compute_dtype), w2_GID)
    back = jnp.where(flat[order] < g, order, n * k)
    y = jnp.zeros_like(ys).at[back].set(ys, mode="drop")
    return y.reshape(n, k, -1).astype(jnp.float32).sum(axis=1)


def _experts_dense(x_ND, weights_Nk, idx_Nk, w1_GDI, w3_GDI, w2_GID, *, limit: float, policy: Policy):
    """Every held expert over every token (the CPU decode form, module doc), weighted by the token's gate
    for it: the sum of its picks' weights for that expert (0 for an expert it did not pick; a pick of one held
    elsewhere, idx == G, weighs nothing). Batched over the experts, so each weight is read as stored."""
    g = w1_GDI.shape[0]
    gate_GN = jnp.einsum("nk,nkg->gn", weights_Nk.astype(jnp.float32), jax.nn.one_hot(idx_Nk, g, dtype=jnp.float32))

    def dot(spec, a, w):
        y = weights.mxfp4_bmm(a, w, policy)  # the Pallas batched matmul: each expert's weight read once
        if y is not None:
            return y
        a = jnp.broadcast_to(a, (g, *a.shape[1:]))
        return jnp.einsum(spec, a, weights.widen(w, policy.compute_dtype), precision=policy.precision,
                          preferred_element_type=policy.compute_dtype)

    xs = x_ND.astype(policy.compute_dtype)[None]                       # [1, N, D]: the same rows for every expert
    h = swiglu(dot("gnd,gdi->gni", xs, w1_GDI), dot("gnd,gdi->gni", xs, w3_GDI), limit) * gate_GN[..., None]
    return dot("gni,gid->gnd", h.astype(policy.compute_dtype), w2_GID).astype(jnp.float32).sum(axis=0)


def _experts_per_pick(x_ND, weights_Nk, flat, w1_GDI, w3_GDI, w2_GID, *, limit: float, policy: Policy):
    n, k = weights_Nk.shape
    g = w1_GDI.shape[0]
    here = flat < g
    pick = jnp.minimum(flat, g - 1)
    xs = jnp.repeat(x_ND, k, axis=0).astype(policy.compute_dtype)             # [N·k, D], pick-major per token
    take = lambda w: w.take(pick) if isinstance(w, weights.Stored) else jnp.take(w, pick, axis=0)
    dot = lambda a, w, spec: jnp.einsum(spec, a, weights.widen(take(w), policy.compute_dtype),
                                        precision=policy.precision, preferred_element_type=policy.compute_dtype)
    h = swiglu(dot(xs, w1_GDI, "nd,ndi->ni"), dot(xs, w3_GDI, "nd,ndi->ni"), limit) * weights_Nk.reshape(-1)[:, None]
    ys = dot(h.astype(policy.compute_dtype), w2_GID, "ni,nid->nd")
    return jnp.where(here[:, None], ys, 0).reshape(n, k, -1).astype(jnp.float32).sum(axis=1)


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Where the routed computation's operands live on a mesh: token rows split over `token_axes` (major
    first), the experts dimension of w1/w3/w2 over `expert_axes`, their intermediate width over `tensor_axes`;
    seq_axes (sequence parallel): each row's tokens split over them too, the tokens taken as [B, S] so that
    each device keeps the block of rows and tokens it holds."""
    mesh: Mesh
    token_axes: tuple[str, ...]
    expert_axes: tuple[str, ...]
    tensor_axes: tuple[str, ...]
    seq_axes: tuple[str, ...] = ()

    def __post_init__(self):
        names = self.mesh.axis_names
        for field in ("token_axes", "expert_axes", "tensor_axes", "seq_axes"):
            for a in getattr(self, field):
                if a not in names:
                    raise ConfigError(f"expert layout {field}", a, f"expected a mesh axis among {names}")
        split = self.expert_axes + self.tensor_axes
        if len(set(split)) < len(split):
            raise ConfigError("expert layout", (self.expert_axes, self.tensor_axes),
                              "expected experts and intermediate width split over distinct mesh axes")


def experts_parallel(layout: ExpertLayout, x_ND, weights_Nk, idx_Nk, w1_EDI, w3_EDI, w2_EID, *, limit: float,
                     policy: Policy, form=None, rows=None):
    """`experts` in a shard_map over layout.mesh (all-gather / reduce-scatter, exact; form: `experts`').

    A device holds N/T token rows (T = product of the token axes) and E/X experts (X = product of the
    expert axes) with I/Y of their width (Y: tensor axes). Its group — the devices that together hold
    one copy of every expert — gathers its token rows; each device runs the gathered picks that name its
    experts over its width slice, and the partial outputs are summed back onto the rows' owners:
    reduce-scatter over the token axes of the group, psum over the group's other axes. Rows are padded
    with zero-weight picks of no expert when N is not a multiple of T. Static shapes: a device runs
    ragged_dot over all of its group's picks (those of other devices' experts get no group), since
    every pick may name its experts. With `layout.seq_axes` the tokens come as rows (B, S) split over the
    token and the sequence axes (both must divide evenly), flattened per device."""
    mesh, tokens = layout.mesh, layout.token_axes + layout.seq_axes
    group = layout.expert_axes + layout.tensor_axes
    gather = tuple(a for a in tokens if a in group)
    reduce = tuple(a for a in group if a not in tokens)
    e, _, inter = w1_EDI.shape
    for field, split, size, what in (("expert_axes", layout.expert_axes, e, "experts"),
                                     ("tensor_axes", layout.tensor_axes, inter, "intermediate width")):
        if size % math.prod(mesh.shape[a] for a in split):
            raise ConfigError(f"expert layout {field}", split,
                              f"expected mesh axes whose sizes divide the {size} {what}")
    n = x_ND.shape[0]
    pad = 0 if layout.seq_axes else -n % math.prod(mesh.shape[a] for a in tokens)
    if pad:
        x_ND = jnp.pad(x_ND, ((0, pad), (0, 0)))
        weights_Nk = jnp.pad(weights_Nk, ((0, pad), (0, 0)))
        idx_Nk = jnp.pad(idx_Nk, ((0, pad), (0, 0)), constant_values=e)

    def local(x, weights, idx, w1, w3, w2):
        shape = x.shape
        x, weights, idx = (a.reshape(-1, a.shape[-1]) for a in (x, weights, idx))  # [B, S, ·] → [N, ·] here
        if gather:
            x, weights, idx = (jax.lax.all_gather(a, gather, axis=0, tiled=True) for a in (x, weights, idx))
        held = w1.shape[0]
        first = jax.lax.axis_index(layout.expert_axes) * held if layout.expert_axes else 0
        mine = idx - first
        mine = jnp.where((mine >= 0) & (mine < held), mine, held)
        y = experts(x, weights, mine, w1, w3, w2, limit=limit, policy=policy, form=form)
        if gather:
            y = jax.lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True)
        y = jax.lax.psum(y, reduce) if reduce else y
        return y.reshape(*shape[:-1], y.shape[-1])

    operands = (x_ND, weights_Nk, idx_Nk)
    if layout.seq_axes:
        for axes, size, what in ((layout.token_axes, rows[0], "rows"), (layout.seq_axes, rows[1], "tokens")):
            if size % math.prod(mesh.shape[a] for a in axes):
                raise ConfigError(f"expert layout ({what})", size, f"expected a multiple of mesh axes {axes}")
        operands = tuple(a.reshape(*rows, a.shape[-1]) for a in operands)
        spec = P(spec_entry(layout.token_axes), spec_entry(layout.seq_axes), None)
    else:
        spec = P(spec_entry(tokens), None)
    up = P(spec_entry(layout.expert_axes), None, spec_entry(layout.tensor_axes))
    down = P(spec_entry(layout.expert_axes), spec_entry(layout.tensor_axes), None)
    # A Pallas kernel inside (the MXFP4 grouped or batched matmul) has no varying-axes rule: checked only without one (the
    # kernels run in inference, never under a gradient).
    kernels = (isinstance(w1_EDI, weights.Stored)
               and weights.kernel_impl(policy) != "reference")
    y = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, up, up, down), out_specs=spec,
                      check_vma=not kernels)(
        *operands, w1_EDI, w3_EDI, w2_EID)
    return y.reshape(-1, y.shape[-1])[:n]


def swiglu(gate, up, limit: float):
    """silu(min(gate, L)) · clip(up, -L, L) in fp32 (the clamps keep FP8/FP4 activations in range)."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    return jax.nn.silu(gate) * up


class SwiGLU(nnx.Module):
    """The shared expert: a dense clamped SwiGLU."""

    def __init__(self, dim: int, inter: int, limit: float, *, policy: Policy, rngs: nnx.Rngs):
        self.limit = limit
        self.w1 = Dense(dim, inter, ("embed", "mlp"), policy=policy, rngs=rngs, shipped=True)
        self.w3 = Dense(dim, inter, ("embed", "mlp"), policy=policy, rngs=rngs, shipped=True)
        self.w2 = Dense(inter, dim, ("mlp", "embed"), policy=policy, rngs=rngs, shipped=True)

    def __call__(self, x):
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit).astype(x.dtype))
