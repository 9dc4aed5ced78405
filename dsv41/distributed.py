"""Multi-host start-up (DESIGN §9): `jax.distributed.initialize` from its arguments or the environment.

The same program runs on one CPU and on a pod: with no coordinator given (argument or DSV41_COORDINATOR)
nothing is initialised on a single process, and on TPU pods / SLURM jax detects the cluster itself
(`auto=True`). Multi-process CPU runs need cross-process collectives (gloo); the option must be set
before the CPU backend starts, so `initialize` must run before anything touches a device.

The `dsv41` commands run in one process (`serve --mesh` over its local devices: one HTTP front end feeds
its engine, which a multi-controller run would need on every process); a multi-host run is a program
over `dsv41.sharding` that calls `initialize` first, as `tests/test_distributed.py` runs two processes.
"""

from __future__ import annotations

import os
import re

import jax

from dsv41.errors import ConfigError

ENV = {"coordinator": "DSV41_COORDINATOR", "num_processes": "DSV41_NUM_PROCESSES", "process_id": "DSV41_PROCESS_ID"}


# How long a simulated device's collective waits for the others before XLA:CPU aborts the process (its own
# default: 40 s): on a loaded 2-core machine a slow device can take longer than 40 s to arrive. (The 8-device
# server aborts CI met were devices taking two collectives in different orders, which no wait mends:
# docs/simulated_devices.md.)
COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"
COLLECTIVE_TIMEOUT_S = 300


def reserve_collective_threads(environ=os.environ) -> dict:
    """Sizes XLA:CPU's thread pools for simulated devices (`--xla_force_host_platform_device_count=N` in
    XLA_FLAGS, N > 1): sets PJRT_NPROC, which the CPU client reads when it starts, to max(cores, 2N) unless
    it is set, and gives a collective `COLLECTIVE_TIMEOUT_S` to gather its devices unless XLA_FLAGS sets that.
    Returns what it set (empty when nothing).

    The pools have max(cores, N) threads, and a collective holds a thread until every device of its group
    arrives, so programs that hold threads while they wait can leave too few for the devices still to come.
    Measured (docs/simulated_devices.md): programs read back every 40 rounds aborted 2 to 5 runs in 8 on N
    threads, none on 2N. Between programs, `dsv41.sharding.one_at_a_time` keeps one in flight."""
    flags = environ.get("XLA_FLAGS", "")
    found = re.findall(r"--xla_force_host_platform_device_count=(\d+)", flags)
    devices = int(found[-1]) if found else 1
    if devices < 2:
        return {}
    out = {}
    if "PJRT_NPROC" not in environ:
        out["PJRT_NPROC"] = str(max(os.cpu_count() or 1, 2 * devices))
    if COLLECTIVE_TIMEOUT_FLAG not in flags:
        out["XLA_FLAGS"] = f"{flags} {COLLECTIVE_TIMEOUT_FLAG}={COLLECTIVE_TIMEOUT_S}".strip()
    environ.update(out)
    return out


def _env_int(field: str):
    text = os.environ.get(ENV[field])
    if text is None:
        return None
    if not text.strip().isdigit():
        raise ConfigError(ENV[field], text, "expected a non-negative integer")
    return int(text)


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, auto: bool = False, cpu_collectives: str = "gloo") -> bool:
    """Joins the job; returns True when jax.distributed was initialised (False: a single process).

    coordinator/num_processes/process_id default to the DSV41_* environment variables. auto=True lets jax
    detect a TPU pod or SLURM cluster when none is given.
    """
    coordinator = coordinator or os.environ.get(ENV["coordinator"])
    num_processes = _env_int("num_processes") if num_processes is None else num_processes
    process_id = _env_int("process_id") if process_id is None else process_id
    if coordinator is None and not auto:
        if num_processes not in (None, 1):
            raise ConfigError("coordinator", None, f"expected HOST:PORT for {num_processes} processes")
        return False
    if coordinator is not None:
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError("coordinator", coordinator, "expected HOST:PORT, e.g. 10.0.0.1:1234")
        if num_processes is None or num_processes < 1:
            raise ConfigError("num_processes", num_processes, "expected a positive process count with a coordinator")
        if process_id is None or not 0 <= process_id < num_processes:
            raise ConfigError("process_id", process_id, f"expected 0..{num_processes - 1}")
    # CPU collectives across processes (no-op for TPU/GPU, which bring their own).
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    return True
