"""`dsv41 verify` (DESIGN §15) against independent sources: the cache's bytes against the closed formula
written out here from the config's fields, a passkey cell recomputed through `dsv41.passkey`, the FP8/FP4 main
KV ratio against the element and scale widths, and the PNGs read back as images of the documented size."""

import json
import struct

import pytest

import dsv41
from dsv41 import cli, flop_model, passkey, verify, verify_report
from dsv41.errors import ConfigError

# The README's `dsv41 verify --quick --out verify-quick`, run as written: its sweep's first context, the accuracy
# cell recomputed here, the prompts per cell, the seed and chunk it runs with (verify.QUICK and the defaults).
CONTEXT, ACC_CONTEXT, DEPTH, N, SEED, CHUNK = 1024, 1024, 0.5, 2, 0, 512
assert (verify.QUICK["contexts"][0], verify.QUICK["accuracy_contexts"], verify.QUICK["n"]) == (CONTEXT, (ACC_CONTEXT,), N)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    import readme

    work = readme.workdir(tmp_path_factory.mktemp("verify"))
    run = readme.run_bash(readme.block("Verify the compression"), work, timeout=1500)
    assert run.returncode == 0, readme.failure(run)
    out = work / "verify-quick"
    return out, json.loads((out / "results.json").read_text())


def closed_formula(cfg, capacity: int) -> int:
    """The packed V4.1 cache's bytes, written out from the config: per Full layer and stored entry, main values
    (K elements of 4 or 8 bits) + one E4M3 byte per 16, indexer keys (d_I FP4 values + one UE8M0 byte per 32);
    per layer a ring of W FP8 rows (K bytes + one UE8M0 byte per 32), its window start; a ratio-r compressor's
    r − 1 fp32 leftovers of 2K; the row's length."""
    a, kv, ix = cfg.architecture, cfg.kv_cache, cfg.csa2.indexer
    k, w = a.head_dim, kv.swa_window_size
    bits = 8 if kv.global_kv_dtype in ("fp8", "fp8_e4m3") else 4
    plan = dsv41.layer_plan(cfg)
    full = [r for r in plan if r.kv_source == r.index and r.ratio]
    entries = sum(capacity // r.ratio * (k * bits // 8 + k // 16 + ix.head_dim // 2 + ix.head_dim // 32) for r in full)
    rings = len(plan) * (w * (k + k // 32) + 4)
    leftovers = sum((r.ratio - 1) * 2 * k * 4 for r in full)
    return entries + rings + leftovers + 4


@pytest.mark.slow  # the README's quick run: the passkey model's steps for eight variants (~4.5 min)
def test_the_report_against_independent_sources(report):
    out, r = report
    cfg = dsv41.load_config("passkey")
    fp8 = dsv41.load_config("passkey", ["kv_cache.global_kv_dtype=fp8"])
    mem = r["memory"]
    assert mem["shipped"]["by_context"][0]["capacity"] >= CONTEXT + verify.NEW_TOKENS
    for name, c in (("shipped", cfg), ("fp8-kv", fp8)):   # every context's cache, and the largest one's
        rows = mem[name]["by_context"]
        for row in rows:
            assert row["cache_bytes"] == row["formula_bytes"] == closed_formula(c, row["capacity"]), (name, row)
        hi = max(row["capacity"] for row in rows)
        assert mem[name]["cache_bytes"] == mem[name]["formula_bytes"] == closed_formula(c, hi)
    assert mem["quant-none"]["formula_bytes"] is None  # the float cache: no format to hold it against
    k = cfg.architecture.head_dim
    assert r["fp8_over_fp4_main_kv"]["formats"] == pytest.approx((k + k // 16) / (k // 2 + k // 16))
    assert r["fp8_over_fp4_main_kv"]["measured"] == pytest.approx(r["fp8_over_fp4_main_kv"]["formats"])
    sweep = r["sweep"][0]
    assert sweep["context"] == CONTEXT and sweep["tokens_held"] == sweep["prompt_tokens"] + verify.NEW_TOKENS - 1
    assert sweep["latency_128_s"] > sweep["latency_1_s"] > 0 and sweep["decode_flops"]["raw"] > 0
    assert sweep["decode_flops"]["weighted"] < sweep["decode_flops"]["raw"]
    assert sweep["memory"]["peak_during"] >= sweep["memory"]["before"] > 0
    # One passkey cell, recomputed through dsv41.passkey.
    _, params = passkey.load_trained()
    want = passkey.accuracy(params, cfg, ACC_CONTEXT, DEPTH, N, seed=SEED, chunk=CHUNK)
    cell = next(c for c in r["accuracy"]["shipped"] if (c["context"], c["depth"]) == (ACC_CONTEXT, DEPTH))
    assert (cell["accuracy"], cell["decoded"]) == (want["accuracy"], want["decoded"])
    # Each variant's cells, and the prefix-cache restore with the rings from the pool beside bounded replay's.
    assert set(r["accuracy"]) == {verify.REFERENCE, *verify.VARIANTS, "replay-exact"}
    assert len(r["accuracy"]["replay-exact"]) == len(r["accuracy"]["replay"])
    for name, agree in r["logits"].items():
        assert 0 <= agree["top1_agreement"] <= 1 and agree["mean_kl"] >= 0 and agree["positions"] == N * passkey.DIGITS
    # The plots: PNGs of the documented size, embedded in the report.
    text = (out / "report.md").read_text()
    assert sorted(r["plots"]) == ["accuracy.png", "flops.png", "latency.png", "memory.png"]
    for name in r["plots"]:
        head = (out / name).read_bytes()[:24]
        assert head[:8] == b"\x89PNG\r\n\x1a\n"
        assert struct.unpack(">II", head[16:24]) == (verify_report.PLOT_SIZE[0] * verify_report.PLOT_DPI,
                                                     verify_report.PLOT_SIZE[1] * verify_report.PLOT_DPI)
        assert f"({name})" in text
    doctor = {d["check"]: d["status"] for d in r["doctor"]}
    assert doctor["shipped: cache bytes = formula"] == "ok" and doctor["fp8-kv: cache bytes = formula"] == "ok"
    assert doctor["quant-none: cache bytes = formula"] == "warn"


def test_the_doctor_names_each_mistake():
    cfg = dsv41.load_config("passkey", ["kv_cache.swa_kv_dtype=bf16", "swa_bounded_replay.decoder_replay_tokens=16"])
    found = {d["check"]: d for d in verify.doctor(cfg, [20000])}
    assert found["window KV is FP8"]["status"] == "warn" and "'bf16'" in found["window KV is FP8"]["detail"]
    assert found["encoder_replay_tokens covers the window"]["status"] == "ok"
    assert found["decoder_replay_tokens covers the window"]["status"] == "warn"
    assert "holds 16 of its 32" in found["decoder_replay_tokens covers the window"]["detail"]
    with pytest.raises(ConfigError, match="encoder_replay_tokens"):  # longer than the window: refused at load
        dsv41.load_config("passkey", ["swa_bounded_replay.encoder_replay_tokens=64"])
    assert found["context window holds the prompts"]["status"] == "error"
    assert "maximum-context" in found["context window holds the prompts"]["detail"]
    ok = verify.doctor(dsv41.load_config("passkey"), [4096])
    assert all(d["status"] == "ok" for d in ok)


def test_bad_arguments_name_the_flag(tmp_path):
    for argv, flag in [(["--contexts", "20000"], "--contexts"), (["--contexts", "4k"], "--contexts"),
                       (["--variants", "shipped,fp16"], "--variants"), (["--depths", "0.5,2"], "--depths"),
                       (["--n", "0"], "--n"), (["--accuracy-contexts", "50"], "--accuracy-contexts")]:
        args = cli.build_parser().parse_args(["verify", "--out", str(tmp_path), *argv])
        with pytest.raises(ConfigError, match=f"'{flag}'"):
            verify.run(args)
    assert not any(tmp_path.iterdir())  # refused before anything ran
    with pytest.raises(ConfigError, match="context_window"):
        verify.check_contexts(dsv41.load_config("passkey"), [16384], "--contexts")


def test_decode_flops_weigh_the_matmuls_by_their_formats_and_the_rest_at_one():
    """verify's weighted decode FLOPs: flop_model's matmuls at their weights (a hand count of the one term
    that moves with the stored format here: the selected entries' attention, FP4 shipped vs FP8) and
    XLA's elementwise rest at 1."""
    cfg = dsv41.load_config("passkey")
    t = 1024
    r = verify.decode_flops(cfg, t)
    m = flop_model.flops_per_token(cfg, context=t, weights="bf16")
    assert r["matmul"] == m["total"] and r["raw"] > r["matmul"]
    assert r["weighted"] == pytest.approx(m["weighted"] + r["raw"] - r["matmul"], rel=1e-12)
    a, ix = cfg.architecture, cfg.csa2.indexer
    selected = sum(4 * a.num_heads * a.head_dim * min(ix.top_k, t // rec.ratio)
                   for rec in dsv41.layer_plan(cfg) if rec.ratio)
    fp8 = flop_model.flops_per_token(dsv41.load_config("passkey", ["kv_cache.global_kv_dtype=fp8"]), context=t,
                                     weights="bf16")
    assert fp8["weighted"] - m["weighted"] == pytest.approx((0.5 - 0.25) * selected, rel=1e-12)
    none = flop_model.flops_per_token(dsv41.load_config("passkey", ["quant=none"]), context=t, weights="bf16")
    assert none["weighted"] == none["total"]  # a float cache and BF16 weights: everything at 1