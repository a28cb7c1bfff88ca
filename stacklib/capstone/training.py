"""Stages 1 and 2: a sharded, checkpointed training run; then the same run killed and resumed.

Stage 1 trains chapter 12's model on the Python standard library (`stacklib.data`'s
pipeline) over a `(data, fsdp, tensor)` mesh of 8 devices (simulated on a CPU, chapter
07), saving asynchronous checkpoints with `stacklib.checkpoint`. It is `train.train`
from chapter 12, unchanged: the capstone composes, it does not re-implement.

Stage 2 runs the same configuration in a child process, with a second, local tier of
checkpoints (chapter 05's `multitier`: the same items, saved every
`local_checkpoint_every` steps to storage on the machine), and kills it with SIGKILL, the
signal a preempted machine gets (nothing runs after it: no `finally`, no flush). Then
this process runs it again: `train.train` finds the newest committed checkpoint in
either tier, restores the parameters, the optimizer state and the data iterator's
position, and finishes the run. The final weights must equal the uninterrupted run's bit
for bit.

Where the kill lands. A child that is killed "whenever" makes a run that differs every
time (sometimes before the first checkpoint, sometimes after the last step). To make
the moment exact, the child stops after step `kill_after` and waits to be killed, as
chapter 05's child saved onto a slow disk: the parent waits until the child has
reported that step *and* each tier's last checkpoint before it is committed on disk,
then sends SIGKILL. The resumed run therefore always starts from the same step (the
local tier's), and the steps between that checkpoint and the kill are the work the kill
cost; the steps since the persistent tier's last checkpoint are what it would have cost
without the local tier.

Every wait is bounded; a child that fails or hangs is killed and its output shown.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import jax
import numpy as np

import stacklib.checkpoint as ocp
from stacklib import hw
from stacklib.llm import train
from stacklib.llm.config import Config, load_config

CHILD_TIMEOUT = 600.0  # seconds a child may take to reach the kill point (a loaded 2-core CI machine)


def mesh_overrides(device_count: int) -> dict[str, int]:
    """A 2 x 2 x 2 (data, fsdp, tensor) mesh on 8 or more devices, else data parallelism only."""
    if device_count >= 8:
        return dict(data_parallelism=2, fsdp_parallelism=2, tensor_parallelism=2)
    return dict(data_parallelism=device_count, fsdp_parallelism=1, tensor_parallelism=1)


def capstone_config(checkpoint_dir: str | os.PathLike = "", local_checkpoint_dir: str | os.PathLike = "",
                    **overrides: Any) -> Config:
    """The capstone's training run: `hw.sizes("capstone")` on this backend's mesh.

    `local_checkpoint_dir` adds a local tier (stage 2), saved every `local_checkpoint_every` steps.
    """
    sizes = dict(vars(hw.sizes("capstone")))
    sizes.pop("kill_after")
    sizes["max_seq_len"] = max(sizes["seq_len"], load_config(None).max_seq_len)  # the accelerator rows' 512+
    settings = {**sizes, **mesh_overrides(jax.device_count()), "checkpoint_dir": str(checkpoint_dir),
                "local_checkpoint_dir": str(local_checkpoint_dir), "max_to_keep": 2,
                "async_checkpointing": True, "warmup_steps": 4, "progress": False}
    return load_config(None, **{**settings, **overrides})


def kill_after() -> int:
    return hw.sizes("capstone").kill_after


# -- stage 1 ------------------------------------------------------------------------------------

def train_run(config: Config) -> train.TrainResult:
    """Stage 1: chapter 12's `train`, as it is: sharded step, async checkpoints, goodput."""
    return train.train(config)


# -- stage 2 ------------------------------------------------------------------------------------

@dataclasses.dataclass
class KilledRun:
    """What the killed child did before SIGKILL."""

    records: list[dict]  # the per-step JSON lines it wrote (its last step is the kill point)
    committed_steps: list[int]  # checkpoints in checkpoint_dir (the persistent tier) when it was killed
    returncode: int  # -9: killed by SIGKILL
    local_committed_steps: list[int] = dataclasses.field(default_factory=list)  # in the local tier, if any

    @property
    def killed_at(self) -> int:
        return self.records[-1]["step"]

    @property
    def last_persistent_step(self) -> int:
        """The persistent tier's newest step before the kill: where a run without the local tier resumes."""
        return max((step for step in self.committed_steps if step <= self.killed_at), default=0)


CHILD = """
import json, sys
from stacklib import hw
hw.simulate_cpu_devices(8)  # the same devices as the parent: the same compiled step, the same bits
from stacklib.llm import train
from stacklib.llm.config import load_config

config = load_config(None, **json.loads(sys.argv[1]))
kill_after = int(sys.argv[2])

def log(record):
    print(json.dumps(record), flush=True)
    if record["step"] == kill_after:
        print("WAITING", flush=True)
        sys.stdin.read()  # blocks: the parent kills this process now (it never writes)

train.train(config, log=log)
print("FINISHED", flush=True)  # not reached when the parent kills us
"""


def _committed_steps(directory: pathlib.Path) -> list[int]:
    if not directory.exists():
        return []
    return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True)).all_steps()


def run_and_kill(config: Config, kill_after_step: int, *, timeout: float = CHILD_TIMEOUT) -> KilledRun:
    """Run `config` in a child process and SIGKILL it after step `kill_after_step`.

    The child stops after that step; we wait until each tier's last checkpoint before it is
    committed (asynchronous saves finish in the background), then kill. The checkpoint
    directories should start empty, as for any new run.

    Raises:
      ValueError: `kill_after_step` comes before the first periodic checkpoint.
      RuntimeError: the child exited, or did not reach the kill point within `timeout`
        seconds; the message holds the end of its output.
    """
    expected = kill_after_step - kill_after_step % config.checkpoint_every  # the last save before the kill
    if expected == 0:
        raise ValueError(f"kill_after={kill_after_step} comes before the first checkpoint (every "
                         f"{config.checkpoint_every} steps): nothing would be resumed. Kill later.")
    # (directory, the last step it saves before the kill) for each tier the run writes
    tiers = [(pathlib.Path(config.checkpoint_dir), expected)]
    if config.local_checkpoint_dir:
        tiers.append((pathlib.Path(config.local_checkpoint_dir),
                      kill_after_step - kill_after_step % config.local_checkpoint_every))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(pathlib.Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-c", CHILD, json.dumps(config.to_dict()), str(kill_after_step)]
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=env)
    records, lines = [], []
    deadline = time.monotonic() + timeout
    try:
        # Reading blocks until the child writes a line or exits; if it hangs, the watchdog kills it.
        watchdog = _Watchdog(child, deadline)
        for line in child.stdout:
            lines.append(line)
            if line.startswith("{"):
                records.append(json.loads(line))
            elif line.strip() == "WAITING":
                break
        watchdog.cancel()
        if not records or records[-1]["step"] != kill_after_step:
            raise RuntimeError(f"The child stopped before step {kill_after_step} (exit code "
                               f"{child.poll()}):\n" + "".join(lines[-40:]))
        for directory, step in tiers:
            while step not in _committed_steps(directory):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"checkpoint {step} was not committed in {directory} in {timeout} s")
                time.sleep(0.05)
        committed = [_committed_steps(directory) for directory, _ in tiers]
        os.kill(child.pid, signal.SIGKILL)
        returncode = child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=60)
        child.stdout.close()
        child.stdin.close()
    return KilledRun(records, committed[0], returncode, committed[1] if len(committed) > 1 else [])


class _Watchdog:
    """Kill `child` at `deadline` unless cancelled: a hung child cannot hang the notebook."""

    def __init__(self, child: subprocess.Popen, deadline: float):
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(child, deadline), daemon=True)
        self._thread.start()

    def _run(self, child, deadline):
        if not self._cancelled.wait(max(0.0, deadline - time.monotonic())) and child.poll() is None:
            child.kill()

    def cancel(self):
        self._cancelled.set()


def resume(config: Config) -> train.TrainResult:
    """Stage 2, second half: the same command again; it resumes from either tier's newest committed step."""
    return train.train(config)


def bitwise_equal(params_a: Any, params_b: Any) -> bool:
    """Every leaf equal, bit for bit (`np.array_equal` on each)."""
    leaves_a, leaves_b = jax.tree.leaves(params_a), jax.tree.leaves(params_b)
    return len(leaves_a) == len(leaves_b) and all(
        np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(leaves_a, leaves_b, strict=True))
