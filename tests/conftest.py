"""Shared paths and helpers for the test suite."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import jax
import pytest

# The sharding tests (chapter 07) need 8 devices. JAX fixes the CPU device count when
# its backend starts, and one pytest process runs every test file, so this must happen
# here, before any test module runs a JAX operation. Single-device code is unaffected:
# it runs on device 0 as before.
jax.config.update("jax_num_cpu_devices", 8)

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK_DIRS = ("chapters", "solutions", "exercises")


def notebooks(folder: str) -> list[pathlib.Path]:
    return sorted((ROOT / folder).glob("*.ipynb"))


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (for things that must happen before JAX starts)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def stop_process(process: subprocess.Popen, stop_signal: int = signal.SIGTERM, grace_s: float = 30) -> None:
    """Ask a server the test started to stop (`stop_signal`), and kill it if it has not within `grace_s`."""
    process.send_signal(stop_signal)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# -- the zoo, built first (make test) ----------------------------------------------------------
# Chapters 13-16 and several tests start from the zoo's models (stacklib.llm.zoo, stacklib.align
# .zoo): about 2½ minutes of training on one core, in the zoo's fixed build process, the first
# time. Whichever test asks first waits for it, and when a second worker asks meanwhile, both
# workers wait and a core sits idle. `--build-zoo-first` (make test passes it) asks for them at
# once, in a background process, so the build overlaps the first tests. The files do not depend
# on who asks (stacklib/checkpoint/zoo.py); a test that needs a model still waits for it, on the zoo's lock.
# Chapter 17's two diffusion models (about 35 s each) follow in the same process.
ZOO_WARM_UP = "\n".join([
    "from stacklib.align import zoo; zoo.grpo(seed=0)",  # builds stdlib-bytes and sft-start too
    "from stacklib.diffusion import zoo; zoo.pretrained('digits-flow'); zoo.pretrained('digits-ddpm')",
])


def pytest_addoption(parser):
    parser.addoption("--build-zoo-first", action="store_true",
                     help="train the zoo's models in a background process from the start of the session")


def pytest_sessionstart(session):
    if not session.config.getoption("--build-zoo-first") or hasattr(session.config, "workerinput"):
        return  # not asked, or an xdist worker (the controller starts it once)
    session.config.zoo_warm_up = subprocess.Popen(
        [sys.executable, "-c", ZOO_WARM_UP], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)


def pytest_sessionfinish(session):
    warm_up = getattr(session.config, "zoo_warm_up", None)
    if warm_up is not None and warm_up.poll() is None:  # a short selection of tests: stop it
        os.killpg(warm_up.pid, signal.SIGKILL)  # its build process too; the zoo cleans up what it left
        warm_up.wait()


@pytest.fixture
def root() -> pathlib.Path:
    return ROOT


def cache_fingerprint(directory: pathlib.Path) -> dict[str, bytes]:
    """Every file of a cached model, by relative path, minus what records when or how long.

    Two builds of one request must agree on all of it: the step metadata's timestamp and
    the `timing` item (the training's wall-clock seconds) are the only parts left out.
    """
    files = {}
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory)
        if path.is_dir() or "timing" in relative.parts:
            continue
        data = path.read_bytes()
        if path.name == "_CHECKPOINT_METADATA":
            data = json.dumps({k: v for k, v in json.loads(data).items() if k != "timestamp"}).encode()
        files[str(relative)] = data
    return files
