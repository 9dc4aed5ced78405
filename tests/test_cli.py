import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

CONSOLE_SCRIPT = Path(sys.executable).parent / "dsv41"


def run(*args, script=False):
    cmd = [str(CONSOLE_SCRIPT)] if script else [sys.executable, "-m", "dsv41"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120)


def test_kv_report_json_through_the_console_script():
    assert CONSOLE_SCRIPT.exists(), "the package installs a `dsv41` console script"
    out = run("kv-report", "--json", script=True)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    models = {m["model"]: m for m in report["models"]}
    assert [m["total"] for m in report["models"]] == [389_120, 48_068, 3_514.25, 890]
    assert list(models) == ["DeepSeek-V1-67B", "DeepSeek-V3.2", "DeepSeek-V4-Flash", "DeepSeek-V4.1-Flash"]
    assert round(models["DeepSeek-V1-67B"]["ratio_to_v41_flash"]) == 437
    assert models["DeepSeek-V1-67B"]["ratio_text"] == "437×"
    assert models["DeepSeek-V4-Flash"]["ratio_text"] == "3.95×"
    v41 = models["DeepSeek-V4.1-Flash"]
    assert (v41["main"], v41["index"], v41["without_sharing"]) == (720, 170, 10_324)
    assert v41["window_ring_bytes_per_sequence"] == 2_703_360


def test_kv_report_table_and_extra_config():
    out = run("kv-report", "--config", "tiny", "--set", "kv_cache.swa_window_size=32")
    assert out.returncode == 0, out.stderr
    assert "DeepSeek-V4.1-Flash  890 " in out.stdout and "437×" in out.stdout
    assert "without cross-layer sharing: 10,324 bytes/token" in out.stdout
    assert "40 layers × 128 × 528 B = 2,703,360 B" in out.stdout
    assert "12 layers × 32 × 66 B" in out.stdout  # tiny: 64 FP8 bytes + 2 UE8M0 scales, window 32


def test_plan_table_and_json():
    out = run("plan", "--config", "v41_flash")
    assert out.returncode == 0, out.stderr
    assert "counts: window 2, full 4, reuse 30, reindex 4" in out.stdout
    out = run("plan", "--config", "tiny", "--json")
    layers = json.loads(out.stdout)["layers"]
    assert [l["mode"] for l in layers] == ["window", "window", "full", "reuse", "full", "reuse",
                                           "full", "reuse", "reindex", "reuse", "reindex", "reuse"]
    assert layers[8]["candidate_source"] == 6


def test_bad_input_exits_2_with_the_field():
    out = run("plan", "--config", "v41_flash", "--set", "kv_cache.swa_window_size=-1")
    assert out.returncode == 2
    assert "kv_cache.swa_window_size" in out.stderr and "-1" in out.stderr
    out = run("plan", "--config", "nonexistent")
    assert out.returncode == 2 and "nonexistent" in out.stderr


@pytest.mark.parametrize("command", ["plan", "kv-report"])
def test_help_has_an_example(command):
    out = run(command, "--help")
    assert out.returncode == 0 and "example: dsv41" in out.stdout


@pytest.mark.slow
def test_generate_says_what_the_prefix_cache_restored_replayed_recomputed_and_rejected(tmp_path, capsys):
    """Three runs of one 300-token prompt (blocks of 256): cold (nothing restored, one block saved), again in a
    new process's cache (the block restored, its rings replayed: the pool lives in memory), then with the
    block's file damaged (rejected as corrupt, everything recomputed)."""
    from dsv41.cli import main

    args = ["generate", "--config", "passkey", "--prompt", "a" * 300, "--max-new-tokens", "2",
            "--prefix-cache", str(tmp_path)]

    def summary():
        assert main(args) == 0
        return [line for line in capsys.readouterr().err.splitlines() if line.startswith("prefix cache:")]

    assert summary() == ["prefix cache: 0 of 300 prompt tokens restored (0 blocks), 0 replayed, 300 recomputed, "
                         "1 blocks saved; rejected entries: none"]
    assert summary() == ["prefix cache: 256 of 300 prompt tokens restored (1 blocks, rings rebuilt by bounded "
                         "replay), 32 replayed, 44 recomputed, 0 blocks saved; rejected entries: none"]
    (entry,) = tmp_path.glob("*.kv")
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF
    entry.write_bytes(bytes(data))
    assert summary() == ["prefix cache: 0 of 300 prompt tokens restored (0 blocks), 0 replayed, 300 recomputed, "
                         "1 blocks saved; rejected entries: 1 corrupt"]


def test_top_level_help_names_every_command():
    from dsv41.cli import build_parser

    out = run("--help")
    assert out.returncode == 0, out.stderr
    commands = re.search(r"\{([a-z,-]+)\}", out.stdout)[1].split(",")  # argparse's list of the subcommands
    assert len(commands) == 11
    text = " ".join(out.stdout.split())
    assert "configs, layer plan, KV accounting." not in text
    for name in commands:
        assert f"({name})" in text, name  # the description says what each command does
    help_text = " ".join(run("generate", "--help").stdout.split())
    assert "until checkpoints exist" not in help_text and "--weights PATH" in help_text
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--weights", "w.safetensors"])
    assert args.weights == "w.safetensors"


def test_generate_refuses_a_missing_weights_file(capsys):
    from dsv41.cli import main

    assert main(["generate", "--config", "passkey", "--prompt", "hi", "--weights", "/nonexistent.safetensors"]) == 2
    err = capsys.readouterr().err
    assert "'--weights' = '/nonexistent.safetensors'" in err and "expected an existing .safetensors" in err


@pytest.mark.slow
def test_generate_with_the_shipped_weights_through_a_pipe():
    """`generate --weights configs/passkey.safetensors` in a fresh process, stderr a pipe: its greedy text is
    the ids `dsv41.generate` gives from Python with those weights (a 1,100-token passkey prompt: its key), and
    its prefill progress (chunks of 512, the first 1100 − 2 · 512 = 76 tokens) comes as separate lines, at
    least the first and the last, no carriage return in them."""
    import dsv41
    from dsv41 import demo, generate, passkey
    from dsv41.convert import load_params

    prompt, key = demo.prompt_tokens(1100, depth=0.5, seed=1)
    weights = passkey.weights_path()
    text = bytes(prompt.tolist()).decode("ascii")
    out = run("generate", "--config", "passkey", "--weights", str(weights), "--prompt", text, "--max-new-tokens", "5")
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = dsv41.load_config("passkey")
    ids = generate.generate(load_params(weights, cfg), cfg, prompt.tolist(), max_new_tokens=5, vocab_limit=256)
    assert out.stdout == bytes(ids).decode("latin-1") + "\n" == key.decode() + "\n"
    assert "\r" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("prefill: ")]
    assert lines[0].startswith("prefill: 76/1100 tok (") and lines[-1].startswith("prefill: 1100/1100 tok ("), \
        out.stderr


@pytest.mark.slow
def test_demo_runs_a_v4_config(capsys):
    """`dsv41 demo --config tiny_v4` (ratios 4 and 16, the float cache, no CED): the capacity is the next multiple
    of 16 above prompt + new tokens (202 -> 208), and each progress message is a line of its own."""
    from dsv41.cli import main

    argv = ["demo", "--config", "tiny_v4", "--prompt-tokens", "200", "--new-tokens", "2", "--chunk", "64", "--json"]
    assert main(argv) == 0
    out = capsys.readouterr()
    report = json.loads(out.out.splitlines()[-1])
    assert report["capacity"] == 208 and report["prompt_tokens"] == 200 and len(report["generated_ids"]) == 2
    assert report["prefill_ced_s"] is None and "no ced: CED needs V4.1's encoder and decoder stages" in out.out
    assert report["formula_bytes_per_token"] is None and "the float cache (quant none)" in out.out
    assert "\r" not in out.err
    assert [line for line in out.err.splitlines() if "tokens" in line] == [
        f"prefill (full) {n}/200 tokens" for n in (64, 128, 192, 200)]


@pytest.mark.slow  # the shipped passkey model: one prefill and 5 decode steps
def test_the_readme_generate_block_prints_the_key(tmp_path):
    """The README's `dsv41 generate` line as written prints the key its prompt holds, and nothing else, to stdout."""
    import readme

    command = readme.block("Generate")
    key = re.search(r"pass key is (\d+)\.", command)[1]
    out = readme.run_bash(command, readme.workdir(tmp_path), timeout=600)
    assert out.returncode == 0, readme.failure(out)
    assert out.stdout.strip() == key == "71832"
    assert re.search(r"prompt 111 tokens, generated 5 tokens", out.stderr), out.stderr
