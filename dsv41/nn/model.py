"""The whole stack: embedding → N residual streams → layer stacks → final collapse → norm → head.

The layers run as the plan's stacks (`plan.layer_stacks`, DESIGN §9): a stack of G identical groups keeps
each parameter with a leading layers axis [G, ...] and runs as one `lax.scan` over the groups, so a
group is traced once however many the model has; a one-group stack runs unrolled. Engram tables (each
with its own number of rows) sit outside the stacks, one module per Engram layer, and a stacked slot
that holds an Engram layer picks its table by `lax.switch` on the layer number. The final collapse
uses the last FFN site's `pre` (single-pass mHC, V4.1) or its own `hc_head` (classic mHC, V4)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41 import selections
from dsv41.nn import mhc, rope
from dsv41.nn.block import Block
from dsv41.nn.engram import Engram
from dsv41.nn.linear import Dense, param
from dsv41.nn.norm import RMSNorm
from dsv41.nn.policy import Policy
from dsv41.plan import Stack, engram_layers, layer_plan, layer_stacks


@dataclasses.dataclass(frozen=True)
class LayerAt:
    """Where `LayerStack.run` is: group g and run position r (ints where unrolled, else traced), slot j
    (static), `layer` the layer's number (an int where g and r are, else traced) and `layers` the numbers
    it may take (static: the slot's layers). The slot's modules hold the record of group 0's first layer
    of the slot (`block.attn.record`)."""

    g: object
    j: int
    r: object
    layer: object
    layers: tuple = ()


class LayerStack(nnx.Module):
    """The Blocks of one stack: slot j holds the layers `spec.grid(j)`, each parameter [G, ...] ([G, R, ...]
    for a run of R identical layers)."""

    def __init__(self, cfg, spec: Stack, tables: dict, pools: set, *, policy: Policy, rngs: nnx.Rngs):
        plan = layer_plan(cfg)
        self.spec = spec
        self.unroll = policy.lowering.unroll_layers  # FLOP counting: every layer traced on its own

        def stacked(count, build):
            @nnx.split_rngs(splits=count)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make(rngs):
                return build(rngs)
            return make

        def slot(j):
            rec = plan[spec.slot_layers(spec.template, j)[0]]

            def block(rngs):
                return Block(cfg, rec, tables, rec.index in pools, policy=policy, rngs=rngs)

            return stacked(spec.rows(j), block if spec.runs[j] == 1 else stacked(spec.runs[j], block))(rngs)

        self.slots = nnx.List([slot(j) for j in range(spec.slots)])

    def run(self, layer_fn, carry, published: dict, *, record: bool = False, remat=None):
        """Runs `layer_fn(block, at: LayerAt, carry, published) -> (carry, published)` for every layer of the
        stack in order: the groups as one `lax.scan` (unrolled for a one-group stack), inside a group each
        slot's run of layers as an inner `lax.scan` (a single layer as it is). `published` holds what
        earlier layers hand on (entries, picks, pools, keyed by the layer numbers of the template group's
        records); a one-group stack returns it with its own additions, a scanned stack as it came (nothing
        outside a scanned stack reads it, `plan.layer_stacks`), and a run adds nothing (its layers feed no
        layer). A stack with a lead (`plan.Stack.lead`) runs slot 0 under a `lax.cond` on the group
        (`_lead_slot`): group 0 hands on the lead's picks instead.
        remat: None, or a `jax.checkpoint` policy (`"all"`: save nothing) each group is rematerialised with.
        Returns (carry, published, records): records {layer: {name: array}} of what each layer sowed (when
        `record`)."""
        spec = self.spec
        split = [nnx.split(slot) for slot in self.slots]
        defs = [d for d, _ in split]
        # A single layer's slot [G, ...] is scanned over (xs); a run's [G, R, ...] (and a slot that lacks group 0)
        # is indexed inside the loop instead, so that no [R, ...] slice of the group is materialised to feed it.
        scanned = [spec.runs[j] == 1 and spec.rows(j) == spec.groups for j in range(spec.slots)]
        singles = [st if scanned[j] else None for j, (_, st) in enumerate(split)]
        whole = [None if scanned[j] else st for j, (_, st) in enumerate(split)]

        slot_layers = [tuple(int(i) for i in np.ravel(spec.grid(j))) for j in range(spec.slots)]
        # The named scope of a slot's traced layer: the layers it runs and their kind.
        modes = [self.slots[j].attn.record.mode for j in range(spec.slots)]
        scopes = [f"layers {','.join(map(str, slot_layers[j]))} {modes[j]}" for j in range(spec.slots)]

        def one(block, g, j, r, carry, published):
            layer = spec.first + g * spec.width + spec.offset(j) + r
            at = LayerAt(g, j, r, layer, slot_layers[j])
            with jax.named_scope(scopes[j] if isinstance(layer, jax.Array) else f"layer {layer} {modes[j]}"):
                (carry, published), rec = nnx.capture(lambda b: layer_fn(b, at, carry, published),
                                                      nnx.Intermediate)(block)
            return carry, published, _plain(rec) if record else None

        def at_row(j, g, r=None):
            row = spec.row(g, j)
            return nnx.merge(defs[j], jax.tree.map(lambda v: v[row] if r is None else v[row, r], whole[j]))

        def body(state_g, g, carry, published):
            published = dict(published)
            recs = []
            for j in range(spec.slots):
                if spec.lead and j == 0:
                    carry, published, rec = self._lead_slot(lambda c, p: one(at_row(0, g), g, 0, 0, c, p),
                                                            g, carry, published)
                    recs.append([rec])
                    continue
                if spec.runs[j] == 1:
                    carry, published, rec = one(nnx.merge(defs[j], state_g[j]), g, j, 0, carry, published)
                    recs.append([rec])
                    continue
                if self.unroll:
                    out = []
                    for r in range(spec.runs[j]):
                        carry, published, rec = one(at_row(j, g, r), g, j, r, carry, published)
                        out.append(rec)
                    recs.append(out)
                    continue

                def inner(carry, r, j=j, published=published):
                    carry, _, rec = one(at_row(j, g, r), g, j, r, carry, published)
                    return carry, rec

                if remat is not None:  # each layer of a run on its own too: a group's backward holds one layer's
                    inner = jax.checkpoint(inner, policy=None if remat == "all" else remat, prevent_cse=False)
                carry, rec = jax.lax.scan(inner, carry, jnp.arange(spec.runs[j], dtype=jnp.int32))
                recs.append(rec)
            return carry, published, recs if record else None

        if remat is not None:
            body = _checkpointed(body, remat)
        by_group = []
        if spec.groups == 1 or self.unroll:
            for g in range(spec.groups):  # later groups see the published values of earlier ones
                carry, out, rec = body(jax.tree.map(lambda v: v[g], singles), g, carry, published)
                published = out if spec.groups == 1 else published
                by_group.append(rec)
        else:
            def step(carry, xs):
                g, state_g = xs
                carry, _, rec = body(state_g, g, carry, published)
                return carry, rec

            carry, rec = jax.lax.scan(step, carry, (jnp.arange(spec.groups, dtype=jnp.int32), singles))
            by_group = [jax.tree.map(lambda v: v[g], rec) for g in range(spec.groups)] if record else []
        if not record:
            return carry, published, None
        records = {}
        for g, recs in enumerate(by_group):
            for j, rec in enumerate(recs):
                for r, layer in enumerate(spec.slot_layers(g, j)):
                    records[layer] = rec[r] if isinstance(rec, list) else jax.tree.map(lambda v: v[r], rec)
        return carry, published, records

    def _lead_slot(self, run_layer, g, carry, published: dict):
        """Slot 0 of a stack with a lead, group g: `run_layer(carry, published) -> (carry, published, rec)` for
        g > 0; group 0 has no layer there and hands on the lead's hand-off (`published[spec.first]`, its
        picks) under the slot's key. A traced g runs the layer under a `lax.cond` that returns only what the
        layer changed (the carry's leaves it wrote, the hand-off's fields the lead does not already hold):
        a store that passed through a branch would be copied (docs/compile_time.md). Which those are is found
        by tracing the layer once to shapes first."""
        key, lead = self.slots[0].attn.record.index, published[self.spec.first]
        if isinstance(g, int):
            if g == 0:
                return carry, {**published, key: lead}, None
            return run_layer(carry, published)
        leaves, treedef = jax.tree.flatten(carry)
        fields = [f.name for f in dataclasses.fields(lead)]
        found = {}

        def layer_changes():
            new_carry, new_published, rec = run_layer(carry, published)
            new_leaves = jax.tree.leaves(new_carry)
            handoff = new_published[key]
            found["carry"] = [a is not b for a, b in zip(new_leaves, leaves)]
            found["handoff"] = [getattr(handoff, f) is not None and getattr(handoff, f) is not getattr(lead, f)
                                for f in fields]
            return ([a for a, c in zip(new_leaves, found["carry"]) if c],
                    [getattr(handoff, f) for f, c in zip(fields, found["handoff"]) if c], rec)

        shapes = jax.eval_shape(layer_changes)
        passed = [getattr(lead, f) for f, c in zip(fields, found["handoff"]) if c]
        like = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)
        if jax.tree.structure(passed) != jax.tree.structure(shapes[1]) or like(passed) != like(shapes[1]):
            raise ValueError(f"layer {key}: its hand-off {[f for f, c in zip(fields, found['handoff']) if c]} "
                             f"{like(shapes[1])}: expected the lead layer {self.spec.first}'s of the same shapes, "
                             f"{like(passed)}")

        def lead_only():
            return ([a for a, c in zip(leaves, found["carry"]) if c], passed,
                    jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[2]))

        changed, handed, rec = jax.lax.cond(g > 0, layer_changes, lead_only)
        it = iter(changed)
        carry = jax.tree.unflatten(treedef, [next(it) if c else a for a, c in zip(leaves, found["carry"])])
        it = iter(handed)
        handoff = dataclasses.replace(lead, **{f: next(it) for f, c in zip(fields, found["handoff"]) if c})
        return carry, {**published, key: handoff}, rec

    def block(self, g: int, j: int, r: int = 0) -> Block:
        """The Block of group g, slot j, run position r, as a module of its own (its parameters sliced out)."""
        graphdef, state = nnx.split(self.slots[j])
        row = self.spec.row(g, j)
        at = (row,) if self.spec.runs[j] == 1 else (row, r)
        return nnx.merge(graphdef, jax.tree.map(lambda v: v[at], state))


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
        self.query_block = int(cfg.runtime.query_block)  # the whole-sequence forward's blocks (`__call__`)
        self.policy = policy  # its lowering: sequence parallel (each row's tokens over a mesh axis), weights at use
        self.plan = plan  # per layer its own record (a stack's modules hold its first group's)
        self.num_layers = len(plan)
        self.engram_layers = engram_layers(cfg)
        self.embed = param(rngs, (a.vocab_size, a.hidden_size), ("vocab", "embed"), policy.param_dtype, policy.init_std)
        self.stacks = nnx.List([LayerStack(cfg, spec, tables, pools, policy=policy, rngs=rngs)
                                for spec in layer_stacks(cfg)])
        e = a.engram
        # One module per Engram layer, in `engram_layers` order (`engram.{k}.…`; per layer `layers.{i}.engram.…`).
        self.engram = nnx.List([Engram(a.hidden_size, a.mhc.streams, engram_rows[i], e.row_dim,
                                       (e.max_ngram - 1) * e.heads_per_ngram, a.norm_eps, policy=policy, rngs=rngs)
                                for i in self.engram_layers])
        self.hc_head = (mhc.HyperHead(a.mhc.streams, a.hidden_size, eps=a.mhc.eps, norm_eps=a.norm_eps,
                                     init_std=policy.init_std, rngs=rngs)
                        if a.mhc.variant == "classic" else None)
        self.norm = RMSNorm(a.hidden_size, a.norm_eps, "embed")
        self.head = Dense(a.hidden_size, a.vocab_size, ("embed", "vocab"), policy=policy, rngs=rngs)

    def layer(self, i: int) -> Block:
        """Layer i's Block as a module of its own (for inspection and the training losses)."""
        for st in self.stacks:
            at = st.spec.locate(i)
            if at is not None:
                return st.block(*at)
        raise IndexError(f"layer: {i}: expected 0..{self.num_layers - 1}")

    def embed_tokens(self, tokens_BS):
        """The residual streams [B, S, N, D] of the tokens and the initial `pre` [B, S, N] (stream 0)."""
        x = jnp.take(self.policy.at_use(self.embed[...], ("vocab", "embed")), tokens_BS, axis=0)
        x_BSND = jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], self.streams, x.shape[-1]))
        return x_BSND, jax.nn.one_hot(jnp.zeros(tokens_BS.shape, jnp.int32), self.streams, dtype=jnp.float32)

    def engram_step(self, at: LayerAt, x_BSND, engram_ids_BSLC):
        """The residual streams after the Engram of layer `at.layer`, if it has one: the layer's own module
        where the layer number is static, else a `lax.switch` on it over the Engram layers the slot may be
        (`at.layers`) and no Engram."""
        if engram_ids_BSLC is None:
            return x_BSND
        if not isinstance(at.layer, jax.Array):
            if at.layer not in self.engram_layers:
                return x_BSND
            k = self.engram_layers.index(at.layer)
            with jax.named_scope("engram"):
                return self.engram[k](x_BSND, engram_ids_BSLC[:, :, k])
        mine = [k for k, i in enumerate(self.engram_layers) if i in at.layers]
        if not mine:
            return x_BSND
        branch = np.zeros((self.num_layers,), np.int32)
        for b, k in enumerate(mine):
            branch[self.engram_layers[k]] = b + 1

        def apply(k):
            return lambda x: self.engram[k](x, engram_ids_BSLC[:, :, k])

        with jax.named_scope("engram"):
            return jax.lax.switch(jnp.asarray(branch)[at.layer], [lambda x: x] + [apply(k) for k in mine], x_BSND)

    def __call__(self, tokens_BS, positions_BS, engram_ids_BSLC=None, *, record: bool = False, remat=None,
                 forced=None, decoder_window_start=None):
        """Logits [B, S, V] in fp32 of a whole sequence (teacher forced); with `record`, also per layer
        {name: array} of what it sowed (its attention input, picks, pool, entries, routed experts).
        forced: a selections value (`dsv41.selections`, checked) whose picks, pool ids and experts the layers
        take instead of choosing their own (selection replay). decoder_window_start [B]: the decoder's layers
        see no window key before it (the CED split in training, DESIGN §3.5: a row's decoder runs from the
        replayed span of its prompt on)."""
        forced = None if forced is None else selections.stacked(forced, self.num_layers)
        sequence = self.policy.lowering.sequence
        split = (lambda x: x) if sequence is None else sequence.split
        x_BSND, pre = (split(a) for a in self.embed_tokens(tokens_BS))
        published: dict = {}
        records: dict = {}

        def layer(block, at, carry, published):
            x_BSND, pre = (split(a) for a in carry)
            x_BSND = self.engram_step(at, x_BSND, engram_ids_BSLC)
            given = {kind: selections.of_layer(forced, kind, at.layer, at.layers) for kind in selections.KINDS}
            start = decoder_window_start if block.attn.record.stage == "decoder" else None
            x_BSND, pre, handoff = block(x_BSND, pre, lambda attn, h: attn(h, positions_BS, published, given, start),
                                         tokens_BS, self.query_block, experts=given["experts"])
            if handoff is not None:
                published = {**published, block.attn.record.index: handoff}
            return (x_BSND, pre), published

        for st in self.stacks:
            (x_BSND, pre), published, rec = st.run(layer, (x_BSND, pre), published, record=record, remat=remat)
            records.update(rec or {})
        h = self.norm(self.hc_head(x_BSND) if self.hc_head is not None else mhc.collapse(x_BSND, pre))
        logits = split(self.head(h).astype(jnp.float32))
        return (logits, tuple(records[i] for i in range(self.num_layers))) if record else logits
