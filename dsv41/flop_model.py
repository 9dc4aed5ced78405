"""Analytic matmul FLOPs per new token of a cached step (issue 21), raw and precision-weighted.

A closed formula from the config: for each layer of the plan, each dot the cached step
(`nn.attention.Attention.step`, `nn.attention_v4`, `nn.block.Block`, `steps.step_body`) runs, counted
as 2·M·N·K, divided by the S new tokens of the step (S = 1: decode). `context` is the cache's capacity
(rounded up to a multiple of the compression ratios, as the cache rounds it): the step's shapes are
static, so a Full (V4.1) or CSA (V4) layer scores every entry the capacity holds — what a query at the
end of a full row sees — and an HCA layer attends all of them. The counted arithmetic is what XLA's dot
count of the FLOP-counting lowering is (`compile_report.lowered_flops_per_token`: experts one matmul
per pick, loops unrolled); elementwise work (norms, softmaxes, RoPE, Sinkhorn, quantisation, the
Hadamard butterflies, top-k) is not a matmul and is not counted. The attention sink is a per-head logit
in the softmax's denominator: no matmul.

Precision weights (DeepSeek's report: BF16 1, FP8 0.5, FP4 0.25; wider formats count as BF16), by the
format of the operand the weights or cache store, as shipped (DESIGN §2, §3.8):
- FP8 (0.5): the dense projections — attention wq_a, wq_b, wkv, wo_a, wo_b; the indexer's wq_b and wk;
  the shared experts; Engram's wkv (FP8 e4m3, 32×32 blocks).
- MXFP4 (0.25): the routed experts.
- kept in BF16 / FP32 (1): the compressors' wkv and wgate (the released checkpoint keeps them in higher
  precision; the model pools in fp32), the indexer's weights_proj (BF16 in DeepSeek's checkpoints since
  V3.2), the MoE router (fp32 logits; V3's FP8 recipe keeps gating in BF16), mHC (fp32 parameters and
  math), the output head (BF16 in DeepSeek's FP8 releases, with the embedding).
- the attention core by the format of the keys / values it reads: window keys as the ring stores them
  (`kv_cache.swa_kv_dtype`: FP8 for both families; V4's RoPE dims BF16), compressed entries as stored
  (`kv_cache.global_kv_dtype`: V4.1 FP4; V4 FP8 with BF16 RoPE dims), each dim at its own format —
  V4 gives (448·0.5 + 64·1)/512 = 0.5625. The queries are BF16: the report counts a dot by its
  narrow operand.
- indexer scores: q and k FP4 (`kv_cache.index_kv_dtype`, 0.25).
"""

from __future__ import annotations

import math
import numbers

from dsv41 import accounting, formats, schema
from dsv41.config import family
from dsv41.errors import ConfigError
from dsv41.plan import FULL, HCA, REINDEX, LayerRecord, layer_plan

BF16, FP8, FP4 = 1.0, 0.5, 0.25
# The figure: decode contexts from 4K to 1M.
SWEEP_CONTEXTS = (4096, 16384, 65536, 262144, 1048576)

# Each counted term, in the order a layer runs them, with the class of its arithmetic (None: it depends on
# the config, `_precisions`).
TERMS = {
    "mhc": BF16,
    "engram": FP8,
    "attention.q": FP8,          # wq_a, wq_b
    "attention.kv": FP8,         # wkv
    "attention.window": None,    # q·k and p·v over the window keys
    "attention.entries": None,   # q·k and p·v over the selected (or all visible) compressed entries
    "attention.o": FP8,          # grouped wo_a, wo_b
    "compressor": BF16,          # wkv, wgate
    "indexer.keys": None,        # V4.1: wk (FP8); V4: its own compressor (BF16)
    "indexer.query": FP8,        # wq_b
    "indexer.weights": BF16,     # weights_proj
    "indexer.scores": None,      # Σ_j w_j relu(q_j · k)
    "moe.router": BF16,
    "moe.routed": FP4,
    "moe.shared": FP8,
    "head": BF16,                # (V4: hc_head's mix is counted under "mhc")
}


def _format_weight(dtype: str) -> float:
    """The report's weight of arithmetic on a stored element format: 16 bits or more count as BF16."""
    return min(formats.ELEMENT_BITS[dtype], 16) / 16


def _stored_weight(parts, width: int) -> float:
    """The weight of a dot over a `width`-channel vector stored as `parts` (each channel at its format)."""
    return sum(p.dims * _format_weight(p.dtype) for p in parts) / width


WEIGHTS = ("shipped", "bf16")  # the weight formats (`dsv41.nn.weights`) a count is weighted for


def _precisions(cfg, weights: str = "shipped") -> dict[str, float]:
    """Each term's weight for this config. weights: "shipped", the model as released (FP8 dense weights, MXFP4
    routed experts, and the cache in the formats its official inference stores, `kv_cache.*`), or "bf16" (every
    weight at BF16, as dsv41 runs the small trained models; the cache as configured: with `quant: none` it
    holds the compute dtype, and the attention core and the indexer scores count as BF16)."""
    if weights not in WEIGHTS:
        raise ConfigError("weights", weights, f"expected one of {WEIGHTS}")
    k = cfg.architecture.head_dim
    out = dict(TERMS)
    out["indexer.keys"] = FP8 if family(cfg) == schema.V41 else BF16
    if weights == "bf16":
        out = {t: BF16 for t in out}
    stored = weights == "shipped" or cfg.quant == "qat"
    out["attention.window"] = _stored_weight(accounting.window_row_parts(cfg), k) if stored else BF16
    out["attention.entries"] = _stored_weight(accounting.main_entry_parts(cfg), k) if stored else BF16
    out["indexer.scores"] = _format_weight(cfg.kv_cache.index_kv_dtype) if stored else BF16
    return out


def _positive_int(field: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ConfigError(field, value, "expected a positive whole number of tokens")
    return int(value)


def capacity(cfg, context: int) -> int:
    """The cache capacity a row of `context` tokens gets: rounded up to a multiple of every compression
    ratio (`cache.round_capacity` without its context-window limit: the formula has none)."""
    ratios = sorted({r.ratio for r in layer_plan(cfg) if r.ratio})
    step = math.lcm(*ratios) if ratios else 1
    return -(-context // step) * step


def _window_keys(cfg, seq: int) -> float:
    """Window key slots per new token that each query's q·k and p·v run over (`attend.window_keys`): the
    ring after the write (decode), ring + chunk (S < 2W), or banded blocks of 2W keys per W queries."""
    w = cfg.kv_cache.swa_window_size
    if seq == 1:
        return w
    if seq < 2 * w:
        return w + seq
    blocks = -(-seq // w)
    return blocks * w * 2 * w / seq


def layer_flops(cfg, rec: LayerRecord, *, capacity: int, seq: int, builds_pool: bool) -> dict[str, float]:
    """{term: matmul FLOPs per new token} of one layer (its mHC sites, Engram, attention and MoE)."""
    a = cfg.architecture
    d, h, k, q_rank, n = a.hidden_size, a.num_heads, a.head_dim, a.q_lora_rank, a.mhc.streams
    m = a.moe
    out = {
        # Per site: the mix fn·flat [N·D → (2+N)·N] and the residual update Σ_j comb[j, k] X_j; two sites.
        "mhc": 2 * (2 * n * d * (2 + n) * n + 2 * n * n * d),
        "attention.q": 2 * d * q_rank + 2 * q_rank * h * k,
        "attention.kv": 2 * d * k,
        "attention.window": 4 * h * k * _window_keys(cfg, seq),
        "attention.o": 2 * h * k * a.o_lora_rank + 2 * a.o_groups * a.o_lora_rank * d,
        "moe.router": 2 * d * m.num_experts,  # hash-routed layers (V4) compute the scores too
        "moe.routed": m.top_k * 3 * 2 * d * m.intermediate_size,
        "moe.shared": m.num_shared_experts * 3 * 2 * d * m.intermediate_size,
    }
    if rec.engram:
        e = a.engram
        columns = (e.max_ngram - 1) * e.heads_per_ngram
        out["engram"] = 2 * columns * e.row_dim * (n + 1) * d
    if rec.ratio:
        branch = _v41_branch if family(cfg) == schema.V41 else _v4_branch
        out.update(branch(cfg, rec, capacity // rec.ratio, seq, builds_pool))
    return out


def _v41_branch(cfg, rec: LayerRecord, entries: int, seq: int, builds_pool: bool) -> dict[str, float]:
    """The compressed branch of a V4.1 layer (`Attention.step`, `cached_compressed`)."""
    a, ixc = cfg.architecture, cfg.csa2.indexer
    d, h, k = a.hidden_size, a.num_heads, a.head_dim
    heads, dim, top_k = ixc.query_heads, ixc.head_dim, ixc.top_k
    every_entry = not ixc.hierarchical.enabled
    # Without a pool, top-k of at least every entry attends the whole store; else the k picks (−1 padded).
    attended = entries if every_entry and top_k >= entries else top_k
    out = {"attention.entries": 4 * h * k * attended}
    if rec.stores_entries:
        # ratio > 1: wkv and wgate; ratio 1: wkv alone. Then wk over the ceil(S / m) entries the step may emit.
        out["compressor"] = (2 if rec.ratio > 1 else 1) * 2 * d * k
        out["indexer.keys"] = 2 * k * dim * -(-seq // rec.ratio) / seq
    if rec.mode in (FULL, REINDEX):
        # Top-k of at least every entry picks every visible one whatever the scores: nothing is scored.
        if top_k >= entries and not builds_pool and rec.candidate_source is None:
            return out
        out["indexer.query"] = 2 * a.q_lora_rank * heads * dim
        out["indexer.weights"] = 2 * d * heads
        # Reindex decode scores the gathered pool's keys; everything else every entry of the store.
        pool = ixc.hierarchical.max_blocks * ixc.hierarchical.positions_per_block
        scored = pool if rec.candidate_source is not None and seq == 1 else entries
        out["indexer.scores"] = 2 * heads * dim * scored
    return out


def _v4_branch(cfg, rec: LayerRecord, entries: int, seq: int, builds_pool: bool) -> dict[str, float]:
    """The compressed branch of a V4 layer (`AttentionV4.cached_compressed`): HCA attends every entry, CSA
    its top-k; both compressors project wkv and wgate, CSA's (and its indexer's) at twice the width (overlap)."""
    a, ixc = cfg.architecture, cfg.v4.indexer
    d, h, k = a.hidden_size, a.num_heads, a.head_dim
    if rec.mode == HCA:
        return {"attention.entries": 4 * h * k * entries, "compressor": 2 * 2 * d * k}
    heads, dim = ixc.query_heads, ixc.head_dim
    return {
        "attention.entries": 4 * h * k * ixc.top_k,
        "compressor": 2 * 2 * d * 2 * k,
        "indexer.keys": 2 * 2 * d * 2 * dim,  # the indexer's own overlapped compressor
        "indexer.query": 2 * a.q_lora_rank * heads * dim,
        "indexer.weights": 2 * d * heads,
        "indexer.scores": 2 * heads * dim * entries,
    }


def _kind(rec: LayerRecord) -> str:
    return rec.mode if rec.ratio == 0 else f"{rec.mode}/{rec.ratio}"


def flops_per_token(cfg, *, context: int, seq: int = 1, weights: str = "shipped") -> dict:
    """Matmul FLOPs per new token of one step of S = `seq` new tokens per row (1: decode) over a cache of
    `context` tokens, raw and precision-weighted (module docstring; weights: `_precisions`').

    Returns {"model", "context", "capacity", "seq",
             "layers": [{"index", "kind", "flops": {term: FLOPs}, "total", "weighted"}],
             "kinds": {kind ("window", "full/2", "reuse/1", "csa/4", …): {"layers", "total", "weighted"}},
             "mechanisms": {term: {"flops", "precision", "weighted"}} over the whole model,
             "total", "weighted"}."""
    if family(cfg) not in (schema.V41, schema.V4):
        raise ConfigError("architecture.family", family(cfg), f"expected {schema.V41!r} or {schema.V4!r}")
    context, seq = _positive_int("context", context), _positive_int("seq", seq)
    plan = layer_plan(cfg)
    cap = capacity(cfg, context)
    pools = {r.candidate_source for r in plan if r.candidate_source is not None}
    weight = _precisions(cfg, weights)

    layers, kinds = [], {}
    mechanisms = {name: 0.0 for name in TERMS}
    for rec in plan:
        terms = layer_flops(cfg, rec, capacity=cap, seq=seq, builds_pool=rec.index in pools)
        total, weighted = sum(terms.values()), sum(v * weight[t] for t, v in terms.items())
        layers.append({"index": rec.index, "kind": _kind(rec), "flops": terms, "total": total, "weighted": weighted})
        kind = kinds.setdefault(_kind(rec), {"layers": 0, "total": 0.0, "weighted": 0.0})
        kind["layers"] += 1
        kind["total"] += total
        kind["weighted"] += weighted
        for t, v in terms.items():
            mechanisms[t] += v

    # The head runs once per row, at its last new token (`steps._head`); V4's hc_head mix is mHC.
    a = cfg.architecture
    mechanisms["head"] += 2 * a.hidden_size * a.vocab_size / seq
    if a.mhc.variant == "classic":
        mechanisms["mhc"] += 2 * a.mhc.streams * a.hidden_size * a.mhc.streams / seq
    mech = {t: {"flops": v, "precision": weight[t], "weighted": v * weight[t]} for t, v in mechanisms.items() if v}
    return {"model": cfg.model, "context": context, "capacity": cap, "seq": seq, "layers": layers, "kinds": kinds,
            "mechanisms": mech, "total": sum(v["flops"] for v in mech.values()),
            "weighted": sum(v["weighted"] for v in mech.values())}


def weighted_sweep(cfg, contexts=SWEEP_CONTEXTS, weights: str = "shipped") -> list[dict]:
    """Decode FLOPs per token by context, raw and precision-weighted, each relative to the first context:
    [{"context", "flops", "weighted", "flops_relative", "weighted_relative"}]."""
    contexts = list(contexts)
    if not contexts:
        raise ConfigError("contexts", contexts, "expected at least one context (the first is the reference)")
    rows = []
    for t in contexts:
        f = flops_per_token(cfg, context=t, weights=weights)
        rows.append({"context": t, "flops": f["total"], "weighted": f["weighted"]})
    for r in rows:
        r["flops_relative"] = r["flops"] / rows[0]["flops"]
        r["weighted_relative"] = r["weighted"] / rows[0]["weighted"]
    return rows


def format_sweep(name: str, rows: list[dict]) -> str:
    """A text table of `weighted_sweep`'s rows."""
    lines = [f"{name}: decode FLOPs per token (relative to {rows[0]['context']})",
             f"{'context':>9} {'raw':>11} {'rel':>7} {'weighted':>11} {'rel':>7}"]
    for r in rows:
        lines.append(f"{r['context']:>9} {r['flops']:>11.4g} {r['flops_relative']:>6.3f}× "
                     f"{r['weighted']:>11.4g} {r['weighted_relative']:>6.3f}×")
    return "\n".join(lines)
