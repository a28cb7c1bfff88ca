"""`make test-colab`: a reader's first run of the book on Colab, simulated on this machine.

A reader clicks a chapter's Colab badge and runs it top to bottom on a runtime that already
holds Colab's own packages (jax 0.7.2, numpy 2.1.3, ... : ../shared/colab/pip-freeze.tpu.txt),
some of them imported before the first cell runs. This script rebuilds that runtime and walks
the reader's path:

1. **The image.** A Python 3.13 virtual environment (`.venv-colab/tpu-image`, built once) with
   the image's version of every package that the book's dependency closure shares with the
   image. The closure is what pip resolves under constraints.txt for stacklib and the
   libraries the chapters install on Colab (`stacklib.hw.hosted.NOTEBOOK_EXTRAS`). Left out:
   `libtpu` (machine-specific, and this machine has no TPU to run it), so the simulated
   runtime is Colab's TPU image without a TPU: the setup installs the CPU stack, and the TPU
   and CUDA requirements are checked by `pip install --dry-run` (step 5).
   A stub `google.colab` (tests/colab/google_colab_stub) is loaded at kernel start as Colab
   loads the real one, imports what the real one imports that the stack shares (numpy, PIL,
   pyparsing, certifi, ipywidgets) and records what is asked of it.
2. **The repository.** A one-commit git repository holding this working tree (or `--ref`'s
   tree), and git's `url.<base>.insteadOf` (through GIT_CONFIG_* variables in the kernel's
   environment) sends the setup cell's `git+https://github.com/...` there: no notebook is
   edited.
3. **The reader.** A copy of the image is the runtime. Each chapter's .ipynb runs there
   through nbclient, in an empty working directory (Colab's /content), first cell first.
   When the kernel dies in the setup cell (the setup restarts the runtime), the notebook is
   run again from the top once, as the reader does after a restart. Chapter 00 meets the
   fresh image; the next chapters find the runtime it left (`--fresh-each`: a new copy each).
4. **The checks**, after the setup cell of each chapter's last run: no module imported at
   kernel start had its files replaced under the running kernel; every package of the closure
   has the lock's version, except the host's kernel packages, which keep the image's; the
   setup cell of a runtime that is already set up runs no pip and returns in seconds; and
   every cell of the chapter runs without an error.
5. **The accelerators.** The requirements the setup installs on a TPU and on a GPU runtime
   (`python -m stacklib.hw plan tpu|gpu`) must name `jax[tpu]` / `jax[cuda12]` at the pinned
   version and resolve with `pip install --dry-run` on Python 3.13; on the GPU image, with its
   CUDA libraries (nvidia-*, which its torch also uses) held at the image's versions.

Usage: python tests/colab/simulate.py [--ref REF] [--chapters 00 07 ...] [--fresh-each]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, DeadKernelError
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
STUB = Path(__file__).resolve().parent / "google_colab_stub"
CHAPTERS = ("00", "07", "12", "13", "14", "17")
LEFT_OUT = ("libtpu",)  # machine-specific: see the docstring
SETUP_SECONDS = 30  # a set-up runtime's setup cell: a version check and a child process that starts JAX

_hosted_spec = importlib.util.spec_from_file_location("hosted", ROOT / "stacklib" / "hw" / "hosted.py")
hosted = importlib.util.module_from_spec(_hosted_spec)
_hosted_spec.loader.exec_module(hosted)
canonical = hosted.canonical


def run(command: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(part) for part in command], check=True, text=True, **kwargs)


def read_freeze(path: Path) -> dict[str, str]:
    """{name: version} of a `pip freeze` listing's `name==version` lines (direct URLs left out)."""
    return hosted.read_lock(path.read_text())


def closure(python: Path, source: Path, lock: dict[str, str], report: Path) -> dict[str, str]:
    """{name: version} that pip resolves on `python` for stacklib and NOTEBOOK_EXTRAS under the lock."""
    extras = [f"{name}=={lock[name]}" for name in hosted.NOTEBOOK_EXTRAS]
    run([python, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed", "--report", report,
         "-c", source / "constraints.txt", source, *extras])
    resolved = json.loads(report.read_text())["install"]
    return {canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in resolved
            if canonical(item["metadata"]["name"]) != "stacklib"}


def build_image(python313: str, freeze: Path, image: Path) -> dict:
    """The simulated image: a 3.13 venv with the image's versions of the closure it shares. Cached."""
    image = image.resolve()
    digest = _digest([freeze, ROOT / "constraints.txt", ROOT / "pyproject.toml"])
    stub = _digest(sorted(p for p in STUB.rglob("*") if p.is_file() and "__pycache__" not in p.parts))
    stamp = image / "image.json"
    description = json.loads(stamp.read_text()) if stamp.exists() else {}
    python = image / "bin" / "python"
    if description.get("digest") != digest:
        shutil.rmtree(image, ignore_errors=True)
        started = time.time()
        run([python313, "-m", "venv", image])
        lock = hosted.read_lock((ROOT / "constraints.txt").read_text())
        ours = closure(python, ROOT, lock, image / "closure-report.json")
        theirs = read_freeze(freeze)
        shared = {name: theirs[name] for name in sorted(ours) if name in theirs and name not in LEFT_OUT}
        pins = image / "freeze-pins.txt"
        pins.write_text("".join(f"{name}=={version}\n" for name, version in theirs.items()
                                if name not in LEFT_OUT))
        run([python, "-m", "pip", "install", "--quiet", "-c", pins,
             *(f"{name}=={version}" for name, version in shared.items())])
        kernel = json.loads(run([python, "-c", INSPECT, ROOT / "stacklib" / "hw" / "hosted.py"],
                                capture_output=True, cwd=image).stdout)["kernel"]
        description = {"digest": digest, "closure": ours, "shared": shared, "kernel": kernel,
                       "left_out": [name for name in LEFT_OUT if name in theirs],
                       "seconds": round(time.time() - started)}
    if description.get("stub") != stub:
        with tempfile.TemporaryDirectory() as scratch:  # pip builds in the tree it is given
            copy = shutil.copytree(STUB, Path(scratch) / "stub")
            run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall", copy])
        description["stub"] = stub
    stamp.write_text(json.dumps(description, indent=1))
    return description


def _digest(paths: list[Path]) -> str:
    return hashlib.sha256(b"".join(path.read_bytes() for path in paths)).hexdigest()[:16]


# Run by the simulated runtime's Python: the host's kernel closure and every installed version.
INSPECT = r"""
import importlib.metadata, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("hosted", sys.argv[1])
hosted = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hosted)
installed = {hosted.canonical(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
print(json.dumps({"kernel": hosted.installed_closure(hosted.KERNEL_PACKAGES), "installed": installed}))
"""

# Run in the kernel after the setup cell: modules imported at kernel start (the stub's record)
# whose files have changed since.
STALE_PROBE = r"""
import json as _json, os as _os, sys as _sys
_loaded = [_json.loads(line) for line in open(_os.environ["COLAB_STUB_LOG"])]
_loaded = [entry for entry in _loaded if entry["event"] == "loaded" and entry["pid"] == _os.getpid()][-1]
_changed = lambda path, mtime: not _os.path.exists(path) or _os.stat(path).st_mtime != mtime
print(_json.dumps(sorted({name.partition(".")[0] for name, (path, mtime) in _loaded["modules"].items()
                          if name in _sys.modules and _changed(path, mtime)})))
"""


def snapshot(ref: str | None, destination: Path) -> Path:
    """A one-commit repository (branch main) of the working tree, or of `ref`'s tree."""
    destination.mkdir(parents=True)
    if ref:
        archive = subprocess.run(["git", "archive", ref], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", destination], input=archive, check=True)
    else:
        listing = run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                      capture_output=True).stdout
        for name in filter(None, listing.split("\0")):
            source, target = ROOT / name, destination / name
            if source.is_symlink() or source.is_file():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target, follow_symlinks=False)
    git = ["git", "-C", destination, "-c", "user.name=simulation", "-c", "user.email=simulation@localhost"]
    run([*git, "init", "--quiet", "--initial-branch", "main"])
    run([*git, "add", "--all"])
    run([*git, "commit", "--quiet", "--message", f"snapshot of {ref or 'the working tree'}"])
    return destination


class Runtime:
    """A copy of the image, its kernel spec, and the environment Colab's kernel would have."""

    def __init__(self, image: Path, work: Path, source: Path, name: str):
        self.root = work / name
        shutil.copytree(image, self.root / "venv", symlinks=True)
        self.python = self.root / "venv" / "bin" / "python"
        self.stub_log = self.root / "colab-stub.jsonl"
        self.pip_log = self.root / "pip.log"
        self.pip_log.touch()
        kept = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TERM")
        env = {key: os.environ[key] for key in kept if key in os.environ}
        env.update({
            "PATH": f"{self.python.parent}:{env.get('PATH', '/usr/bin:/bin')}",
            "COLAB_STUB_LOG": str(self.stub_log),
            "PIP_LOG": str(self.pip_log),  # every pip run appends here: a set-up runtime's setup adds nothing
            "STACKLIB_CACHE": str(self.root / "stacklib-cache"),  # a fresh runtime has no zoo models yet
            "MPLCONFIGDIR": str(self.root / "matplotlib"),
            "GIT_CONFIG_COUNT": "1",
            "GIT_CONFIG_KEY_0": f"url.file://{source}.insteadOf",
            "GIT_CONFIG_VALUE_0": hosted_repository_url(),
        })
        spec = {"argv": [str(self.python), "-m", "ipykernel_launcher", "-f", "{connection_file}",
                         "--ext", "google.colab"],
                "display_name": "Colab (simulated)", "language": "python", "env": env}
        kernels = self.root / "jupyter" / "kernels" / "colab"
        kernels.mkdir(parents=True)
        (kernels / "kernel.json").write_text(json.dumps(spec, indent=1))
        self.content = self.root / "content"  # Colab's working directory: empty
        self.content.mkdir()
        self.set_up = False  # whether a setup cell has finished here

    def pip_runs(self) -> int:
        """How many times pip has started in this runtime (each run's log opens with "Using pip")."""
        return self.pip_log.read_text().count(" Using pip ")

    def asked_of_colab(self) -> list[str]:
        """What notebooks asked of the google.colab stub, from its log."""
        if not self.stub_log.exists():
            return []
        events = [json.loads(line) for line in self.stub_log.read_text().splitlines()]
        return sorted({event["name"] for event in events if event["event"] == "getattr"})

    def inspect(self) -> dict:
        return json.loads(run([self.python, "-c", INSPECT, ROOT / "stacklib" / "hw" / "hosted.py"],
                              capture_output=True, cwd=self.content).stdout)


def hosted_repository_url() -> str:
    text = (ROOT / "stacklib" / "hw" / "__init__.py").read_text()
    return re.search(r'^REPOSITORY_URL = "([^"]+)"', text, re.M).group(1)


def execute(runtime: Runtime, notebook: Path, image: dict, cell_timeout: int) -> dict:
    """Run `notebook` as a reader does, from the top again once if its setup restarts the runtime."""
    os.environ["JUPYTER_PATH"] = str(runtime.root / "jupyter")
    result = {"chapter": notebook.name, "runs": []}
    for _ in range(2):
        attempt = _run_once(runtime, notebook, image, cell_timeout)
        result["runs"].append(attempt)
        if not attempt["restarted"]:
            break
    last = result["runs"][-1]
    problems = []
    if last["error"]:
        problems.append(last["error"][-300:])
    if last.get("stale"):
        problems.append(f"imported at kernel start and replaced under the running kernel: {last['stale']}")
    for check in ("off_lock", "kernel_changed"):
        if last.get("versions", {}).get(check):
            problems.append(f"{check}: {last['versions'][check]}")
    if last["set_up_before"] and (last["pip_runs_in_setup"] or (last["setup_seconds"] or 0) > SETUP_SECONDS):
        problems.append(f"the setup of a set-up runtime ran pip ({last['pip_runs_in_setup']}) or took "
                        f"{last['setup_seconds']} s")
    result["problems"] = problems
    result["passed"] = not problems
    return result


def _run_once(runtime: Runtime, notebook: Path, image: dict, cell_timeout: int) -> dict:
    nb = nbformat.read(notebook, as_version=4)
    client = NotebookClient(nb, kernel_name="colab", timeout=cell_timeout, startup_timeout=120,
                            resources={"metadata": {"path": str(runtime.content)}})
    this = {"set_up_before": runtime.set_up, "setup_seconds": None, "pip_runs_in_setup": None, "error": None,
            "restarted": False}
    started = time.time()
    code_cells = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"]
    try:
        with client.setup_kernel():
            for index in code_cells:
                pip_runs = runtime.pip_runs()
                cell_started = time.time()
                try:
                    client.execute_cell(nb.cells[index], index)
                except DeadKernelError:
                    this["restarted"] = index == code_cells[0]
                    this["error"] = f"the kernel died in cell {index}: {_text(nb.cells[index])[-600:]}"
                    break
                if index == code_cells[0]:
                    this["setup_seconds"] = round(time.time() - cell_started, 1)
                    this["pip_runs_in_setup"] = runtime.pip_runs() - pip_runs
                    this["setup_output"] = _text(nb.cells[index])[-2000:]
                    probe = nbformat.v4.new_code_cell(STALE_PROBE)
                    nb.cells.append(probe)  # nbclient stores a cell's outputs at its index
                    client.execute_cell(probe, len(nb.cells) - 1)
                    nb.cells.pop()
                    this["stale"] = json.loads(_text(probe).strip().splitlines()[-1])
                    this["versions"] = check_versions(runtime, image)
                    runtime.set_up = True
    except CellExecutionError as error:
        this["error"] = str(error)[-3000:]
    this["seconds"] = round(time.time() - started)
    this["asked_of_colab"] = runtime.asked_of_colab()
    return this


def _text(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type == "error":
            parts.append(f"{output.ename}: {output.evalue}")
        elif "text/plain" in output.get("data", {}):
            parts.append(output.data["text/plain"])
    return "".join(parts)


def check_versions(runtime: Runtime, image: dict) -> dict:
    """The closure's packages off the lock, and the host's kernel packages that changed."""
    installed = runtime.inspect()["installed"]
    lock = hosted.read_lock((ROOT / "constraints.txt").read_text())
    kernel = image["kernel"]
    off_lock = {name: [installed[name], lock[name]] for name in image["closure"]
                if name in installed and name in lock and name not in kernel
                and Version(installed[name]) != Version(lock[name])}
    kernel_changed = {name: [version, installed.get(name)] for name, version in kernel.items()
                      if installed.get(name) != version}
    shown = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "qwix", "numpy",
             "ipykernel", "ipython", "ipywidgets")
    stack = {name: installed.get(name) for name in shown}
    return {"off_lock": off_lock, "kernel_changed": kernel_changed, "stack": stack}


def check_accelerators(runtime: Runtime, kernel: dict, gpu_freeze: Path, work: Path) -> dict:
    """The setup's TPU and GPU requirements: chosen right, and resolvable on 3.13 (pip --dry-run).

    The plan comes from the runtime's stacklib (`python -m stacklib.hw plan`), after a chapter
    has set the runtime up: the same requirements and pins its setup would use on that host.
    """
    lock = hosted.read_lock((ROOT / "constraints.txt").read_text())
    gpu_image = read_freeze(gpu_freeze)
    results = {}
    for accelerator, extra in hosted.ACCELERATOR_EXTRAS.items():
        pins, held_file, report = (work / f"{kind}-{accelerator}.txt" for kind in ("pins", "held", "dry-run"))
        plan = subprocess.run([str(runtime.python), "-m", "stacklib.hw", "plan", accelerator, str(pins)],
                              capture_output=True, text=True, cwd=runtime.content)
        check = {"expected": f"jax[{extra}]=={lock['jax']}", "requirement": None, "resolves": False}
        results[accelerator] = check
        try:
            wanted = json.loads(plan.stdout)
        except json.JSONDecodeError:
            check["error"] = f"no plan from this stacklib: {(plan.stdout + plan.stderr).strip()[-300:]}"
            continue
        check["requirement"] = next((w for w in wanted if w.startswith("jax[")), None)
        if accelerator == "gpu":  # the GPU image's kernel packages, where they differ from the TPU image's
            planned = hosted.read_lock(pins.read_text())
            planned.update({name: gpu_image[name] for name in kernel if name in gpu_image})
            pins.write_text("".join(f"{name}=={version}\n" for name, version in sorted(planned.items())))
        # On the GPU image, its CUDA libraries (which its torch pins too) are held at the image's versions.
        held = [f"{n}=={v}" for n, v in gpu_image.items() if accelerator == "gpu" and n.startswith("nvidia-")]
        held_file.write_text("".join(line + "\n" for line in held))
        done = subprocess.run([str(runtime.python), "-m", "pip", "install", "--quiet", "--dry-run",
                               "--ignore-installed", "--report", str(report), "-c", str(pins),
                               "-c", str(held_file), *wanted],
                              capture_output=True, text=True, cwd=runtime.content)
        check["resolves"] = done.returncode == 0
        check["held_at_image_versions"] = len(held)
        if done.returncode == 0:
            resolved = {canonical(item["metadata"]["name"]): item["metadata"]["version"]
                        for item in json.loads(report.read_text())["install"]}
            check["accelerator_packages"] = {
                name: version for name, version in sorted(resolved.items())
                if name in ("jax", "jaxlib", "libtpu") or name.startswith(("jax-cuda", "nvidia-"))}
        else:
            check["pip_error"] = done.stderr[-2000:]
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", help="simulate this commit's tree instead of the working tree")
    parser.add_argument("--chapters", nargs="+", default=list(CHAPTERS))
    parser.add_argument("--fresh-each", action="store_true",
                        help="a fresh copy of the image for every chapter")
    parser.add_argument("--python313", default="python3.13")
    parser.add_argument("--images", type=Path, default=ROOT.parent / "shared" / "colab",
                        help="the folder of Colab's pip-freeze.tpu.txt and pip-freeze.gpu.txt")
    parser.add_argument("--home", type=Path, default=ROOT / ".venv-colab")
    parser.add_argument("--cell-timeout", type=int, default=1200)
    parser.add_argument("--keep", action="store_true", help="keep the runtimes' virtual environments")
    args = parser.parse_args()

    started = time.time()
    args.home = args.home.resolve()
    image_dir = args.home / "tpu-image"
    print(f"[colab] image: {image_dir} (from {args.images / 'pip-freeze.tpu.txt'})", flush=True)
    image = build_image(args.python313, args.images / "pip-freeze.tpu.txt", image_dir)
    print(f"[colab] image: {len(image['shared'])} of the closure's {len(image['closure'])} packages at "
          f"Colab's versions; left out: {image['left_out']}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=args.home))
    source = snapshot(args.ref, work / "source")
    notebooks = [next((source / "chapters").glob(f"{number}_*.ipynb")) for number in args.chapters]
    results, runtime = [], None
    for notebook in notebooks:
        if runtime is None or args.fresh_each:
            runtime = Runtime(image_dir, work, source, f"runtime-{notebook.stem[:2]}")
        print(f"[colab] {notebook.name} ...", flush=True)
        result = execute(runtime, notebook, image, args.cell_timeout)
        results.append(result)
        for number, attempt in enumerate(result["runs"], 1):
            print(f"[colab]   run {number}: {attempt['seconds']} s; setup cell {attempt['setup_seconds']} s, "
                  f"pip runs in it: {attempt['pip_runs_in_setup']}, restarted the runtime: "
                  f"{attempt['restarted']}",
                  flush=True)
        stack = result["runs"][-1].get("versions", {}).get("stack")
        print(f"[colab]   {'passed' if result['passed'] else 'FAILED'}; stack: {stack}", flush=True)
        for problem in result["problems"]:
            print(f"[colab]   - {problem[:1500]}", flush=True)
    accelerators = check_accelerators(runtime, image["kernel"], args.images / "pip-freeze.gpu.txt", work)
    for accelerator, check in accelerators.items():
        print(f"[colab] {accelerator}: {check}", flush=True)
    if not args.keep:  # a runtime is a 2 GB copy of the image; the report and logs stay
        for venv in work.glob("runtime-*/venv"):
            shutil.rmtree(venv)
    seconds = round(time.time() - started)
    (work / "report.json").write_text(json.dumps({"results": results, "accelerators": accelerators,
                                                  "image": image, "seconds": seconds}, indent=1))
    ok = all(r["passed"] for r in results) and all(
        c["resolves"] and c["requirement"] == c["expected"] for c in accelerators.values())
    print(f"[colab] {'PASSED' if ok else 'FAILED'} in {seconds} s; report: {work / 'report.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
