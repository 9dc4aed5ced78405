"""flop_model: the analytic matmul FLOPs per token equal XLA's dot count of the same step lowered at static
shapes, and the precision-weighted sweep equals a hand count from the config's numbers."""

import pytest

import dsv41
from dsv41 import compile_report, flop_model, hlo_cost
from dsv41.errors import ConfigError


def _xla_per_token(cfg, *, context: int, seq: int = 1, batch: int = 1) -> tuple[float, float]:
    """(dot FLOPs, cost-analysis FLOPs) per new token of the step `compile_report.lowered_flops_per_token`
    lowers: one CPU device, the XLA reference path, every layer unrolled, experts one matmul per pick."""
    lowered = compile_report.flop_counting_lowering(cfg, batch=batch, context=context, weights="shipped", seq=seq)
    cost = lowered.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    tokens = batch * seq
    return hlo_cost.dot_flops(lowered.as_text(dialect="hlo")) / tokens, float(cost["flops"]) / tokens


@pytest.mark.parametrize("name,context,batch", [
    ("tiny", 256, 1), ("tiny", 512, 1),
    ("small", 1024, 2), ("small", 4096, 1),
    ("tiny_v4", 256, 1), ("tiny_v4", 512, 2),
])
def test_decode_dots_equal_xla(name, context, batch):
    cfg = dsv41.load_config(name)
    dots, everything = _xla_per_token(cfg, context=context, batch=batch)
    analytic = flop_model.flops_per_token(cfg, context=context)["total"]
    assert analytic == pytest.approx(dots, rel=1e-9)
    assert everything > analytic  # XLA's own total adds the elementwise work


@pytest.mark.parametrize("name,context,seq,overrides", [
    ("tiny", 256, 8, ()),   # a chunk: ring + new window keys, wk over ceil(S/2) entries, Reindex scores all
    ("tiny", 256, 40, ()),  # S >= 2W: banded window blocks
    ("tiny_v4", 256, 33, ()),
    # no pool: the encoder's Full layers (128 entries) pick every entry unscored and attend the whole store
    ("tiny", 256, 1, ("csa2.indexer.hierarchical.enabled=false", "csa2.indexer.top_k=128")),
    ("tiny", 32, 1, ("csa2.indexer.top_k=32",)),  # top-k over every entry: not scored unless building the pool
    ("tiny", 256, 1, ("architecture.engram.layers=[1,4]",)),
])
def test_other_steps_dots_equal_xla(name, context, seq, overrides):
    cfg = dsv41.load_config(name, overrides=list(overrides))
    dots, _ = _xla_per_token(cfg, context=context, seq=seq)
    assert flop_model.flops_per_token(cfg, context=context, seq=seq)["total"] == pytest.approx(dots, rel=1e-9)


def test_weighted_sweep_matches_a_hand_count_on_tiny():
    cfg = dsv41.load_config("tiny")
    # configs/tiny.json
    d, h, k, q, groups, o_rank, vocab, window, streams = 64, 4, 64, 32, 2, 16, 256, 16, 4
    experts, picks, inter, heads_i, dim_i, top_k, pool = 8, 2, 32, 32, 32, 8, 4 * 8
    a = cfg.architecture
    assert (a.hidden_size, a.num_heads, a.head_dim, a.q_lora_rank, a.o_groups, a.o_lora_rank, a.vocab_size,
            cfg.kv_cache.swa_window_size, a.mhc.streams, a.moe.num_experts, a.moe.top_k,
            a.moe.intermediate_size, cfg.csa2.indexer.query_heads, cfg.csa2.indexer.head_dim,
            cfg.csa2.indexer.top_k) == (d, h, k, q, groups, o_rank, vocab, window, streams, experts, picks, inter,
                                        heads_i, dim_i, top_k)
    # 12 layers: window ×2, [full, reuse] ×2 at ratio 2, [full, reuse] + [reindex, reuse] ×2 at ratio 1.
    bf16 = 12 * (2 * (2 * streams * d * 6 * streams + 2 * streams * streams * d)   # mHC, 2 sites
                 + 2 * d * experts)                                                # router
    fp8 = 12 * (2 * d * q + 2 * q * h * k + 2 * d * k + 4 * h * k * window        # q, kv, window keys
                + 2 * h * k * o_rank + 2 * groups * o_rank * d                     # o
                + 6 * d * inter)                                                   # shared expert
    fp4 = 12 * picks * 6 * d * inter + 10 * 4 * h * k * top_k                      # routed, selected entries
    bf16 += 2 * (4 * d * k) + 2 * d * k                                            # compressors: 2 at ratio 2, 1 at 1
    fp8 += 3 * 2 * k * dim_i + 5 * 2 * q * heads_i * dim_i                         # indexer wk, wq_b
    bf16 += 5 * 2 * d * heads_i + 2 * d * vocab                                    # weights_proj, head

    def scores(t):  # Full: 2 over t/2 entries, 1 over t; Reindex: 2 over the pool
        return 2 * heads_i * dim_i * (2 * t // 2 + t + 2 * pool)

    rows = flop_model.weighted_sweep(cfg, [256, 512])
    for row, t in zip(rows, (256, 512)):
        assert row["context"] == t
        assert row["flops"] == bf16 + fp8 + fp4 + scores(t)
        assert row["weighted"] == bf16 + 0.5 * fp8 + 0.25 * (fp4 + scores(t))
    assert rows[0]["flops_relative"] == rows[0]["weighted_relative"] == 1
    assert rows[1]["flops_relative"] == pytest.approx((bf16 + fp8 + fp4 + scores(512))
                                                      / (bf16 + fp8 + fp4 + scores(256)))
    assert rows[1]["weighted_relative"] == pytest.approx((bf16 + 0.5 * fp8 + 0.25 * (fp4 + scores(512)))
                                                         / (bf16 + 0.5 * fp8 + 0.25 * (fp4 + scores(256))))


def test_attention_core_weights_follow_the_stored_formats():
    v41, v4 = (flop_model.flops_per_token(dsv41.load_config(n), context=4096)["mechanisms"]
               for n in ("v41_flash", "v4_flash"))
    # V4.1: FP8 window ring, FP4 entries (DESIGN §3.8); V4: 448 FP8 + 64 BF16 RoPE dims in both (DESIGN §4).
    assert (v41["attention.window"]["precision"], v41["attention.entries"]["precision"]) == (0.5, 0.25)
    assert v4["attention.window"]["precision"] == v4["attention.entries"]["precision"] == (448 * 0.5 + 64) / 512
    assert v41["indexer.scores"]["precision"] == v4["indexer.scores"]["precision"] == 0.25
    assert v41["moe.routed"]["precision"] == 0.25 and v41["head"]["precision"] == 1


def test_kinds_cover_the_plan():
    f = flop_model.flops_per_token(dsv41.load_config("tiny"), context=256)
    assert {k: v["layers"] for k, v in f["kinds"].items()} == {
        "window": 2, "full/2": 2, "reuse/2": 2, "full/1": 1, "reuse/1": 3, "reindex/1": 2}
    head = f["mechanisms"]["head"]["flops"]
    assert sum(v["total"] for v in f["kinds"].values()) + head == pytest.approx(f["total"], rel=1e-12)


@pytest.mark.parametrize("field,kwargs", [
    ("context", {"context": 0}), ("context", {"context": 4096.0}), ("context", {"context": True}),
    ("seq", {"context": 4096, "seq": -1}), ("weights", {"context": 4096, "weights": "fp4"}),
])
def test_bad_input_names_the_field(field, kwargs):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        flop_model.flops_per_token(dsv41.load_config("tiny"), **kwargs)


def test_bad_config_and_contexts_name_the_field():
    with pytest.raises(ConfigError, match="architecture.family"):
        flop_model.flops_per_token(dsv41.load_config("deepseek_v1_67b"), context=4096)
    with pytest.raises(ConfigError, match="'contexts'"):
        flop_model.weighted_sweep(dsv41.load_config("tiny"), [])
