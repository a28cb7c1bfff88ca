"""`stacklib` as a reader installs it: a regular (non-editable) install of the wheel.

Every other test runs on the editable install in `.venv`, where `stacklib/` is the source
tree and every file beside the code is there. A Colab reader's setup cell runs
`%pip install "stacklib @ git+..."`: pip clones the repository, builds a wheel and installs
it into site-packages, and only what the wheel lists arrives. These tests build that wheel
from what a clone holds, install it into a fresh virtual environment, and run there, away
from the source tree, what chapters 12, 16 and 17 do first.

The fresh environment reuses the pinned dependencies already installed in `.venv` (a `.pth`
line puts that site-packages on `sys.path`), so the test costs seconds, not a second install
of the stack. Python runs a `.pth` file's `import` lines only in a site directory, not in a
directory a `.pth` line adds, so `.venv`'s editable finder for `stacklib` stays off and
`import stacklib` can only find the wheel; `test_the_wheel_is_what_runs` checks it.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow

# Files under stacklib/ that a module reads at run time are shipped in the wheel; Python's
# byte-code caches are not (a clone has none).
NOT_SHIPPED = ("__pycache__",)


def clone_files() -> list[str]:
    """What `git clone` of this working tree would hold: tracked files and untracked, unignored ones."""
    listing = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [name for name in listing.split("\0") if name and (ROOT / name).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """The wheel pip builds from a clone, as `pip install git+...` does."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "clone"
    for name in clone_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                            "-w", str(work / "dist"), str(source)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel_file,) = (work / "dist").glob("stacklib-*.whl")
    return wheel_file


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> pathlib.Path:
    """The Python of a fresh virtual environment holding the wheel (and `.venv`'s dependencies)."""
    venv = tmp_path_factory.mktemp("venv") / "reader"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                           "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = pathlib.Path(subprocess.run([str(python), "-c", where], capture_output=True, text=True,
                                       check=True).stdout.strip())
    (site / "pinned_stack.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def run_installed(python: pathlib.Path, args: list[str], cwd: pathlib.Path, timeout: float = 300) -> str:
    """Run the installed Python outside the source tree, with no PYTHONPATH; return its stdout."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, (f"{' '.join(args)[:200]} exited {done.returncode}:\n"
                                  f"{done.stdout}\n{done.stderr[-3000:]}")
    return done.stdout


def test_the_wheel_ships_every_file_stacklib_holds_besides_python(wheel):
    in_tree = {name for name in clone_files()
               if name.startswith("stacklib/") and not name.endswith(".py")
               and not any(part in NOT_SHIPPED for part in name.split("/"))}
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    assert in_tree, "expected the trainers' configs/base.yml files under stacklib/"
    missing = sorted(in_tree - in_wheel)
    assert not missing, (f"not in the wheel: {missing}; declare them under [tool.setuptools.package-data] "
                         "in pyproject.toml")


def test_the_wheel_is_what_runs_and_every_module_imports(installed, tmp_path):
    checks = """
import importlib, json, pathlib, pkgutil
import stacklib
from stacklib import diffusion, llm
names = [m.name for m in pkgutil.walk_packages(stacklib.__path__, "stacklib.")
         if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
configs = {"llm": llm.load_config(None).to_dict(), "diffusion": diffusion.load_config(None).to_dict()}
print(json.dumps({"package": stacklib.__file__, "modules": names, "configs": configs}))
"""
    report = json.loads(run_installed(installed, ["-c", checks], tmp_path).splitlines()[-1])
    package = pathlib.Path(report["package"])
    assert package.is_relative_to(installed.parents[1]) and "site-packages" in package.parts, package
    expected = {"stacklib.llm.config", "stacklib.diffusion.config", "stacklib.capstone.training"}
    assert expected <= set(report["modules"])
    from stacklib import diffusion, llm  # the source tree's configs, read here, are the shipped ones
    assert report["configs"] == {"llm": llm.load_config(None).to_dict(),
                                 "diffusion": diffusion.load_config(None).to_dict()}


def test_chapter_12s_command_line_trains_from_the_installed_package(installed, tmp_path):
    tiny = ["d_model=32", "n_layers=1", "n_heads=4", "n_kv_heads=2", "head_dim=8", "d_ff=64",
            "max_seq_len=32", "seq_len=32", "batch_size=8", "warmup_steps=1", "max_corpus_bytes=100000",
            "eval_batches=1",
            "progress=false", f"checkpoint_dir={tmp_path / 'run'}"]
    out = run_installed(installed, ["-m", "stacklib.llm.train", *tiny, "steps=2"], tmp_path)
    summary = json.loads(out[out.index("{"):])
    assert summary["steps"] == 2 and summary["final_loss"] > 0
    assert (tmp_path / "run" / "2").is_dir()  # the last step was checkpointed


def test_chapter_17s_command_line_trains_from_the_installed_package(installed, tmp_path):
    tiny = ["d_model=16", "n_layers=1", "n_heads=2", "batch_size=16", "warmup_steps=1", "progress=false"]
    out = run_installed(installed, ["-m", "stacklib.diffusion.train", *tiny, "steps=2"], tmp_path)
    summary = json.loads(out[out.index("{"):])
    assert summary["steps"] == 2 and len(summary["losses"]) >= 1


def test_chapter_16s_first_run_trains_from_the_installed_package(installed, tmp_path):
    script = f"""
from stacklib import hw
hw.simulate_cpu_devices(8)
from stacklib.capstone import training
config = training.capstone_config({str(tmp_path / 'run')!r}, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                  head_dim=8, d_ff=64, seq_len=32, max_seq_len=32, batch_size=8, steps=2,
                                  checkpoint_every=1, eval_batches=0, max_corpus_bytes=100000)
result = training.train_run(config)
print(len(result.losses), *config.mesh_shape)
"""
    losses, *mesh = run_installed(installed, ["-c", script], tmp_path).split()[-4:]
    assert int(losses) >= 1 and mesh == ["2", "2", "2"]
    assert sorted(int(p.name) for p in (tmp_path / "run").iterdir() if p.name.isdigit()) == [1, 2]  # keep-2
