"""Start several JAX processes on this machine, the way a cluster scheduler would.

Multi-controller JAX runs one Python process per host; each calls
`jax.distributed.initialize(coordinator_address, num_processes, process_id)` and
then sees every device of every process in `jax.devices()`, while computing only on
its own `jax.local_devices()`. On a TPU pod or a SLURM cluster the scheduler starts
the processes and JAX reads their ids from the environment. `launch_local` plays
that scheduler on one machine: it starts `num_processes` copies of a module, each
with `local_device_count` CPU devices, and `initialize_from_env` is the matching call
at the top of that module.

CPU processes exchange collectives through gloo (TCP on localhost).

Differences from a real launcher (`jax.distributed.initialize()` with cluster
auto-detection, `torchrun`, SLURM):
  * localhost only, CPU only; the coordinator is always process 0's address.
  * A process that does not finish within `timeout_s` is killed with SIGKILL: JAX
    installs a preemption handler that swallows SIGTERM, so a polite kill can hang.
  * When one process fails, the others are killed at once instead of waiting for the
    coordinator's own timeouts.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

ENV_COORDINATOR = "STACKLIB_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "STACKLIB_NUM_PROCESSES"
ENV_PROCESS_ID = "STACKLIB_PROCESS_ID"
ENV_LOCAL_DEVICES = "STACKLIB_LOCAL_DEVICE_COUNT"


class LaunchError(RuntimeError):
    """A launched process failed or timed out; the message has the tail of its stderr."""


@dataclasses.dataclass(frozen=True)
class ProcessResult:
    """What one launched process did."""

    process_id: int
    returncode: int  # -9 when it was killed
    stdout: str
    stderr: str
    timed_out: bool


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)  # the whole session: no SIGTERM, see above
        process.wait()


def launch_local(
    module: str,
    num_processes: int = 2,
    *,
    local_device_count: int = 2,
    args: Sequence[str] = (),
    timeout_s: float = 120.0,
    check: bool = True,
) -> list[ProcessResult]:
    """Run `python -m module *args` in `num_processes` processes that form one JAX job.

    Args:
      module: a module whose code calls `initialize_from_env()` before using JAX.
      num_processes: how many processes (JAX's "hosts").
      local_device_count: CPU devices per process; the job has the product in total.
      args: command-line arguments for every process.
      timeout_s: wall-clock limit for the whole job; then every process is SIGKILLed.
      check: raise `LaunchError` unless every process exits with status 0.

    Returns:
      One `ProcessResult` per process, in process-id order.

    Raises:
      LaunchError: with `check`, a process failed or the job timed out.
    """
    if num_processes < 1 or local_device_count < 1:
        raise ValueError(
            f"Need num_processes >= 1 and local_device_count >= 1, got {num_processes} "
            f"and {local_device_count}."
        )
    coordinator = f"127.0.0.1:{_free_port()}"
    processes, outputs = [], []
    for process_id in range(num_processes):
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
        env.update({
            ENV_COORDINATOR: coordinator,
            ENV_NUM_PROCESSES: str(num_processes),
            ENV_PROCESS_ID: str(process_id),
            ENV_LOCAL_DEVICES: str(local_device_count),
        })
        # Files, not pipes: a chatty process can't block on a full pipe nobody reads.
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        outputs.append((out, err))
        processes.append(subprocess.Popen(
            [sys.executable, "-m", module, *args], stdout=out, stderr=err, env=env,
            start_new_session=True,
        ))
    deadline = time.monotonic() + timeout_s
    timed_out = False
    while any(p.poll() is None for p in processes):
        failed = any(p.poll() not in (None, 0) for p in processes)
        if failed or time.monotonic() > deadline:
            timed_out = not failed
            break
        time.sleep(0.05)
    results = []
    for process_id, (process, (out, err)) in enumerate(zip(processes, outputs, strict=True)):
        still_running = process.poll() is None
        _kill(process)
        out.seek(0)
        err.seek(0)
        results.append(ProcessResult(process_id, process.returncode, out.read(), err.read(),
                                     timed_out and still_running))
        out.close()
        err.close()
    if check and any(r.returncode != 0 for r in results):
        raise LaunchError(_failure_report(module, results, timeout_s))
    return results


def _failure_report(module: str, results: list[ProcessResult], timeout_s: float) -> str:
    lines = [f"launch_local({module!r}) failed:"]
    for r in results:
        if r.timed_out:
            status = f"killed after the {timeout_s:g} s timeout"
        elif r.returncode == -signal.SIGKILL:
            status = "killed because another process failed"
        else:
            status = f"exit status {r.returncode}"
        lines.append(f"  process {r.process_id}: {status}")
        if r.returncode not in (0, -signal.SIGKILL) or r.timed_out:
            tail = "\n".join(r.stderr.strip().splitlines()[-15:])
            lines.append("    " + tail.replace("\n", "\n    "))
    return "\n".join(lines)


def initialize_from_env(initialization_timeout: int = 60) -> None:
    """Join the job that `launch_local` started; call before any other JAX operation.

    Sets this process's CPU device count, selects gloo for cross-process collectives,
    and calls `jax.distributed.initialize` with the coordinator, process count and id
    that `launch_local` put in the environment.

    Raises:
      RuntimeError: the environment variables are missing (not started by launch_local).
    """
    import jax

    missing = [name for name in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, ENV_LOCAL_DEVICES)
               if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"initialize_from_env: {missing} not set. Start this module with "
            "stacklib.parallel.launch_local(module, num_processes), which sets them."
        )
    jax.config.update("jax_num_cpu_devices", int(os.environ[ENV_LOCAL_DEVICES]))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=os.environ[ENV_COORDINATOR],
        num_processes=int(os.environ[ENV_NUM_PROCESSES]),
        process_id=int(os.environ[ENV_PROCESS_ID]),
        initialization_timeout=initialization_timeout,
    )
