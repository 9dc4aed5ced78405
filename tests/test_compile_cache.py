"""dsv41.compile_cache: a second process loads its programs from JAX's persistent compilation cache instead of
compiling them; the CLI's flags and environment variable; bad directories. Every check that compiles runs in a
subprocess, so the pytest process keeps JAX's own cache settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dsv41 import compile_cache
from dsv41.errors import ConfigError

# Counts JAX's persistent-cache events (jax/_src/compiler.py records a hit, compilation_cache.py a write)
# while one jitted function compiles and runs, after compile_cache.enable() with the directory from the env.
COMPILE_ONE = """
import json, jax, numpy as np
from dsv41 import compile_cache
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
compile_cache.enable()
f = jax.jit(lambda x: (jax.numpy.sin(x) @ x.T + 1.0).sum())
print(json.dumps({"value": float(f(np.arange(64, dtype=np.float32).reshape(8, 8) / 64)),
                  "hits": events.count("/jax/compilation_cache/cache_hits"),
                  "writes": events.count("/jax/compilation_cache/cache_misses")}))
"""


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "DSV41_COMPILE"))}
    return dict(env, JAX_PLATFORMS="cpu", **extra)


def _python(code: str, env) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_program_instead_of_compiling(tmp_path):
    env = _env(DSV41_COMPILE_CACHE=str(tmp_path / "jax"))
    first = _python(COMPILE_ONE, env)
    assert (first["hits"], first["writes"]) == (0, 1)
    assert len(list((tmp_path / "jax").iterdir())) >= 1
    second = _python(COMPILE_ONE, env)
    assert (second["hits"], second["writes"]) == (1, 0)
    assert second["value"] == first["value"]


def test_default_directory(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_directory() == tmp_path / "xdg" / "dsv41" / "jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_directory() == tmp_path / "home" / ".cache" / "dsv41" / "jax"
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "mine"))
    assert compile_cache.default_directory() == tmp_path / "mine"
    monkeypatch.setenv(compile_cache.ENV, "OFF")
    assert compile_cache.default_directory() is None
    assert compile_cache.enable() is None  # off: JAX's settings are left alone


def test_a_file_is_not_a_cache_directory(tmp_path, monkeypatch):
    path = tmp_path / "a_file"
    path.write_text("")
    with pytest.raises(ConfigError, match="'--compile-cache' = .*a_file.*expected a directory"):
        compile_cache.enable(path, option="--compile-cache")
    monkeypatch.setenv(compile_cache.ENV, str(path))
    with pytest.raises(ConfigError, match=f"'{compile_cache.ENV}' = .*a_file.*expected a directory"):
        compile_cache.enable()


# tiny cut to its two window-only layers and one decoder layer: a run compiles in ~14 s instead of ~24 s.
SMALLEST = ["csa2.encoder.layers=2", "csa2.encoder.groups=[]", "csa2.decoder.layers=1",
            'csa2.decoder.groups=[{"size": 1, "modes": ["full"]}]']


def _generate(*flags, env):
    # The cheapest command that compiles: that model prefills a 2-token prompt (no decode step).
    cmd = [sys.executable, "-m", "dsv41", "generate", "--config", "tiny", *(x for s in SMALLEST for x in ("--set", s)),
           "--prompt", "Hi", "--max-new-tokens", "1"]
    return subprocess.run(cmd + list(flags), env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_cli_fills_the_cache_unless_told_not_to(tmp_path):
    on, off = tmp_path / "on", tmp_path / "off"
    off.mkdir()
    out = _generate("--compile-cache", str(on), env=_env())
    assert out.returncode == 0, out.stderr[-4000:]
    assert len(list(on.iterdir())) >= 1
    # --no-compile-cache wins even over JAX's own variables naming a cache that would take every program.
    out = _generate("--no-compile-cache", env=_env(JAX_COMPILATION_CACHE_DIR=str(off),
                                                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"))
    assert out.returncode == 0, out.stderr[-4000:]
    assert list(off.iterdir()) == []


def test_the_cli_names_the_flag_of_a_bad_directory(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("")
    out = _generate("--compile-cache", str(path), env=_env())
    assert out.returncode == 2
    assert "--compile-cache" in out.stderr and "a_file" in out.stderr and "expected a directory" in out.stderr
    out = subprocess.run([sys.executable, "-m", "dsv41", "demo", "--help"], capture_output=True, text=True, timeout=60)
    assert "--compile-cache DIR" in out.stdout and "--no-compile-cache" in out.stdout
