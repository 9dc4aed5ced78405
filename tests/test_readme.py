"""The README as a user meets it: every command block runs as written (here or in its job's test file, see
`tests/readme.py`), every command it shows has `--help` whose example is that command, and it stays short."""

import ast
import re
import subprocess
import sys

import pytest

import readme
from conftest import ROOT

INSTALL_MAIN = "python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e . && "
INSTALL_TEST = 'python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e ".[test,tpu]" && '


def test_ci_runs_exactly_the_readme_test_command():
    commands = [b for (section, lang, _), b in readme.blocks().items() if lang == "bash" and "pytest" in b]
    assert commands == [readme.block("Set up", "bash", 1)]
    ci_lines = [l for l in (ROOT / ".ci" / "run").read_text().splitlines() if l and not l.startswith(("#", "set ", "cd "))]
    assert ci_lines == commands
    assert commands[0].startswith(INSTALL_TEST)


def test_every_command_block_is_run_by_a_test_and_the_readme_is_short():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    runnable = {k for k in readme.blocks(text) if k[1] in ("bash", "python")}
    assert runnable == set(readme.CLAIMS), "README blocks without a test, or claims without a block: " \
        f"{sorted(runnable ^ set(readme.CLAIMS))}"
    for claim in set(readme.CLAIMS.values()):
        path, name = claim.split("::")
        tree = ast.parse((ROOT / path).read_text())
        assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, claim
    # No measurement log: every doc the README links exists.
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).exists(), link


def _commands():
    """Every `dsv41 SUB ...` line of the README's bash blocks, as (subcommand, whitespace-normalised line)."""
    found = []
    for (_, lang, _), b in readme.blocks().items():
        if lang != "bash" or "pytest" in b:
            continue
        for part in re.split(r"&&|\n", b):
            words = part.split()
            if words and words[0].endswith("dsv41"):
                found.append((words[1], " ".join(["dsv41", *words[1:]])))
    return found


def test_each_readme_command_has_help_whose_example_is_that_command(capsys):
    from dsv41 import cli

    commands = _commands()
    assert {c for c, _ in commands} >= {"kv-report", "demo", "generate", "serve", "verify", "train", "passkey",
                                        "compile-report"}
    for sub, line in commands:
        with pytest.raises(SystemExit) as e:
            cli.main([sub, "--help"])
        assert e.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "example" in text, sub
        assert line in text, f"`dsv41 {sub} --help` does not show the README's `{line}`"
    # And every other subcommand names an example too; the top level answers in a fresh process.
    out = subprocess.run([sys.executable, "-m", "dsv41", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "example: dsv41" in out.stdout
    for sub in cli.build_parser()._subparsers._group_actions[0].choices:
        with pytest.raises(SystemExit):
            cli.main([sub, "--help"])
        assert re.search(r"examples?\b.*: *\n? *dsv41 " + re.escape(sub), capsys.readouterr().out), sub


@pytest.mark.slow  # the demo: an 8K-token prompt through the cache, both schedules (about a minute)
def test_the_main_job_runs_as_written(tmp_path):
    """The set-up block after its install (which `.ci/run` has just done, with the test extras): the same
    install line up to the extras, then the commands with `.venv/bin/` read as this environment's `bin/`. What
    the README says it prints comes back: the V4.1-Flash row of the table and the demo's deterministic lines."""
    main = readme.block("Set up", "bash", 0)
    assert main.startswith(INSTALL_MAIN) and INSTALL_TEST.replace('".[test,tpu]"', ".") == INSTALL_MAIN
    jobs = main[len(INSTALL_MAIN):].replace(".venv/bin/", f"{readme.BIN}/")
    out = readme.run_bash(jobs, readme.workdir(tmp_path), timeout=900)
    assert out.returncode == 0, readme.failure(out)
    assert re.search(r"DeepSeek-V4\.1-Flash +890 +720 +170 +1×", out.stdout), out.stdout
    shown = readme.block("Set up", "text", 0).splitlines()
    deterministic = [l for l in shown if "passkey" in l or "cache:" in l]
    assert len(deterministic) == 2
    for line in deterministic:
        assert line in out.stdout.splitlines(), (line, out.stdout)


@pytest.mark.slow  # loads the shipped model, a 1K forward and prefill, generates 5 tokens
def test_the_python_api_block_runs_as_written(tmp_path):
    out = readme.run_python(readme.block("Python API", "python"), readme.workdir(tmp_path), timeout=600)
    assert out.returncode == 0, readme.failure(out)
    first, second = out.stdout.splitlines()
    assert first == "890 [2, 8, 14, 20]"   # the README says what it prints
    same, generated, key = second.split(" ")
    assert same == "True" and generated == key, second   # the prefill's last logits are the forward's last row
