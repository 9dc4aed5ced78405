"""The README's code blocks, and how the tests run them as written.

Each ```bash and ```python block of README.md is claimed by one test (`CLAIMS`; `test_readme.py` checks that every
block is claimed and every claim names a test that exists), which lives in the file of the job it shows, so the
README's slow commands spread over the suite's files instead of queueing in one. A bash block runs in `bash -e`
with this environment's `bin/` first on PATH (the README's commands assume the environment is active), in a fresh
directory that holds a link to the repository's `configs/` (the README's commands are run from the repository root
and read only `configs/` from it; what they write stays in the directory)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# (README section, language, index within the section) -> the test that runs the block as written.
CLAIMS = {
    ("Set up", "bash", 0): "tests/test_readme.py::test_the_main_job_runs_as_written",
    ("Set up", "bash", 1): "tests/test_readme.py::test_ci_runs_exactly_the_readme_test_command",
    ("Generate", "bash", 0): "tests/test_cli.py::test_the_readme_generate_block_prints_the_key",
    ("Serve (OpenAI-compatible)", "bash", 0): "tests/test_server.py::test_the_readme_serve_blocks_run_as_written",
    ("Serve (OpenAI-compatible)", "python", 0): "tests/test_server.py::test_the_readme_serve_blocks_run_as_written",
    ("Verify the compression", "bash", 0): "tests/test_verify.py::test_the_report_against_independent_sources",
    ("Train", "bash", 0): "tests/test_train.py::test_the_readme_train_block_runs_as_written",
    ("Compile for TPU (ahead of time, on this machine)", "bash", 0):
        "tests/test_compile_report.py::test_the_readme_compile_report_block_runs_as_written",
    ("Python API", "python", 0): "tests/test_readme.py::test_the_python_api_block_runs_as_written",
}


def blocks(text: str | None = None) -> dict[tuple[str, str, int], str]:
    """(section title, language, index) -> the block's text, for every fenced block of the README."""
    text = (ROOT / "README.md").read_text() if text is None else text
    found, section, counts = {}, "", {}
    for m in re.finditer(r"^## ([^\n]+)$|^```(\w*)\n(.*?)^```$", text, flags=re.M | re.S):
        if m[1] is not None:
            section = m[1].strip()
            continue
        key = (section, m[2])
        index = counts.get(key, 0)
        counts[key] = index + 1
        found[(section, m[2], index)] = m[3].rstrip("\n")
    return found


def block(section: str, lang: str = "bash", index: int = 0) -> str:
    return blocks()[(section, lang, index)]


def workdir(path: Path) -> Path:
    """A directory to run the README's commands in, standing in for the repository root (its `configs/` linked)."""
    link = path / "configs"
    if not link.exists():
        link.symlink_to(ROOT / "configs")
    return path


def env(work: Path) -> dict:
    """The commands' environment: this environment's `bin/` first on PATH, and the prefix cache in `work`
    (`$DSV41_PREFIX_CACHE`) rather than the user's; the test session's compile cache comes with os.environ."""
    e = dict(os.environ)
    e["PATH"] = f"{BIN}{os.pathsep}{e.get('PATH', '')}"
    e["DSV41_PREFIX_CACHE"] = str(work / "prefix_cache")
    return e


def run_bash(text: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """The block as written, one `bash -e` process; stdout and stderr captured."""
    return subprocess.run(["bash", "-e", "-c", text], cwd=cwd, env=env(cwd), capture_output=True,
                          text=True, timeout=timeout)


def run_python(text: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", text], cwd=cwd, env=env(cwd), capture_output=True,
                          text=True, timeout=timeout)


def failure(out: subprocess.CompletedProcess) -> str:
    return f"exit {out.returncode}\n--- stdout\n{out.stdout[-4000:]}\n--- stderr\n{out.stderr[-4000:]}"

