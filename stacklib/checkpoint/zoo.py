"""Build a cached model once per machine, in one fixed configuration, whoever asks for it.

Every zoo of the book (`stacklib.llm.zoo`, `stacklib.align.zoo`, `stacklib.diffusion.zoo`)
trains a model the first time someone asks for it and loads the cached files after. This
module is the part they share: the cache protocol (`load_or_build`, `write_atomically`,
`open_latest`) and the fixed build process it runs the training in (`run`, `main`).

**The files must not depend on who built them.** XLA's CPU code rounds differently with
the number of devices a process simulates and with the number of threads it may use: the
same training run gives other weights under `jax_num_cpu_devices=8` than under 1, and on
one core than on two. A cached model that whichever process asks first trains in its own
configuration is therefore a lottery: a notebook under 8 simulated devices and a test
under 1 leave different files, and a demo that passed on one machine fails on the next.
So a zoo never trains in the caller's process. It runs

    python -m stacklib.checkpoint.zoo stacklib.llm.zoo:build '{"directory": ..., ...}'

which, before JAX starts, drops the caller's `JAX_*` and `XLA_*` settings (except those of
JAX's persistent compilation cache, which change when a program is compiled, not what runs) and the
machine's autotuning cache (kernel tiles), restricts itself to one CPU core (where the OS
allows it: Linux) and one CPU device, and then calls
`build(**request)`, which writes the model into `directory`. The caller waits, then loads
the files like any later caller would. The result depends only on the request, this
library's code and the CPU's instruction set, not on who asked or how that process was
started. The request is JSON, so it must carry everything the build needs (a full config,
not a name registered in the caller's memory). Nested builds (the align zoo's GRPO model
needs its SFT start, which needs the llm zoo's base model) run inside the same process.

**Two processes ask at once** (the test suite runs notebooks in parallel). An exclusive
lock on `<name>.lock` (`fcntl.flock`, released by the kernel if the process dies) makes
the second wait while the first trains; it then finds the model and loads it.

**A partial or corrupt cache** (a process killed mid-write, a damaged file). The model is
written into a temporary directory and renamed into place only when complete (an atomic
commit, as in chapter 05, fsynced so that the rename survives a power loss), and every file
carries a CRC-32. A cache that fails to load with one of the `BROKEN_CACHE_ERRORS` (files
missing, truncated, damaged, in another format, of other shapes, or stale) is deleted and
rebuilt, with a warning. Any other error is a bug in the loader: it is raised, and the cache
is kept.

Mirrors the shape of `transformers.AutoModel.from_pretrained` (a name in, a model out, a
local cache keyed by name, an environment variable to move it) with training in place of
downloading. Differences: no hub, no revisions; the "weights" are a function of this
library's code, so a cache is only valid on the CPU instruction set that made it.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from stacklib.checkpoint import args as ocp_args
from stacklib.checkpoint import atomic
from stacklib.checkpoint.manager import CheckpointManager, CheckpointManagerOptions, NotACheckpointError
from stacklib.checkpoint.tree_files import CheckpointCorruptedError, StructureMismatchError

CACHE_ENV = "STACKLIB_CACHE"
BUILDER_ENV = "STACKLIB_ZOO_BUILDER"  # set in the builder process: build here, do not spawn again
BUILD_DEVICES = 1
BUILD_CORES = 1
T = TypeVar("T")


class StaleCacheError(ValueError):
    """A loader's verdict on intact cached files: they were built for another configuration.

    A zoo's loader raises it when what the files say they hold (a config, a recipe) is not
    what the caller asked for, so that `load_or_build` trains the model again.
    """


# The errors that mean the cache, not the code reading it, is broken; `load_or_build` rebuilds
# on these and on nothing else, so that a bug in a loader (a TypeError, a KeyError) surfaces:
BROKEN_CACHE_ERRORS = (
    FileNotFoundError,  # nothing committed: a build killed before its rename, an emptied folder
    CheckpointCorruptedError,  # a file missing, truncated, or failing its CRC-32
    NotACheckpointError,  # step metadata missing or in another format (another version's cache)
    StructureMismatchError,  # intact files of other shapes: built by an earlier version of the code
    StaleCacheError,  # intact files built for another config (the loader's own check)
)


def cache_root() -> pathlib.Path:
    """Where every zoo keeps its models: `$STACKLIB_CACHE`, default `~/.cache/stacklib`."""
    return pathlib.Path(os.environ.get(CACHE_ENV) or pathlib.Path.home() / ".cache" / "stacklib")


# -- the cache protocol ------------------------------------------------------------------------

@contextlib.contextmanager
def _exclusive(lock_path: pathlib.Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # blocks while another process holds it
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_or_build(directory: pathlib.Path, load: Callable[[pathlib.Path], T],
                  build: str, request: dict[str, Any]) -> T:
    """The cache protocol every zoo shares: `load(directory)`, building it once first if needed.

    Under an exclusive lock on `<directory>.lock`: delete the partial writes a killed process
    left behind, then load `directory` if it exists; if that raises one of the
    `BROKEN_CACHE_ERRORS`, delete it with a warning that says why. If there is nothing to
    load, run `build` ("module:function", called as `function(directory=..., **request)`) in
    the fixed build process (`run`), then load what it wrote: the first caller gets the same model, from the
    same files, as every later one. `build` must write `directory` atomically (into a
    temporary name, renamed into place when complete): `write_atomically` does.

    Raises:
      Whatever `load` raises that is not one of the `BROKEN_CACHE_ERRORS`: a bug in the
        loader, which rebuilding would hide (and pay minutes of training for).
      RuntimeError: the build failed (see `run`).
    """
    root, key = directory.parent, directory.name
    with _exclusive(root / f"{key}.lock"):
        for leftover in root.glob(f"{key}.partial-*"):  # from a process killed mid-write
            shutil.rmtree(leftover, ignore_errors=True)
        if directory.exists():
            try:
                return load(directory)
            except BROKEN_CACHE_ERRORS as error:
                warnings.warn(f"The cached model {key!r} in {directory} cannot be loaded "
                              f"({type(error).__name__}: {error}); training it again.", stacklevel=3)
                shutil.rmtree(directory)
        if not in_builder():
            print(f"Training {key!r} once for this machine (in a fresh process: 1 CPU device, 1 core); "
                  f"it will be cached in {directory}.", file=sys.stderr, flush=True)
        run(build, {"directory": str(directory), **request})
        return load(directory)


def write_atomically(directory: pathlib.Path, step: int, items: dict[str, Any]) -> None:
    """Save `items` (name -> `ocp.args` save argument) as checkpoint `step` of a new `directory`.

    Written into a temporary sibling and renamed into place when complete, so a reader
    sees the whole model or none of it; the parent is fsynced after the rename, so that the
    new name is on the disk too. The step's build configuration is saved with it.
    """
    staging = directory.with_name(f"{directory.name}.partial-{uuid.uuid4().hex[:8]}")
    manager = CheckpointManager(staging, options=CheckpointManagerOptions(enable_async_checkpointing=False))
    manager.save(step, args=ocp_args.Composite(**items, built_with=ocp_args.JsonSave(build_configuration())))
    manager.close()
    os.replace(staging, directory)  # directory does not exist here: the rename is atomic
    atomic.fsync_directory(directory.parent)


def open_latest(directory: pathlib.Path, fix: str = "") -> tuple[CheckpointManager, int]:
    """The reading side of `write_atomically`: a read-only manager on `directory` and its step.

    Every zoo's loader starts here, then restores the items it wrote.

    Raises:
      FileNotFoundError: `directory` holds no committed model (`fix`, if given, is appended
        to the message: how to make one).
    """
    manager = CheckpointManager(directory, options=CheckpointManagerOptions(read_only=True))
    step = manager.latest_step()
    if step is None:
        raise FileNotFoundError(f"{directory} holds no committed model{fix}")
    return manager, step


# -- the fixed build process -------------------------------------------------------------------

def in_builder() -> bool:
    """True inside the fixed build process."""
    return os.environ.get(BUILDER_ENV) == "1"


def build_configuration() -> dict[str, Any]:
    """What the build process ran with, as it finds it (stored with every cached model)."""
    import jax

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu_devices": jax.device_count(), "cpu_cores": cores, "platform": jax.default_backend()}


# Attention's tiles come from the machine's autotuning cache when it has an entry for the call
# (chapter 10), and another tile rounds differently: a build reads a cache that never exists, so
# every build gets the kernel library's heuristic tiles.
NO_AUTOTUNING_CACHE = "/nonexistent/stacklib-zoo-builds-use-heuristic-tiles.json"


# JAX's persistent compilation cache may be kept: it changes when a program is compiled, never
# what runs. Its key holds the XLA flags and compile options, so a build, with XLA's defaults,
# only ever loads what a build compiled, byte for byte; a test suite's repeated builds of one
# config then compile once.
_KEPT_JAX_SETTINGS = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                      "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")


def _fixed_environment() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("JAX_", "XLA_")) or key in _KEPT_JAX_SETTINGS}
    env.update({BUILDER_ENV: "1", "JAX_PLATFORMS": "cpu", "STACKLIB_AUTOTUNING_CACHE": NO_AUTOTUNING_CACHE})
    return env


def run(function: str, request: dict[str, Any]) -> None:
    """Call `function(**request)` ("module:name") in the fixed build process; wait for it.

    Raises:
      RuntimeError: the build failed; the message ends with the builder's last output.
    """
    if in_builder():  # already in the fixed configuration (a nested build)
        _call(function, request)
        return
    command = [sys.executable, "-m", "stacklib.checkpoint.zoo", function, json.dumps(request)]
    done = subprocess.run(command, env=_fixed_environment(), capture_output=True, text=True)
    if done.returncode != 0:
        output = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"Building a cached model failed ({function} in a fresh process, exit "
                           f"status {done.returncode}). Its last output:\n{output}")


def _call(function: str, request: dict[str, Any]) -> None:
    module, name = function.split(":")
    getattr(importlib.import_module(module), name)(**request)


def main(argv: list[str]) -> None:
    if os.environ != _fixed_environment():  # started by hand, with the caller's settings: drop them
        command = [sys.executable, "-m", "stacklib.checkpoint.zoo", *argv]
        os.execve(sys.executable, command, _fixed_environment())
    if hasattr(os, "sched_setaffinity"):  # one core: XLA sizes its thread pool by the cores it may use
        cores = sorted(os.sched_getaffinity(0))
        first = os.getpid() % len(cores)  # which core does not matter, only how many: spread builders out
        os.sched_setaffinity(0, (cores * 2)[first:first + BUILD_CORES])
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", BUILD_DEVICES)
    function, request = argv
    _call(function, json.loads(request))


if __name__ == "__main__":
    main(sys.argv[1:])
