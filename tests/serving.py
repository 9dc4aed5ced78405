"""A real `dsv41 serve` for the tests: a subprocess on a free localhost port, waited for, always stopped."""

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(tmp_path_factory, *args, env=()):
    """`python -m dsv41 serve --port P --prefix-cache TMP *args` on CPU under the test session's compilation
    cache (if on); yields its base URL (no /v1) once /health answers 200 (within 600 s) and stops it on exit."""
    import jax

    port = free_port()
    environ = {**os.environ, "JAX_PLATFORMS": "cpu", **dict(env)}
    environ["DSV41_COMPILE_CACHE"] = jax.config.jax_compilation_cache_dir or "off"
    cmd = [sys.executable, "-m", "dsv41", "serve", "--port", str(port),
           "--prefix-cache", str(tmp_path_factory.mktemp("prefix_cache")), *args]
    log = tmp_path_factory.mktemp("server") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=environ)
    base = f"http://127.0.0.1:{port}"
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
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
