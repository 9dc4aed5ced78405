import json
import os
import sys
from pathlib import Path

# The tests run JAX on the CPU. With libtpu installed (the `tpu` extra, for ahead-of-time TPU compiles in
# subprocesses) JAX would otherwise probe for TPU hardware first and log errors on a machine without it.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The ahead-of-time TPU compiles load libtpu, which takes a process-wide lock (/tmp/libtpu_lockfile); they
# run in subprocesses, and several may hold it at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"


_COMPILE_CACHE = {"dir": None, "owner": False, "hits": 0, "saved_s": 0.0}
_SHARED_DIR = "DSV41_TEST_COMPILE_CACHE_DIR"  # the session's cache, for pytest-xdist's workers (they inherit it)


def pytest_configure(config):
    """One persistent compilation cache for the session (JAX's own, as the CLI uses it): the modules
    compile many of the same programs (tiny's prefill and decode steps at the same shapes), and the
    in-memory cache is cleared after each module (below). A program loaded from it is the one XLA
    compiled for the same HLO, flags and devices. Under pytest-xdist (`-n 2`, as CI runs) the controller
    makes the directory and its workers share it, and the `dsv41` commands the tests start in subprocesses
    use it too (`$DSV41_COMPILE_CACHE`), so that they neither write to the user's own cache nor compile
    again what the session compiled. `DSV41_TEST_COMPILE_CACHE=off` turns it off, for those commands too."""
    if os.environ.get("DSV41_TEST_COMPILE_CACHE", "").lower() == "off":
        os.environ["DSV41_COMPILE_CACHE"] = "off"
        return
    import tempfile

    from jax import monitoring

    from dsv41 import compile_cache

    worker = hasattr(config, "workerinput")
    shared = os.environ.get(_SHARED_DIR) if worker else None
    if shared is None:
        shared = tempfile.mkdtemp(prefix="dsv41-tests-jax-cache-")
        os.environ[_SHARED_DIR] = shared
        _COMPILE_CACHE["owner"] = True
    _COMPILE_CACHE["dir"] = compile_cache.enable(shared)
    os.environ["DSV41_COMPILE_CACHE"] = shared

    def count(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            _COMPILE_CACHE["hits"] += 1

    def saved(event, seconds, **_):
        if event == "/jax/compilation_cache/compile_time_saved_sec":
            _COMPILE_CACHE["saved_s"] += seconds

    monitoring.register_event_listener(count)
    monitoring.register_event_duration_secs_listener(saved)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller adds up what its workers' caches saved (xdist's hook; `workeroutput` below)."""
    out = getattr(node, "workeroutput", {})
    _COMPILE_CACHE["hits"] += out.get("dsv41_cache_hits", 0)
    _COMPILE_CACHE["saved_s"] += out.get("dsv41_cache_saved_s", 0.0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report carries the end of each running `dsv41 serve`'s log, with its threads' stacks
    (tests/serving.py): a server that stopped answering says where it stood."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and "serving" in sys.modules:
        for title, text in sys.modules["serving"].failure_logs():
            report.sections.append((title, text))


def _machine() -> str:
    """The CPU the suite ran on (its timings and the GEMM's rounding depend on it): model, cores, vector ISA."""
    import platform

    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    isa = "+".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags) or "-"
    return f"{model}, {os.cpu_count()} cores, {isa}"


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"machine: {_machine()}")
    if _COMPILE_CACHE["dir"] is not None:
        terminalreporter.write_line(f"compilation cache: {_COMPILE_CACHE['hits']} programs loaded instead of "
                                    f"compiled, {_COMPILE_CACHE['saved_s']:.0f} s of compiling saved")


def pytest_sessionfinish(session):
    """A worker hands its counts to the controller (xdist sends `workeroutput` when the session finishes)."""
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["dsv41_cache_hits"] = _COMPILE_CACHE["hits"]
        out["dsv41_cache_saved_s"] = _COMPILE_CACHE["saved_s"]


def pytest_unconfigure(config):
    if _COMPILE_CACHE["dir"] is not None and _COMPILE_CACHE["owner"]:
        import shutil

        shutil.rmtree(_COMPILE_CACHE["dir"], ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """Frees every compiled program after each test module. The whole suite in one process kept them all
    and a late CPU compile segfaulted inside XLA (test_v41_properties, which passes alone)."""
    yield
    import jax
    jax.clear_caches()


@pytest.fixture(autouse=True)
def _keep_the_session_compile_cache():
    """A test that runs a command in-process (`cli.main([...])`) may turn JAX's persistent cache off
    (`--no-compile-cache`) or point it elsewhere: the next test gets the session's back."""
    yield
    import jax

    if _COMPILE_CACHE["dir"] is not None and (not jax.config.jax_enable_compilation_cache or
                                              jax.config.jax_compilation_cache_dir != str(_COMPILE_CACHE["dir"])):
        from dsv41 import compile_cache
        compile_cache.enable(_COMPILE_CACHE["dir"])


@pytest.fixture
def v41_raw():
    """The shipped V4.1-Flash config as a plain dict, to break one field at a time."""
    return json.loads((ROOT / "configs" / "v41_flash.json").read_text())


@pytest.fixture
def write_config(tmp_path):
    """Writes a dict as a .json config file and returns its path."""

    def write(raw, name="cfg.json"):
        path = tmp_path / name
        path.write_text(json.dumps(raw))
        return path

    return write


# Less XLA:CPU optimisation for the simulated-device subprocesses: their programs compile ~25 % faster, and the
# sharded runs and the one-device reference they are compared with share the flags.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def run_on_devices(script: str, mode: str, devices: int = 8, xla_flags: str = FAST_COMPILE, timeout: int = 600) -> dict:
    """Runs `python script mode` with `devices` simulated CPU devices (XLA_FLAGS must be set before JAX
    starts, so in a subprocess) and returns the JSON object its last stdout line holds."""
    import subprocess
    import sys

    from dsv41 import distributed

    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {xla_flags}".strip(),
               JAX_PLATFORMS="cpu")
    distributed.reserve_collective_threads(env)
    proc = subprocess.run([sys.executable, script, mode], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def kernels_mode() -> str:
    """`runtime.kernels` for the tests that run the Pallas kernels against the XLA path: compiled on a GPU or
    TPU (`JAX_PLATFORMS=cuda pytest ...`, see tests/test_kernels_device.py), interpret mode on the CPU."""
    import jax

    return "pallas" if jax.default_backend() in ("gpu", "tpu") else "pallas_interpret"


def load_port_case(case: str):
    """(vectors, config, params, Engram token map or None) of the V4.1 port's case A or B."""
    import numpy as np

    from dsv41 import transformers_io

    d = np.load(DATA / f"v41_port_case{case}.npz", allow_pickle=False)
    cfg = transformers_io.config_from_transformers(json.loads(str(d["config_json"][0])))
    params = transformers_io.params_from_transformers({n: d[n] for n in d["param_names"]}, cfg)
    return d, cfg, params, (d["engram_token_map"] if "engram_token_map" in d else None)
