"""The trainer as one process per host (multi-controller JAX), as MaxText runs on a pod.

Every host runs the same command, `python -m stacklib.llm.train CONFIG ...`. Before JAX
does anything, `initialize()` joins the job with `jax.distributed.initialize`, taking
the job's shape from the environment, first match wins:

  STACKLIB_COORDINATOR_ADDRESS, STACKLIB_NUM_PROCESSES, STACKLIB_PROCESS_ID,
  STACKLIB_LOCAL_DEVICE_COUNT
      set by chapter 07's `stacklib.parallel.launch_local` (CPU processes on localhost,
      gloo collectives); `launch_local("stacklib.llm.train", 2, args=[...])`.
  JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES, JAX_PROCESS_ID
      any cluster where you start the processes yourself (GPU nodes, VMs).
  STACKLIB_DISTRIBUTED=auto
      `jax.distributed.initialize()` with no arguments: on Cloud TPU (and SLURM, Open MPI,
      Kubernetes) JAX reads the coordinator, process count and index from the runtime.
  none of these: one process, nothing to join.

Two more variables bound the waits, so that a broken job fails instead of hanging:
STACKLIB_INIT_TIMEOUT (seconds to wait for every process to join; default 60) and
STACKLIB_HEARTBEAT_TIMEOUT (seconds without a heartbeat before the job is declared
broken, and the longest wait for the others at exit; default 100, JAX's heartbeat).
A coordinator that never answers, or a process count that does not match the job the
coordinator formed, raises `DistributedInitError`. A process that dies makes JAX stop
the others ("another task died"): after the heartbeat timeout, or at once when it was
process 0 (the coordinator); a collective that fails first is raised as `PeerLostError`.

After that the training loop is the one-process loop: `jax.devices()` lists every
process's devices, so the mesh is global; each process feeds only its rows of a batch
(`process_batch`, from `data.train_dataset(shard_index=..., shard_count=...)`); the
compiled step inserts the cross-process collectives. Checkpoints are written by every
process into one step directory (`save_checkpoint`, through
`stacklib.checkpoint.sharded.save_sharded_step`): each writes the blocks of every array
that it holds (replica 0 of each shard), at their offsets in the one file per array;
process 0 then adds checksums, the manifest and the JSON items, and commits, so one
process (or any other number) restores the step with the ordinary `CheckpointManager`.
Metrics, the progress bar and the summary come from process 0 only.

Mirrors MaxText (`max_utils.maybe_initialize_jax_distributed_system`, grain's
per-host `ShardOptions`, orbax's multi-host save where every host writes its shards
and the primary host finalises). Differences: orbax writes TensorStore chunks through
a distributed barrier service and saves asynchronously; here saves are synchronous,
the files are raw arrays on a file system all processes share, the barriers are
`multihost_utils.sync_global_devices`, and the data iterator state of process 0 is
saved (it is the same in every process: it counts steps).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

import stacklib.checkpoint as ocp
from stacklib.checkpoint.sharded import save_sharded_step
from stacklib.parallel import launch

ENV_JAX_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_JAX_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_JAX_PROCESS_ID = "JAX_PROCESS_ID"
ENV_AUTO = "STACKLIB_DISTRIBUTED"
ENV_INIT_TIMEOUT = "STACKLIB_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "STACKLIB_HEARTBEAT_TIMEOUT"


class DistributedInitError(RuntimeError):
    """The processes of a job could not form the job (wrong settings, a missing process)."""


class PeerLostError(RuntimeError):
    """Another process of the job died or became unreachable during training."""


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = environ.get(name)
    if text is None:
        if default is None:
            raise DistributedInitError(f"{name} is not set; set it with the other job variables "
                                       "(see stacklib.llm.multihost).")
        return default
    try:
        return int(text)
    except ValueError:
        raise DistributedInitError(f"{name}={text!r} must be an integer.") from None


def job_from_env(environ: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
    """The `jax.distributed.initialize` arguments the environment asks for, or None (one process).

    Raises:
      DistributedInitError: a variable is missing or not a number, or the process id is
        not below the process count.
    """
    if launch.ENV_COORDINATOR in environ:
        job = {"coordinator_address": environ[launch.ENV_COORDINATOR],
               "num_processes": _int(environ, launch.ENV_NUM_PROCESSES),
               "process_id": _int(environ, launch.ENV_PROCESS_ID),
               "local_device_count": _int(environ, launch.ENV_LOCAL_DEVICES, 0) or None}
    elif ENV_JAX_COORDINATOR in environ:
        job = {"coordinator_address": environ[ENV_JAX_COORDINATOR],
               "num_processes": _int(environ, ENV_JAX_NUM_PROCESSES),
               "process_id": _int(environ, ENV_JAX_PROCESS_ID), "local_device_count": None}
    elif environ.get(ENV_AUTO) == "auto":
        job = {}  # Cloud TPU, SLURM, Open MPI, Kubernetes: JAX asks the runtime
    else:
        return None
    if job and not 0 <= job["process_id"] < job["num_processes"]:
        raise DistributedInitError(
            f"process id {job['process_id']} is not below the process count {job['num_processes']}: "
            "every process of a job must be given the same count and a distinct id in 0..count-1."
        )
    return job


def initialize(environ: Mapping[str, str] = os.environ) -> bool:
    """Join the job described by the environment (see the module docstring); call before any JAX op.

    Returns:
      True if this process is one of several, False for a single-process run.

    Raises:
      DistributedInitError: a variable is wrong, or the job did not form within
        STACKLIB_INIT_TIMEOUT seconds (coordinator unreachable, processes missing or
        disagreeing on their count); the message says which settings to check.
    """
    job = job_from_env(environ)
    if job is None:
        return False
    timeout = _int(environ, ENV_INIT_TIMEOUT, 60)
    heartbeat = _int(environ, ENV_HEARTBEAT_TIMEOUT, 100)
    local_devices = job.pop("local_device_count", None)
    if job and job["process_id"] != 0:
        _wait_for_coordinator(job["coordinator_address"], timeout, job["process_id"], job["num_processes"])
    if job:
        # JAX ends the process from C++ (SIGABRT, "DEADLINE_EXCEEDED") when the job does not
        # form in time; this line says beforehand what that would mean.
        print(f"stacklib.llm.multihost: process {job['process_id']} of {job['num_processes']} joining the "
              f"job at {job['coordinator_address']}; if not every process joins within {ENV_INIT_TIMEOUT}="
              f"{timeout} s, JAX stops this process with DEADLINE_EXCEEDED: then check that all "
              f"{job['num_processes']} processes started with the same process count.",
              file=sys.stderr, flush=True)
    if local_devices:
        jax.config.update("jax_num_cpu_devices", local_devices)
    if local_devices or environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    began = time.monotonic()
    try:
        jax.distributed.initialize(**job, initialization_timeout=timeout,
                                   heartbeat_timeout_seconds=heartbeat, shutdown_timeout_seconds=heartbeat)
    except Exception as error:  # XlaRuntimeError: DEADLINE_EXCEEDED, UNAVAILABLE, ...
        where = job.get("coordinator_address", "the runtime's coordinator")
        raise DistributedInitError(
            f"jax.distributed.initialize did not form the job within {timeout} s "
            f"(after {time.monotonic() - began:.1f} s): coordinator {where}, process "
            f"{job.get('process_id', '?')} of {job.get('num_processes', '?')}. Check that process 0 "
            "is running and reachable at that address, that every process was started, and that all "
            f"were given the same process count. ({type(error).__name__}: {str(error)[:300]})"
        ) from None
    if job and jax.process_count() != job["num_processes"]:
        raise DistributedInitError(
            f"this process was told the job has {job['num_processes']} processes, but the coordinator at "
            f"{job['coordinator_address']} formed a job of {jax.process_count()}. Give every process the "
            "same process count."
        )
    return jax.process_count() > 1


def _wait_for_coordinator(address: str, timeout: float, process_id: int, count: int) -> None:
    """Return once the coordinator's port accepts connections; DistributedInitError after `timeout` s.

    JAX would wait as long and then abort from C++; probing first gives a Python error.
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError as error:
            if time.monotonic() > deadline:
                raise DistributedInitError(
                    f"process {process_id} of {count}: the coordinator at {address} did not answer within "
                    f"{timeout} s ({ENV_INIT_TIMEOUT}) ({error}). Start process 0 (it runs the coordinator) "
                    "and check the address and port, and that no firewall blocks it."
                ) from None
            time.sleep(0.25)


def is_primary() -> bool:
    """Whether this process logs metrics and commits checkpoints (process 0)."""
    return jax.process_index() == 0


def process_rows(global_batch: np.ndarray) -> np.ndarray:
    """This process's rows of a batch every process holds whole (held-out batches)."""
    rows = len(global_batch) // jax.process_count()
    return global_batch[jax.process_index() * rows:(jax.process_index() + 1) * rows]


def process_batch(local_batch: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """The global batch array from this process's rows (`jax.make_array_from_process_local_data`).

    With one process this is `jax.device_put(batch, sharding)`.
    """
    return jax.make_array_from_process_local_data(sharding, np.asarray(local_batch))


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (a tiny all-reduce over all devices)."""
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


# -- checkpoints ----------------------------------------------------------------------------

def save_checkpoint(directory: str | os.PathLike, step: int, state: Any, data_state: Any,
                    config: dict, *, max_to_keep: int) -> None:
    """Save step `step` from every process; process 0 commits it (call it in every process).

    The result is an ordinary `stacklib.checkpoint` step with items `state` (the
    pytree `state`), `data` and `config` (JSON), readable by `CheckpointManager`
    with any number of processes. Older steps beyond `max_to_keep` are deleted.
    See `stacklib.checkpoint.sharded` for how the processes share the work.
    """
    save_sharded_step(
        directory, step, ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            data=ocp.args.JsonSave(data_state),
                                            config=ocp.args.JsonSave(config)),
        barrier=barrier, is_primary=is_primary(), max_to_keep=max_to_keep,
        custom_metadata={"process_count": jax.process_count()})
