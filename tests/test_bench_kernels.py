"""scripts/bench_kernels.py at its smallest size on CPU: the reference rows are timed, the bytes are the
closed formulas of the cache formats (DESIGN §3.8) at the full V4.1 widths, and a failing or oversized
case leaves a note in its row while the others run."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_kernels.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules[spec.name]


def run(bench, tmp_path, *argv):
    out = tmp_path / "out.json"
    assert bench.main(["--sizes", "1x4K", "--reps", "1", "--json", str(out), *argv]) == 0
    return json.loads(out.read_text())["rows"]


def test_reference_rows_and_bytes(bench, tmp_path, capsys):
    rows = run(bench, tmp_path, "--kernels", "attn_decode,idx_scores,dequant_mxfp4")
    assert "the XLA reference only" in capsys.readouterr().out
    by = {r["kernel"]: r for r in rows}
    assert [r["impl"] for r in rows] == ["reference"] * 3            # CPU: no kernel is timed
    assert all(r["seconds"] > 0 for r in rows)
    t = 4096
    # q and out bf16 [64, 512]; FP8 window 128 x (512 + 16) + mask; 512 picks: index + FP4 row 256 + 32; sink.
    assert by["attn_decode"]["bytes"] == 2 * 64 * 512 * 2 + 128 * 528 + 128 + 512 * (4 + 288) + 64 * 4
    assert by["attn_decode"]["flops"] == 4 * 64 * 512 * (128 + 512)
    # MXFP4 keys 64 + 4 bytes each, the query 32 x (128 fp32 + weight), fp32 scores out.
    assert by["idx_scores"]["bytes"] == t * 68 + 32 * (128 * 4 + 4) + t * 4
    assert by["idx_scores"]["flops"] == 2 * t * 32 * 129
    assert by["dequant_mxfp4"]["bytes"] == t * (64 + 4 + 128 * 4)


def test_oversized_and_failing_cases_keep_the_table_going(bench, tmp_path, monkeypatch):
    rows = run(bench, tmp_path, "--kernels", "attn_decode", "--memory-gib", "0.0001")
    assert len(rows) == 1 and "needs" in rows[0]["skipped"]

    make = bench.make_case

    def broken(name, *a):
        case = make(name, *a)
        if name == "attn_decode":
            case.run_reference = lambda *args: (_ for _ in ()).throw(ValueError("boom"))
        return case

    monkeypatch.setattr(bench, "make_case", broken)
    rows = run(bench, tmp_path, "--kernels", "attn_decode,dequant_fp8")
    assert rows[0]["kernel"] == "attn_decode" and rows[0]["error"] == "ValueError: boom"
    assert rows[1]["kernel"] == "dequant_fp8" and rows[1]["seconds"] > 0


def test_device_peaks(bench):
    assert bench.device_peaks("TPU v5 lite")[:3] == ("TPU v5e", 819, 197)
    assert bench.device_peaks("TPU v5")[:3] == ("TPU v5p", 2765, 459)
    assert bench.device_peaks("TPU v6 lite")[:3] == ("TPU v6e", 1640, 918)
    assert bench.device_peaks("NVIDIA H200")[:3] == ("NVIDIA H200", 4800, 989)
    assert bench.device_peaks("NVIDIA H100 80GB HBM3")[:3] == ("NVIDIA H100 SXM", 3350, 989)
    assert bench.device_peaks("cpu") is None
