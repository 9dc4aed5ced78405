"""The whole stack: embedding → N residual streams → layer stacks → final collapse → norm → head.

The layers run as the plan's stacks (`plan.layer_stacks`, DESIGN §9): a stack of G identical groups keeps
each parameter with a leading layers axis [G, ...] and runs as one `lax.scan` over the groups, so a
group is traced once however many the model has; a one-group stack runs unrolled. The final collapse
uses the last FFN site's `pre` (single-pass mHC, V4.1) or its own `hc_head` (classic mHC, V4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41.nn import mhc, rope
from dsv41.nn.block import Block
from dsv41.nn.linear import Dense, param
from dsv41.nn.norm import RMSNorm
from dsv41.nn.policy import Policy
from dsv41.plan import Stack, layer_plan, layer_stacks


class LayerStack(nnx.Module):
    """The Blocks of one stack: slot j holds the G layers `spec.layers[g][j]`, each parameter [G, ...]."""

    def __init__(self, cfg, spec: Stack, tables: dict, pools: set, engram_rows: dict, *, policy: Policy,
                 rngs: nnx.Rngs):
        plan = layer_plan(cfg)
        self.spec = spec
        self.unroll = policy.lowering.unroll_layers  # FLOP counting: every group traced on its own

        def slot(j):
            rec = plan[spec.layers[0][j]]

            @nnx.split_rngs(splits=spec.groups)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make(rngs):
                return Block(cfg, rec, tables, rec.index in pools, engram_rows.get(rec.index), policy=policy,
                             rngs=rngs)

            return make(rngs)

        self.slots = nnx.List([slot(j) for j in range(spec.slots)])

    def run(self, group, carry, published: dict, *, record: bool = False, remat=None):
        """Runs `group(blocks, g, carry, published) -> (carry, published)` over the stack's groups: blocks are
        the group's Blocks (slot order), g its index (an int when the stack has one group, else traced).
        `published` holds what earlier layers hand on (entries, picks, pools, keyed by layer as the records
        of group 0 name them); a one-group stack returns it with its own additions, a scanned stack as it
        came (nothing outside a scanned stack reads it, `plan.layer_stacks`). remat: None, or a
        `jax.checkpoint` policy (`"all"`: save nothing) each group is rematerialised with. Returns (carry,
        published, records): records[g][j] = {name: array} of what layer `spec.layers[g][j]` sowed (when
        `record`)."""
        graphdef, state = nnx.split(self.slots)

        def body(state_g, g, carry, published):
            blocks = nnx.merge(graphdef, state_g)
            (carry, published), rec = nnx.capture(lambda b: group(b, g, carry, dict(published)),
                                                  nnx.Intermediate)(blocks)
            return carry, published, [_plain(rec[j]) for j in range(len(blocks))] if record else None

        if remat is not None:
            body = _checkpointed(body, remat)
        if self.spec.groups == 1 or self.unroll:
            records = []
            for g in range(self.spec.groups):  # later groups see the published values of earlier ones
                carry, out, rec = body(jax.tree.map(lambda v: v[g], state), g, carry, published)
                published = out if self.spec.groups == 1 else published
                records.append(rec)
            return carry, published, records if record else None

        def step(carry, xs):
            g, state_g = xs
            carry, _, rec = body(state_g, g, carry, published)
            return carry, rec

        carry, rec = jax.lax.scan(step, carry, (jnp.arange(self.spec.groups, dtype=jnp.int32), state))
        if not record:
            return carry, published, None
        return carry, published, [jax.tree.map(lambda v: v[g], rec) for g in range(self.spec.groups)]

    def block(self, g: int, j: int) -> Block:
        """The Block of group g, slot j, as a module of its own (its parameters sliced out)."""
        graphdef, state = nnx.split(self.slots[j])
        return nnx.merge(graphdef, jax.tree.map(lambda v: v[g], state))


def _checkpointed(body, remat):
    policy = None if remat == "all" else remat

    def run(state_g, g, carry, published):
        if isinstance(g, int):  # an unrolled group: its index is static
            return jax.checkpoint(lambda s, c, p: body(s, g, c, p), policy=policy)(state_g, carry, published)
        return jax.checkpoint(body, policy=policy)(state_g, g, carry, published)

    return run


def _plain(recorded) -> dict:
    """{name: array} (nested like the module) of a captured nnx.State; sow keeps a tuple of one value."""
    out = {}
    for path, v in nnx.to_flat_state(recorded):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        value = v.get_value()
        node[path[-1]] = value[0] if isinstance(value, tuple) else value
    return out


class Transformer(nnx.Module):
    def __init__(self, cfg, engram_rows: dict[int, int], *, policy: Policy, rngs: nnx.Rngs):
        a = cfg.architecture
        plan = layer_plan(cfg)
        tables = rope.inv_freq_tables(cfg)
        pools = {r.candidate_source for r in plan if r.candidate_source is not None}
        self.streams = a.mhc.streams
        self.plan = plan  # per layer its own record (a stack's modules hold its first group's)
        self.num_layers = len(plan)
        self.engram_layers = tuple(r.index for r in plan if r.engram)
        self.embed = param(rngs, (a.vocab_size, a.hidden_size), ("vocab", "embed"), policy.param_dtype, policy.init_std)
        self.stacks = nnx.List([LayerStack(cfg, spec, tables, pools, engram_rows, policy=policy, rngs=rngs)
                                for spec in layer_stacks(cfg)])
        self.hc_head = (mhc.HyperHead(a.mhc.streams, a.hidden_size, eps=a.mhc.eps, norm_eps=a.norm_eps,
                                     init_std=policy.init_std, rngs=rngs)
                        if a.mhc.variant == "classic" else None)
        self.norm = RMSNorm(a.hidden_size, a.norm_eps, "embed")
        self.head = Dense(a.hidden_size, a.vocab_size, ("embed", "vocab"), policy=policy, rngs=rngs)

    def layer(self, i: int) -> Block:
        """Layer i's Block as a module of its own (for inspection and the training losses)."""
        for st in self.stacks:
            for g, group in enumerate(st.spec.layers):
                if i in group:
                    return st.block(g, group.index(i))
        raise IndexError(f"layer: {i}: expected 0..{self.num_layers - 1}")

    def embed_tokens(self, tokens_BS):
        """The residual streams [B, S, N, D] of the tokens and the initial `pre` [B, S, N] (stream 0)."""
        x = jnp.take(self.embed[...], tokens_BS, axis=0)
        x_BSND = jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], self.streams, x.shape[-1]))
        return x_BSND, jax.nn.one_hot(jnp.zeros(tokens_BS.shape, jnp.int32), self.streams, dtype=jnp.float32)

    def engram_column(self, layer: int, engram_ids_BSLC):
        """A layer's Engram ids [B, S, C] (None for a layer without Engram)."""
        if layer not in self.engram_layers:
            return None
        return engram_ids_BSLC[:, :, self.engram_layers.index(layer)]

    def __call__(self, tokens_BS, positions_BS, engram_ids_BSLC=None, *, record: bool = False, remat=None):
        """Logits [B, S, V] in fp32 of a whole sequence (teacher forced); with `record`, also per layer
        {name: array} of what it sowed (its attention input, picks, pool, entries, routed experts)."""
        x_BSND, pre = self.embed_tokens(tokens_BS)
        published: dict = {}
        records: list = [None] * self.num_layers
        for st in self.stacks:
            spec = st.spec

            def group(blocks, g, carry, published, spec=spec):
                x_BSND, pre = carry
                for j, block in enumerate(blocks):
                    ids = None if block.engram is None else self.engram_column(spec.layers[g][j], engram_ids_BSLC)
                    x_BSND, pre, _ = block(x_BSND, pre, lambda attn, h: (attn(h, positions_BS, published), None),
                                           ids, tokens_BS)
                return (x_BSND, pre), published

            (x_BSND, pre), published, rec = st.run(group, (x_BSND, pre), published, record=record, remat=remat)
            if record:
                for g, group_rec in enumerate(rec):
                    for j, layer in enumerate(spec.layers[g]):
                        records[layer] = group_rec[j]
        h = self.norm(self.hc_head(x_BSND) if self.hc_head is not None else mhc.collapse(x_BSND, pre))
        logits = self.head(h).astype(jnp.float32)
        return (logits, tuple(records)) if record else logits
