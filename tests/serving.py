"""A real `dsv41 serve` for the tests: a subprocess on a free localhost port, waited for, always stopped."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


# For a failing test's report (conftest): the servers running now (pid -> (process, log path)), and the logs
# of those a failure inside their `with` block stopped.
LIVE: dict = {}
STOPPED_BY_FAILURE: list = []


def _log_end(pids, chars: int = 6000) -> list[tuple[str, str]]:
    """(title, end of the log) of the running servers `pids`, after asking each for its threads' Python
    stacks (`dsv41 serve` dumps them on SIGUSR1): what a stuck server was doing."""
    asked = [pid for pid in pids if LIVE[pid][0].poll() is None and hasattr(signal, "SIGUSR1")]
    for pid in asked:
        LIVE[pid][0].send_signal(signal.SIGUSR1)
    if asked:
        time.sleep(2)
    return [(f"dsv41 serve (pid {pid}): the end of its log", LIVE[pid][1].read_text()[-chars:]) for pid in pids]


def failure_logs() -> list[tuple[str, str]]:
    """The logs a failing test's report gets: every running server's, and those of the servers the failure
    stopped (taken then)."""
    out = STOPPED_BY_FAILURE + _log_end(list(LIVE))
    STOPPED_BY_FAILURE.clear()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(tmp_path_factory, *args, env=()):
    """`python -m dsv41 serve --port P --prefix-cache TMP *args` on CPU under the test session's compilation
    cache (if on); yields its base URL (no /v1) once /health answers 200 (within 600 s) and stops it on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "dsv41", "serve", "--port", str(port),
           "--prefix-cache", str(tmp_path_factory.mktemp("prefix_cache")), *args]
    with serving(cmd, port, tmp_path_factory.mktemp("server") / "server.log", env=env) as base:
        yield base


@contextlib.contextmanager
def serving(cmd, port: int, log, env=(), cwd=None):
    """Runs the server command `cmd` (argv) on CPU under the test session's compilation cache (if on), its
    output in `log`; yields http://127.0.0.1:port once /health answers 200 (within 600 s) and stops it on exit."""
    import jax

    environ = {**os.environ, "JAX_PLATFORMS": "cpu", **dict(env)}
    environ["DSV41_COMPILE_CACHE"] = jax.config.jax_compilation_cache_dir or "off"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=environ, cwd=cwd)
    base = f"http://127.0.0.1:{port}"
    LIVE[proc.pid] = (proc, log)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the server did not start in 600 s:\n{log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        try:
            yield base
        except BaseException:
            STOPPED_BY_FAILURE.extend(_log_end([proc.pid]))
            raise
    finally:
        LIVE.pop(proc.pid, None)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
