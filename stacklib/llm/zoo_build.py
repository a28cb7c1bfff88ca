"""Build a cached model in a fresh process with one fixed configuration, whoever asks for it.

XLA's CPU code rounds differently with the number of devices a process simulates and
with the number of threads it may use: the same training run gives other weights under
`jax_num_cpu_devices=8` than under 1, and on one core than on two. A cached model that
whichever process asks first trains in its own configuration is therefore a lottery: a
notebook under 8 simulated devices and a test under 1 leave different files, and a demo
that passed on one machine fails on the next. So the zoo never trains in the caller's
process. It runs

    python -m stacklib.llm.zoo_build stacklib.llm.zoo:build '{"directory": ..., ...}'

which, before JAX starts, drops the caller's `JAX_*` and `XLA_*` settings, restricts
itself to one CPU core (where the OS allows it: Linux) and one CPU device, and then calls
`build(**request)`, which writes the model into `directory`. The caller waits, then loads
the files like any later caller would. The result depends only on the request, this
library's code and the CPU's instruction set, not on who asked or how that process was
started.

The request is JSON, so it must carry everything the build needs (a full config, not a
name registered in the caller's memory). Nested builds (the align zoo's GRPO model needs
its SFT start, which needs the llm zoo's base model) run inside the same fixed process.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from typing import Any

BUILDER_ENV = "STACKLIB_ZOO_BUILDER"  # set in the builder process: build here, do not spawn again
BUILD_DEVICES = 1
BUILD_CORES = 1


def in_builder() -> bool:
    """True inside the fixed build process."""
    return os.environ.get(BUILDER_ENV) == "1"


def build_configuration() -> dict[str, Any]:
    """What the build process ran with, as it finds it (stored with every cached model)."""
    import jax

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu_devices": jax.device_count(), "cpu_cores": cores, "platform": jax.default_backend()}


def _fixed_environment() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("JAX_", "XLA_"))}
    env.update({BUILDER_ENV: "1", "JAX_PLATFORMS": "cpu"})
    return env


def run(function: str, request: dict[str, Any]) -> None:
    """Call `function(**request)` ("module:name") in the fixed build process; wait for it.

    Raises:
      RuntimeError: the build failed; the message ends with the builder's last output.
    """
    if in_builder():  # already in the fixed configuration (a nested build)
        _call(function, request)
        return
    command = [sys.executable, "-m", "stacklib.llm.zoo_build", function, json.dumps(request)]
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
        command = [sys.executable, "-m", "stacklib.llm.zoo_build", *argv]
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
