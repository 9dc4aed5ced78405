"""The layer plan (DESIGN §2.1): one record per layer, computed once from the config.

V4.1 (CSA2): each stage (encoder, decoder) is `[window-only × 2]` (encoder) followed by groups of
modes at the stage's compression ratio. A `full` layer owns a compressor and indexer keys and
publishes entries and picks; `reuse` takes the entries of the latest `full` layer (its kv_source)
and the picks of the latest `full`/`reindex` layer (its index_source); `reindex` rescoring the
kv_source's keys with its own indexer query, inside the candidate pool when the hierarchical
indexer is enabled. The pool is built by the kv_source of the Reindex layers (the candidate source).

V4 (compat, DESIGN §4): `window`, `csa` (ratio 4, own indexer) and `hca` (ratio 128, attends every
visible entry) layers, each its own source.
"""

from __future__ import annotations

import dataclasses
import functools

from dsv41 import schema
from dsv41.errors import ConfigError

WINDOW, FULL, REUSE, REINDEX, CSA, HCA = "window", "full", "reuse", "reindex", "csa", "hca"


@dataclasses.dataclass(frozen=True)
class LayerRecord:
    """What one layer does.

    index: layer number. stage: "encoder" / "decoder" (V4.1, the CED split) or "stack" (V4).
    mode: window | full | reuse | reindex (V4.1), window | csa | hca (V4).
    ratio: tokens per compressed entry (0 = window only).
    kv_source: layer whose compressed entries this layer attends (None: window only).
    index_source: layer whose top-k picks this layer uses (None: no selection, all entries or none).
    candidate_source: for Reindex layers with the hierarchical indexer, the layer that builds the pool.
    engram: whether an Engram module runs before this layer's attention.
    """

    index: int
    stage: str
    mode: str
    ratio: int
    kv_source: int | None
    index_source: int | None
    candidate_source: int | None
    engram: bool

    @property
    def stores_entries(self) -> bool:
        """Owns a compressor and stores global KV entries in the cache."""
        return self.kv_source == self.index and self.ratio > 0

    @property
    def stores_index_keys(self) -> bool:
        """Stores indexer keys beside its entries (V4.1 Full and V4 CSA layers)."""
        return self.stores_entries and self.mode in (FULL, CSA)

    @property
    def selects(self) -> bool:
        """Attends a top-k selection of entries (rather than none or all of them)."""
        return self.index_source is not None

    @property
    def rope(self) -> str:
        """Which RoPE table the layer uses: window-only layers the main one, others the compressed (YaRN)."""
        return "main" if self.ratio == 0 else "compressed"


def layer_plan(cfg) -> tuple[LayerRecord, ...]:
    """The per-layer plan of a model config; raises ConfigError naming the layer if it is inconsistent."""
    if "kv_layout" in cfg:
        raise ConfigError("kv_layout", cfg.model, "a reference KV layout has no layer plan; expected a model config")
    family = cfg.architecture.family
    records = _plan_v41(cfg) if family == schema.V41 else _plan_v4(cfg)
    engram_layers = list(cfg.architecture.engram.layers)
    for i in engram_layers:
        if not 0 <= i < len(records):
            raise ConfigError("architecture.engram.layers", engram_layers,
                              f"layer {i} does not exist; expected indices in 0..{len(records) - 1}")
    return tuple(dataclasses.replace(r, engram=r.index in engram_layers) for r in records)


def num_layers(cfg) -> int:
    if cfg.architecture.family == schema.V41:
        return cfg.csa2.encoder.layers + cfg.csa2.decoder.layers
    return len(cfg.v4.layer_types)


def _plan_v41(cfg) -> list[LayerRecord]:
    records: list[LayerRecord] = []
    for stage in ("encoder", "decoder"):
        s = cfg.csa2[stage]
        if s.first_two_layers == "swa_only":
            for _ in range(2):
                records.append(LayerRecord(len(records), stage, WINDOW, 0, None, None, None, False))
        kv_source = index_source = None  # sources never cross a stage: ratios differ
        for g, group in enumerate(s.groups):
            for j, mode in enumerate(group["modes"]):
                i = len(records)
                if mode != FULL and kv_source is None:
                    raise ConfigError(
                        f"csa2.{stage}.groups.{g}.modes", list(group["modes"]),
                        f"layer {i} is '{mode}' before any 'full' layer of the {stage}; "
                        "expected a 'full' layer first (it owns the compressor the others read)")
                if mode == FULL:
                    kv_source = index_source = i
                elif mode == REINDEX:
                    index_source = i
                records.append(LayerRecord(i, stage, mode, s.compression_ratio, kv_source, index_source, None, False))

    reindex = [r for r in records if r.mode == REINDEX]
    sources = sorted({r.kv_source for r in reindex})
    if len(sources) > 1:
        raise ConfigError("csa2", [r.index for r in reindex],
                          f"Reindex layers read the keys of different Full layers {sources}; "
                          "expected one candidate source (the Full layer that builds the pool)")
    if reindex and cfg.csa2.indexer.hierarchical.enabled:
        pool = sources[0]
        records = [dataclasses.replace(r, candidate_source=pool) if r.mode == REINDEX else r for r in records]
    return records


def _plan_v4(cfg) -> list[LayerRecord]:
    ratios = {WINDOW: 0, CSA: cfg.v4.csa_ratio, HCA: cfg.v4.hca_ratio}
    records = []
    for i, t in enumerate(cfg.v4.layer_types):
        own = None if t == WINDOW else i
        records.append(LayerRecord(i, "stack", t, ratios[t], own, i if t == CSA else None, None, False))
    return records


def engram_layers(cfg) -> tuple[int, ...]:
    """The Engram layers, ascending: the order of the model's `engram.{k}` modules and of the hash ids'
    columns."""
    return tuple(r.index for r in layer_plan(cfg) if r.engram)


def counts(plan) -> dict[str, int]:
    """Number of layers per mode."""
    out: dict[str, int] = {}
    for r in plan:
        out[r.mode] = out.get(r.mode, 0) + 1
    return out


# ------------------------------------------------------------------------------------------------
# Layer stacks: the groups the model scans over (DESIGN §9)


@dataclasses.dataclass(frozen=True)
class Stack:
    """`groups` identical groups of `width` consecutive layers, run as one `lax.scan` over parameters
    (and cache leaves) stacked on a leading layers axis of size `groups`; a stack of one group runs
    unrolled. layers[g][i]: the i-th layer of group g. Inside a group, `runs` cuts the layers into
    `slots`: slot j holds runs[j] consecutive identical layers (parameters [G, runs[j], ...]; a run of
    more than one layer is an inner `lax.scan`). Only layers that own no cache store and feed no other
    layer share a slot. The modules of slot j are built from the records of the template
    group's first layer of the slot, whose layer numbers are what a group's layers call each other (a
    source outside the stack is the same layer for every group).

    lead: group 0's slot 0 is not this stack's: layers[0][0] is the last layer of the stack before
    (V4.1-Flash's decoder Full layer 20), which ran already and whose hand-off (picks) group 0's later
    slots read in place of a slot-0 layer's (layers 21-23 join the `[reindex, reuse×3]` scan as its group
    0). Slot 0 then holds G - 1 layers ([G - 1, ...], group g at g - 1) and runs under a `lax.cond`
    (`nn.model.LayerStack.run`); the template is group 1."""

    layers: tuple[tuple[int, ...], ...]
    runs: tuple[int, ...] = ()  # () : one layer per slot
    lead: bool = False

    def __post_init__(self):
        if not self.runs:
            object.__setattr__(self, "runs", (1,) * len(self.layers[0]))
        assert sum(self.runs) == len(self.layers[0]), (self.layers, self.runs)

    @property
    def groups(self) -> int:
        return len(self.layers)

    @property
    def width(self) -> int:
        """Layers per group."""
        return len(self.layers[0])

    @property
    def slots(self) -> int:
        """Parameter slots per group: the layers traced for the stack."""
        return len(self.runs)

    @property
    def first(self) -> int:
        return self.layers[0][0]

    def offset(self, j: int) -> int:
        """Where slot j starts inside a group."""
        return sum(self.runs[:j])

    @property
    def template(self) -> int:
        """The group whose records the slots' modules are built from: 0, or 1 for a stack with a lead."""
        return int(self.lead)

    def skips(self, g, j: int) -> bool:
        """Whether group g (an int) has no layer of its own in slot j: group 0's slot 0 of a stack with a lead."""
        return self.lead and j == 0 and g == 0

    def slot_layers(self, g: int, j: int) -> tuple[int, ...]:
        """The layers of group g in slot j (runs[j] of them; none where the group skips the slot)."""
        if self.skips(g, j):
            return ()
        return self.layers[g][self.offset(j):self.offset(j) + self.runs[j]]

    def rows(self, j: int) -> int:
        """The size of slot j's leading layers axis: the groups that have the slot."""
        return self.groups - int(self.lead and j == 0)

    def row(self, g, j: int):
        """Group g's index on slot j's leading axis (g - 1 in slot 0 of a stack with a lead); g may be traced."""
        return g - 1 if self.lead and j == 0 else g

    def grid(self, j: int) -> tuple:
        """The layer numbers of slot j as its parameters' leading axes hold them: [G] (nested tuples
        [G][R] for a run of more than one layer; G - 1 groups in slot 0 of a stack with a lead)."""
        groups = [g for g in range(self.groups) if not self.skips(g, j)]
        if self.runs[j] == 1:
            return tuple(self.slot_layers(g, j)[0] for g in groups)
        return tuple(self.slot_layers(g, j) for g in groups)

    def locate(self, layer: int) -> tuple[int, int, int] | None:
        """(group, slot, position in the slot's run) of a layer of this stack, else None (the lead's too)."""
        for g, group in enumerate(self.layers):
            if layer in group:
                i = group.index(layer)
                j = max(k for k in range(self.slots) if self.offset(k) <= i)
                if self.skips(g, j):
                    return None
                return g, j, i - self.offset(j)
        return None


def _signature(r: LayerRecord, start: int, hash_layers: int, pools: set) -> tuple:
    """What must agree for two layers to share a stack slot: their kind, and their sources relative to the
    first layer of their group (inside the group) or as the same layer (outside it)."""
    rel = lambda src: None if src is None else (("in", src - start) if src >= start else ("out", src))
    return (r.stage, r.mode, r.ratio, r.index < hash_layers, r.index in pools,
            rel(r.kv_source), rel(r.index_source), rel(r.candidate_source))


def layer_stacks(cfg, leads: bool = True) -> tuple[Stack, ...]:
    """The plan cut into stacks, left to right: at each layer the run of repeated groups that covers the
    most layers (a shorter group on ties), else the layer alone. Engram does not split stacks: its tables
    sit outside them (`nn.model.Transformer.engram_step`). A group whose layers are read by a later layer
    outside it does not stack (only a one-group stack hands its results on). Then a stack of groups whose
    slot 0 is an index source is extended by one group at its front when the layers before it are a
    group without its slot 0 whose index source is the layer before them (`Stack.lead`). leads=False:
    the stacks without that step (the layout of checkpoints written before it, `checkpoint.Checkpointer`)."""
    return _stacks(layer_plan(cfg), int(cfg.architecture.moe.hash_layers), leads)


@functools.lru_cache(maxsize=32)
def _stacks(plan: tuple[LayerRecord, ...], hash_layers: int, leads: bool = True) -> tuple[Stack, ...]:
    n = len(plan)
    pools = {r.candidate_source for r in plan if r.candidate_source is not None}
    readers = {}  # source layer -> the layers that read it
    for r in plan:
        for src in (r.kv_source, r.index_source, r.candidate_source):
            if src is not None and src != r.index:
                readers.setdefault(src, set()).add(r.index)
    stacks, i = [], 0
    while i < n:
        best = (1, 1)  # (period, repeats)
        for p in range(1, (n - i) // 2 + 1):
            head = [_signature(plan[i + j], i, hash_layers, pools) for j in range(p)]
            if any(plan[i + j].stage != plan[i].stage for j in range(p)):
                break
            reps = 1
            while i + (reps + 1) * p <= n and all(
                    _signature(plan[i + reps * p + j], i + reps * p, hash_layers, pools) == head[j]
                    for j in range(p)):
                reps += 1
            while reps > 1 and any(reader >= i + reps * p for src in range(i, i + reps * p)
                                   for reader in readers.get(src, ())):
                reps -= 1
            if reps > 1 and p * reps > best[0] * best[1]:
                best = (p, reps)
        p, reps = best
        stacks.append(Stack(tuple(tuple(range(i + g * p, i + (g + 1) * p)) for g in range(reps)),
                            _runs(plan, i, p, hash_layers, pools, readers)))
        i += p * reps
    return tuple(_with_leads(plan, stacks, hash_layers, pools) if leads else stacks)


def _with_leads(plan, stacks: list, hash_layers: int, pools: set) -> list:
    """`stacks` with each scanned stack whose slot 0 is an index source that owns no store (a Reindex layer)
    grown by a group 0 at its front that lacks slot 0: the layers v + 1 .. first - 1 (v = first - width,
    the end of an earlier stack) when they match the template group's later slots, with layer v standing
    for slot 0 wherever a layer reads it (V4.1-Flash: 21-23, reading Full layer 20's entries and picks,
    join `[reindex, reuse×3]` × 4)."""
    out = list(stacks)
    k = 0
    while k < len(out):
        st = out[k]
        v, head = st.first - st.width, plan[st.first]
        starts = [m for m in range(k) if out[m].first == v + 1]
        if (st.groups < 2 or st.lead or st.runs[0] != 1 or v < 0 or not starts or head.stores_entries
                or head.index_source != head.index or plan[v].index_source != v or plan[v].stage != head.stage):
            k += 1
            continue
        template = [_signature(plan[st.first + i], st.first, hash_layers, pools) for i in range(st.width)]

        def fits(i):  # layer v + i against the template's position i, v standing for slot 0's layer
            r, want = plan[v + i], template[i]
            mine = list(_signature(r, v, hash_layers, pools))
            for f, src in zip(range(5, 8), (r.kv_source, r.index_source, r.candidate_source)):
                if src == v and want[f] == ("out", v):
                    mine[f] = want[f]
            return tuple(mine) == want

        if all(fits(i) for i in range(1, st.width)):
            m = starts[0]
            out[m:k + 1] = [Stack(((v, *range(v + 1, st.first)), *st.layers), st.runs, lead=True)]
            k = m
        k += 1
    return out


def _runs(plan, start: int, width: int, hash_layers: int, pools: set, readers: dict) -> tuple[int, ...]:
    """The slots of a group starting at `start`: runs of consecutive layers with one signature that own no
    store and feed no layer (V4.1-Flash's Reuse layers after a Full or Reindex)."""
    def plain(r):
        return not r.stores_entries and r.index not in readers and r.index not in pools

    runs, i = [], start
    while i < start + width:
        n = 1
        sig = _signature(plan[i], start, hash_layers, pools)
        while (i + n < start + width and plain(plan[i]) and plain(plan[i + n])
               and _signature(plan[i + n], start, hash_layers, pools) == sig):
            n += 1
        runs.append(n)
        i += n
    return tuple(runs)


def layer_slot(cfg, layer: int) -> tuple[int, int, int, int]:
    """(stack, group, slot, position in the slot's run) of a layer: where its parameters and cache leaves
    sit."""
    for s, st in enumerate(layer_stacks(cfg)):
        at = st.locate(layer)
        if at is not None:
            return (s, *at)
    raise ValueError(f"layer: {layer}: expected 0..{num_layers(cfg) - 1}")
