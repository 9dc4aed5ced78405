"""Two processes on localhost (4 simulated CPU devices each, gloo collectives) run a sharded prefill + decode
over one 8-device mesh; the logits equal a single-process, single-device run of the same model. Process 0
joins by `distributed.initialize`'s arguments, process 1 by the DSV41_* environment a launcher sets."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from conftest import FAST_COMPILE  # noqa: E402
from test_sharding import TOL, small_config  # noqa: E402

B, S, CAP = 8, 6, 16
MESH = {"data": 2, "expert": 4}


def _inputs(cfg):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.architecture.vocab_size, (B, S)).astype(np.int32)
    lengths = np.array([6, 2, 5, 1, 6, 3, 4, 6], np.int32)
    step = rng.integers(0, cfg.architecture.vocab_size, (B,)).astype(np.int32)
    return tokens, lengths, step


def _worker(argv: list[str]) -> None:
    from dsv41 import distributed
    assert distributed.initialize(argv[0], int(argv[1]), int(argv[2])) if argv else distributed.initialize()
    import jax

    from dsv41 import sharding as sh
    assert (jax.process_count(), jax.local_device_count(), jax.device_count()) == (2, 4, 8)
    cfg = small_config()
    tokens, lengths, step = _inputs(cfg)
    mesh = sh.make_mesh(MESH)
    params = sh.init_params(cfg, jax.random.key(0), mesh, "serve")
    cache = sh.init_cache(cfg, mesh, "serve", batch=B, max_len=CAP)
    prefill, cache = sh.prefill(params, cfg, cache, tokens, lengths, mesh=mesh, rules="serve")
    decode, cache = sh.decode(params, cfg, cache, step, mesh=mesh, rules="serve")
    out = {"process": jax.process_index(), "prefill": sh.to_host(prefill).tolist(), "decode": sh.to_host(decode).tolist(),
           "addressable_rows": sorted({int(s.index[0].start or 0) for s in decode.addressable_shards})}
    print(json.dumps(out))
    jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_decode_like_one(tmp_path):
    from dsv41 import distributed

    coordinator = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4 " + FAST_COMPILE, JAX_PLATFORMS="cpu")
    distributed.reserve_collective_threads(env)  # XLA:CPU's pools for simulated devices
    # Output to files, not pipes: a worker blocked on a full pipe would stall the other at the shutdown barrier.
    logs = [(open(tmp_path / f"out{i}", "w"), open(tmp_path / f"err{i}", "w")) for i in range(2)]
    by_env = dict(env, DSV41_COORDINATOR=coordinator, DSV41_NUM_PROCESSES="2", DSV41_PROCESS_ID="1")
    commands = [([sys.executable, __file__, coordinator, "2", "0"], env), ([sys.executable, __file__], by_env)]
    procs = [subprocess.Popen(cmd, env=e, cwd=os.path.dirname(HERE), stdout=out, stderr=err)
             for (cmd, e), (out, err) in zip(commands, logs)]
    results = []
    for i, p in enumerate(procs):
        try:
            p.wait(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the two-process run did not finish in 600 s")
        for f in logs[i]:
            f.close()
        assert p.returncode == 0, (tmp_path / f"err{i}").read_text()[-4000:]
        results.append(json.loads((tmp_path / f"out{i}").read_text().strip().splitlines()[-1]))

    import jax

    import dsv41
    cfg = small_config()
    tokens, lengths, step = _inputs(cfg)
    params = dsv41.init_params(cfg, jax.random.key(0))
    cache = dsv41.init_cache(cfg, batch=B, max_len=CAP)
    ref_prefill, cache = dsv41.prefill(params, cfg, cache, tokens, lengths)
    ref_decode, _ = dsv41.decode(params, cfg, cache, step)
    for r in results:
        assert np.abs(np.asarray(r["prefill"]) - np.asarray(ref_prefill)).max() < TOL
        assert np.abs(np.asarray(r["decode"]) - np.asarray(ref_decode)).max() < TOL
    # Each process held only its own rows (the batch is split over both hosts' devices).
    assert [r["process"] for r in results] == [0, 1]
    assert results[0]["addressable_rows"] != results[1]["addressable_rows"]


def test_simulated_devices_get_two_pool_threads_each():
    """`reserve_collective_threads` (called by the CLI and the tests' device subprocesses) sizes XLA:CPU's
    pools to max(cores, 2N) for N simulated devices, and a started CPU client has that many Eigen threads
    (without it: max(cores, N), the count at which two unordered collectives can hold every thread); it lets a
    collective wait `COLLECTIVE_TIMEOUT_S` for its devices (an XLA flag the started client accepts)."""
    from dsv41 import distributed

    flags = "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=8"
    want = str(max(os.cpu_count(), 16))
    timeout = f"{distributed.COLLECTIVE_TIMEOUT_FLAG}={distributed.COLLECTIVE_TIMEOUT_S}"
    set_ = {"PJRT_NPROC": want, "XLA_FLAGS": f"{flags} {timeout}"}
    assert distributed.reserve_collective_threads(env := {"XLA_FLAGS": flags}) == set_
    assert env == set_
    mine = f"{flags} {distributed.COLLECTIVE_TIMEOUT_FLAG}=7"
    assert distributed.reserve_collective_threads(env := {"XLA_FLAGS": mine, "PJRT_NPROC": "3"}) == {}
    assert env == {"XLA_FLAGS": mine, "PJRT_NPROC": "3"}  # the user's choices stand
    for flags in ("", "--xla_force_host_platform_device_count=1"):
        assert distributed.reserve_collective_threads(env := {"XLA_FLAGS": flags}) == {} and "PJRT_NPROC" not in env
    script = ("import os, jax, jax.numpy as jnp\n"
              "from dsv41 import distributed\n"
              "distributed.reserve_collective_threads()\n"
              "jax.block_until_ready(jax.jit(lambda x: x @ x)(jnp.ones((64, 64))))\n"
              "print(sum('XLAEigen' in open(f'/proc/self/task/{t}/comm').read() for t in os.listdir('/proc/self/task')))")
    env = {k: v for k, v in os.environ.items() if k != "PJRT_NPROC"}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=os.path.dirname(HERE), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) == max(os.cpu_count(), 16)


ONE_AT_A_TIME = """
import sys
import jax, jax.numpy as jnp, numpy as np
from dsv41 import sharding
mesh = sharding.make_mesh({"data": 2, "expert": 4})
rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "expert")))
whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

@jax.jit
def f(x, w):  # an all-gather in a loop, an all-reduce after it
    def body(c, _):
        y = jnp.tanh(jax.lax.with_sharding_constraint(c, whole) @ w)
        return jax.lax.with_sharding_constraint(y, rows), y.sum()
    c, s = jax.lax.scan(body, x, None, length=4)
    return c, s.sum() + x.sum()

g = jax.jit(lambda y: jax.lax.with_sharding_constraint(2 * y, whole).sum())
w = jax.device_put(np.eye(64, dtype=np.float32), whole)
x = jax.device_put(np.ones((64, 64), np.float32), rows)
outs = []
for i in range(int(sys.argv[1])):  # nothing read back until the end: the dispatch runs ahead
    y, s = sharding.one_at_a_time(mesh, f(x, w))
    outs += [s, sharding.one_at_a_time(mesh, g(y))]
total = sum(float(v) for v in outs)
one = sharding.make_mesh({"data": 1}, jax.devices()[:1])
assert sharding.one_at_a_time(one, y) is y
print(total)
"""


def test_one_program_at_a_time_on_simulated_devices_cannot_deadlock_the_pool():
    """`sharding.one_at_a_time` (every sharded step and the engine's row puts leave through it) waits for a
    program on simulated CPU devices. XLA:CPU's pool at its smallest (PJRT_NPROC=8 for 8 devices: one thread
    a device) runs 1,000 pairs of programs with collectives, the second on the first's output, within a 20 s
    rendezvous timeout (8 runs in 8). With the wait taken out, 6 runs in 6 aborted: programs in flight each
    held part of the pool, waiting for a device whose thread another held."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PJRT_NPROC="8",
               XLA_FLAGS="--xla_force_host_platform_device_count=8 "
                         "--xla_cpu_collective_call_terminate_timeout_seconds=20")
    out = subprocess.run([sys.executable, "-c", ONE_AT_A_TIME, "1000"], env=env, cwd=os.path.dirname(HERE),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # Per pair (NumPy, float64): f's loop takes tanh of every element 4 times and sums each step, its all-reduce
    # adds the ones; g sums twice f's rows.
    values, v = [], 1.0
    for _ in range(4):
        v = np.tanh(v)
        values.append(v)
    want = 1000 * 64 * 64 * (1 + sum(values) + 2 * values[-1])
    assert abs(float(out.stdout.split()[-1]) - want) < 1e-5 * want


COMPILE_FRESH = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from dsv41 import compile_cache, sharding
cache = compile_cache.enable(sys.argv[1])
stored = lambda: len([p for p in cache.iterdir() if p.name.endswith("-cache")])
jax.jit(lambda v: v * 3)(jnp.ones(4)).block_until_ready()
before = stored()
sharding.make_mesh({"data": 1}, jax.devices()[:1])  # one device: the cache stays on
on_after_one = jax.config.jax_enable_compilation_cache
mesh = sharding.make_mesh({"data": 8})
x = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(mesh, P("data")))
total = float(jax.jit(lambda v: (v * 5).sum())(x))
jax.jit(lambda v: v * 7)(jnp.ones(4)).block_until_ready()
print(json.dumps({"before": before, "on_after_one": on_after_one, "on_after_mesh": jax.config.jax_enable_compilation_cache,
                  "added": stored() - before, "total": total}))
"""


def test_simulated_devices_compile_their_programs_rather_than_load_them(tmp_path):
    """A mesh of simulated CPU devices turns JAX's persistent compilation cache off for the process
    (`sharding.compile_fresh`, from `make_mesh`), with a warning: XLA:CPU aborted programs loaded from it
    (docs/simulated_devices.md). A one-device mesh leaves it on. Read from the cache directory itself."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, "-c", COMPILE_FRESH, str(tmp_path / "cache")], env=env,
                         cwd=os.path.dirname(HERE), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.splitlines()[-1])
    assert r["before"] >= 1 and r["on_after_one"], r        # the cache stored the one-device program
    assert not r["on_after_mesh"] and r["added"] == 0, r    # nothing stored after the 8-device mesh
    assert r["total"] == 5 * sum(range(64)), r
    assert "compile cache off: programs on 8 simulated CPU devices" in out.stderr, out.stderr[-2000:]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    _worker(sys.argv[1:])
