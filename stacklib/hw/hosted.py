"""A hosted notebook runtime (Colab, Kaggle) made into the environment CI tests, once.

A hosted runtime arrives with its own packages: Colab's TPU image has jax 0.7.2, numpy 2.1.3
and some 300 more, and its kernel has imported a few of them (numpy, PIL, ipywidgets) before
the first cell runs. Every notebook's first cell (`stacklib.hw.setup_cell_source()`) installs
`stacklib` there and calls `prepare_runtime()`, which

1. installs **the lock**: stacklib's requirements, the real libraries that chapters compare
   against on Colab (`NOTEBOOK_EXTRAS`) and the accelerator build of JAX (`jax[tpu]` or
   `jax[cuda12]` at the pinned version), each at the version `constraints.txt` of the same
   commit names. The lock ships inside the package (`stacklib/hw/constraints.txt` is a link
   to the repository's), so package and lock cannot come from two commits;
2. leaves **the host's kernel** alone: ipykernel, IPython, ipywidgets and everything they
   require stay at the image's versions (the host's front end and kernel are built for them).
   pip sees them pinned there, so a conflict fails loudly instead of replacing the kernel;
3. runs pip **once**: when every package already has its locked version it returns without
   touching pip, in seconds (after a restart, or in a later notebook of the same runtime);
4. never leaves **a half-upgraded kernel**: a module imported before pip replaced its files
   cannot be replaced in place. Then on Colab the runtime restarts itself (the kernel process
   ends, `os.kill(os.getpid(), 9)`, and Colab starts a fresh one as after a crash; installed
   packages stay) and the reader runs the notebook again; elsewhere the cell stops with one
   sentence that says so;
5. prints what the notebook runs on: Python, JAX's backend and device kind, and the stack's
   versions (`stacklib.hw.describe()`).

The checks and pip run in a child Python (`python -m stacklib.hw`), and so does (5): the
kernel imports nothing that pip might replace, and JAX does not start in it (chapter 07 must
still be able to split the CPU into simulated devices).

Differences from a plain `pip install -c constraints.txt`: the host's kernel packages are
kept, and anything outside the lock (Colab's torch, tensorflow, ...) is left as the image has
it unless a locked package requires otherwise.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.metadata
import importlib.resources
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

LOCK_FILE = "constraints.txt"  # shipped in stacklib.hw; a link to the repository's lock

# The host's notebook kernel and widgets: these and everything they require keep the image's
# versions (Colab's kernel, google.colab._kernel, subclasses the image's ipykernel 6.17).
KERNEL_PACKAGES = ("ipykernel", "ipython", "ipywidgets")

# Installed with the stack, at the lock's versions: the real libraries chapters 10, 13 and 14
# compare against (they are in the test extra, not stacklib's requirements). Installing them
# here, before any restart, keeps a later `%pip install` in those chapters from changing a
# package the kernel has already imported (tests/test_hw.py checks that the two lists agree).
NOTEBOOK_EXTRAS = ("tokamax", "google-tunix", "openai")

# The pip extra of the pinned JAX that brings each accelerator's runtime (libtpu, CUDA 12).
ACCELERATOR_EXTRAS = {"tpu": "tpu", "gpu": "cuda12"}


class RuntimeNotReady(RuntimeError):
    """The setup cannot finish in this kernel; the message says what the reader does next."""

    def _render_traceback_(self) -> list[str]:  # IPython shows this instead of a traceback
        return [f"{type(self).__name__}: {self}"]


def canonical(name: str) -> str:
    """A distribution's name as pip compares it (PEP 503): `Orbax_Checkpoint` -> `orbax-checkpoint`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def hosted_runtime() -> str | None:
    """'colab' inside a Google Colab kernel, 'kaggle' inside a Kaggle notebook, else None.

    Colab's kernel imports `google.colab` before the first cell runs; Kaggle sets
    KAGGLE_KERNEL_RUN_TYPE ('Interactive' or 'Batch') in every notebook's environment. The
    setup cell tests the same two things before `stacklib` is installed.
    """
    if "google.colab" in sys.modules:
        return "colab"
    if "KAGGLE_KERNEL_RUN_TYPE" in os.environ:
        return "kaggle"
    return None


def accelerator_runtime() -> str | None:
    """Guess, without starting JAX, whether this machine has a TPU ('tpu') or an NVIDIA GPU ('gpu').

    It runs before the accelerator build of JAX is installed, so it looks at the operating
    system rather than asking JAX.
    """
    tpu_env = ("TPU_ACCELERATOR_TYPE", "COLAB_TPU_ADDR", "TPU_NAME")
    if any(os.environ.get(name) for name in tpu_env) or glob.glob("/dev/accel[0-9]*"):
        return "tpu"
    if glob.glob("/dev/vfio/[0-9]*"):  # TPU v4 and later expose their chips through VFIO
        return "tpu"
    if glob.glob("/dev/nvidia[0-9]*"):
        return "gpu"
    return None


def read_lock(text: str | None = None) -> dict[str, str]:
    """The lock as {canonical name: version}; `text` defaults to the one shipped with stacklib."""
    if text is None:
        text = importlib.resources.files("stacklib.hw").joinpath(LOCK_FILE).read_text()
    pins = {}
    for line in text.splitlines():
        match = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+).*", line)
        if match:
            pins[canonical(match.group(1))] = match.group(2)
    return pins


def accelerator_requirement(accelerator: str | None, lock: dict[str, str] | None = None) -> str | None:
    """The pip requirement for JAX's build for `accelerator` ('tpu', 'gpu' or None) at the locked version."""
    if accelerator is None:
        return None
    version = (lock or read_lock())["jax"]
    return f"jax[{ACCELERATOR_EXTRAS[accelerator]}]=={version}"


def install_accelerator_support() -> str | None:
    """Install the TPU or CUDA build of the locked JAX if this machine has that accelerator.

    Returns the pip requirement that was installed, or None on a CPU-only machine.
    """
    requirement = accelerator_requirement(accelerator_runtime())
    if requirement is None:
        return None
    with constraints_file(read_lock()) as constraints:
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", "-c", constraints,
                               requirement])
    return requirement


def requirements(accelerator: str | None, lock: dict[str, str] | None = None) -> list[str]:
    """What a hosted runtime installs: stacklib's requirements, `NOTEBOOK_EXTRAS`, JAX's accelerator build."""
    from packaging.requirements import Requirement

    lock = lock or read_lock()
    own = [text for text in importlib.metadata.requires("stacklib") or []
           if not (marker := Requirement(text).marker) or marker.evaluate({"extra": ""})]
    extras = [f"{name}=={lock[name]}" for name in NOTEBOOK_EXTRAS]
    accelerator_build = accelerator_requirement(accelerator, lock)
    return own + extras + ([accelerator_build] if accelerator_build else [])


def _walk(requirements: list[str], visit) -> None:
    """Call `visit(requirement, installed version or None)` on each requirement and, through the
    installed distributions' metadata, on everything they require (markers and extras evaluated
    here). `visit` returns False to stop the walk below a requirement."""
    from packaging.requirements import Requirement

    seen = set()
    queue = [Requirement(text) for text in requirements]
    while queue:
        requirement = queue.pop()
        key = (canonical(requirement.name), frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            distribution = importlib.metadata.distribution(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            visit(requirement, None)
            continue
        if not visit(requirement, distribution.version):
            continue
        environments = [{"extra": extra} for extra in ("", *requirement.extras)]
        for text in distribution.requires or []:
            needed = Requirement(text)
            if not needed.marker or any(needed.marker.evaluate(env) for env in environments):
                queue.append(needed)


def installed_closure(roots: tuple[str, ...]) -> dict[str, str]:
    """{name: version} of the installed `roots` and of everything they require, as installed."""
    closure = {}

    def visit(requirement, version):
        if version is not None:
            closure[canonical(requirement.name)] = version
        return version is not None

    _walk(list(roots), visit)
    return closure


def pins_for_this_host(lock: dict[str, str]) -> dict[str, str]:
    """The lock, with the host's kernel packages (`KERNEL_PACKAGES` and their closure) as installed."""
    return {**lock, **installed_closure(KERNEL_PACKAGES)}


def mismatches(requirements: list[str], pins: dict[str, str]) -> dict[str, tuple[str | None, str]]:
    """Packages of the requirements' closure that are missing, off their pin or outside a specifier.

    Returns {name: (installed version or None, what is wanted)}; empty when nothing needs pip.
    """
    from packaging.version import Version

    wrong = {}

    def visit(requirement, version):
        name = canonical(requirement.name)
        pinned = pins.get(name)
        wanted = pinned or str(requirement.specifier) or "any version"
        if version is None:
            wrong[name] = (None, wanted)
            return False
        if (pinned and Version(version) != Version(pinned)) or not requirement.specifier.contains(
                version, prereleases=True):
            wrong[name] = (version, wanted)
            return False
        return True

    _walk(requirements, visit)
    return wrong


@contextlib.contextmanager
def constraints_file(pins: dict[str, str]) -> Iterator[str]:
    """A temporary constraints file holding `pins`, for pip's `-c`; yields its path."""
    handle, path = tempfile.mkstemp(prefix="stacklib-constraints-", suffix=".txt")
    try:
        with os.fdopen(handle, "w") as file:
            file.writelines(f"{name}=={version}\n" for name, version in sorted(pins.items()))
        yield path
    finally:
        os.unlink(path)


def install(accelerator: str | None) -> int:
    """Bring this Python's packages to the lock (the child process's work); return 0 when they are."""
    lock = read_lock()
    wanted = requirements(accelerator, lock)
    pins = pins_for_this_host(lock)
    if not (wrong := mismatches(wanted, pins)):
        print(f"The locked stack is installed ({_source()}): nothing to do.")
        return 0
    shown = ", ".join(f"{name} {have or '(none)'} -> {want}"
                      for name, (have, want) in sorted(wrong.items())[:6])
    more = f" and {len(wrong) - 6} more" if len(wrong) > 6 else ""
    print(f"Installing the locked stack ({_source()}), a few minutes: {shown}{more}.", flush=True)
    with constraints_file(pins) as constraints:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet",
                               "--disable-pip-version-check", "-c", constraints, *wanted])
    if done.returncode != 0:
        return done.returncode
    if wrong := mismatches(wanted, pins):
        print(f"pip finished, but these packages are still off the lock: {wrong}")
        return 1
    return 0


def _source() -> str:
    """Where the installed stacklib came from: a commit of the repository, or a local tree."""
    direct = importlib.metadata.distribution("stacklib").read_text("direct_url.json") or ""
    commit = re.search(r'"commit_id":\s*"([0-9a-f]{7})', direct)
    return f"constraints.txt of stacklib @ {commit.group(1)}" if commit else "stacklib's constraints.txt"


def stale_modules(since: float) -> list[str]:
    """Top-level names of imported modules whose file was replaced or removed after `since` (time.time())."""
    stale = set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str):
            continue
        try:
            replaced = os.stat(path).st_mtime > since
        except FileNotFoundError:
            replaced = True
        except OSError:  # inside an archive (zipimport): pip does not write there
            replaced = False
        if replaced:
            stale.add(name.partition(".")[0])
    return sorted(stale)


# Modules this kernel imported before pip replaced them: set once, it holds until the kernel restarts.
_stale_in_this_kernel: list[str] = []


def prepare_runtime() -> None:
    """The body of every notebook's setup cell on Colab and Kaggle; does nothing anywhere else.

    Raises:
      RuntimeNotReady: pip failed (its output is above), or, outside Colab, modules imported
        before the upgrade need a restart of the kernel.
    """
    host = hosted_runtime()
    if host is None:
        return
    if not _stale_in_this_kernel:
        started = time.time()
        if _child("install", accelerator_runtime() or "cpu") != 0:
            raise RuntimeNotReady("installing the locked stack failed: pip's messages above say why.")
        _stale_in_this_kernel.extend(stale_modules(started))
    if _stale_in_this_kernel:
        _restart(host, _stale_in_this_kernel)
    _child("describe", host)


def _restart(host: str, stale: list[str]) -> None:
    names = ", ".join(stale)
    if host == "colab":
        print(f"Restarting the runtime: {names} had been imported before pip replaced them. When Colab has "
              "reconnected, run the notebook again from the top; this cell then takes seconds.", flush=True)
        time.sleep(1)  # let the message reach the notebook before the kernel ends
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeNotReady(f"{names} had been imported before pip replaced them: restart the kernel "
                          "(on Kaggle: Run > Restart & clear cell outputs), then run the notebook again "
                          "from the top.")


def _child(*args: str) -> int:
    """Run `python -m stacklib.hw *args`, printing its output into the notebook as it comes."""
    process = subprocess.Popen([sys.executable, "-m", "stacklib.hw", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        print(line, end="", flush=True)
    return process.wait()
