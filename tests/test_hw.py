"""stacklib.hw: hardware description, problem sizes, simulated devices, notebook setup.

The setup's path on a hosted runtime (install, restart, second run) is simulated on Colab's
image by `make test-colab` (tests/colab/simulate.py); here its parts are tested on CPU.
"""

import fnmatch
import importlib
import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import types

import jax
import jax.numpy as jnp
import nbformat
import numpy as np
import pytest
from conftest import ROOT, run_python

from stacklib import hw
from stacklib.hw import hosted


def test_sizes_returns_the_table_row_of_the_requested_backend():
    for backend in hw.BACKENDS:
        assert vars(hw.sizes("matmul", backend)) == hw.PROBLEM_SIZES["matmul"][backend]


def test_sizes_defaults_to_the_backend_jax_runs_on():
    assert vars(hw.sizes("matmul")) == hw.PROBLEM_SIZES["matmul"][jax.default_backend()]


def test_every_problem_has_the_same_positive_sizes_for_every_backend():
    for problem, rows in hw.PROBLEM_SIZES.items():
        assert set(hw.BACKENDS) <= set(rows) <= set(hw.ROWS), problem
        keys = {tuple(sorted(row)) for row in rows.values()}
        assert len(keys) == 1, f"{problem}: backends disagree on which sizes exist: {keys}"
        assert all(isinstance(v, int) and v > 0 for row in rows.values() for v in row.values())


def test_cpu_sizes_are_never_larger_than_accelerator_sizes():
    for problem, rows in hw.PROBLEM_SIZES.items():
        for key, cpu_value in rows["cpu"].items():
            assert cpu_value <= rows["tpu"][key], f"{problem}.{key}"


def test_the_multi_device_chapters_have_rows_for_an_8_chip_tpu_no_smaller_than_one_chips():
    with_rows = {problem for problem, rows in hw.PROBLEM_SIZES.items() if hw.MULTI_CHIP_TPU in rows}
    assert with_rows == {"sharded_mlp", "collective_sweep", "capstone"}  # chapters 07 and 16
    for problem in with_rows:
        rows = hw.PROBLEM_SIZES[problem]
        for key, value in rows["tpu-8"].items():
            assert value >= rows["tpu"][key], f"{problem}.{key}"


def test_the_capstones_8_chip_row_fits_its_2x2x2_mesh_and_kills_between_checkpoints():
    row = hw.sizes("capstone", "tpu-8")
    assert row.batch_size % 4 == 0  # data x fsdp
    assert row.n_heads % 2 == 0 and row.n_kv_heads % 2 == 0 and row.d_ff % 2 == 0  # tensor
    assert row.n_heads % row.n_kv_heads == 0 and row.n_heads * row.head_dim == row.d_model
    assert row.kill_after % row.local_checkpoint_every and row.kill_after % row.checkpoint_every
    assert row.local_checkpoint_every < row.checkpoint_every and row.kill_after < row.steps


@pytest.mark.parametrize(("chips", "problem", "row"), [
    (8, "capstone", "tpu-8"), (8, "matmul", "tpu"), (1, "capstone", "tpu"), (16, "sharded_mlp", "tpu-8")])
def test_sizes_picks_the_8_chip_row_on_a_tpu_with_8_chips_else_one_chips(monkeypatch, chips, problem, row):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(jax, "device_count", lambda: chips)
    assert vars(hw.sizes(problem)) == hw.PROBLEM_SIZES[problem][row]
    assert vars(hw.sizes("matmul", "tpu-8")) == hw.PROBLEM_SIZES["matmul"]["tpu"]


def test_unknown_problem_error_lists_known_problems():
    with pytest.raises(KeyError, match="Known problems: .*matmul"):
        hw.sizes("matmull")


def test_unknown_backend_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match="'cpu', 'gpu', 'tpu' or 'tpu-8'"):
        hw.sizes("matmul", backend="metal")


def test_describe_matches_jax():
    machine = hw.describe()
    assert machine.backend == jax.default_backend()
    assert machine.device_count == len(jax.devices())
    assert machine.jax_version == jax.__version__
    assert machine.runtime == "local"
    assert f"jax {jax.__version__}, jaxlib {jax.__version__}" in machine.stack
    assert "device_kind" in str(machine)


def test_simulated_cpu_devices_appear_when_requested_before_jax_starts():
    result = run_python(textwrap.dedent("""
        from stacklib import hw
        devices = hw.simulate_cpu_devices(4)
        import jax
        assert len(devices) == 4 and len(jax.devices("cpu")) == 4, devices
        print("ok")
    """))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_simulating_devices_after_jax_started_explains_the_fix():
    result = run_python(textwrap.dedent("""
        import jax, jax.numpy as jnp
        jnp.ones(3).block_until_ready()
        from stacklib import hw
        assert len(hw.simulate_cpu_devices(1)) == 1   # the current count is fine
        try:
            hw.simulate_cpu_devices(8)
        except RuntimeError as error:
            print(error)
    """))
    assert result.returncode == 0, result.stderr
    assert "Restart the kernel" in result.stdout and "simulate_cpu_devices(8)" in result.stdout


def test_simulate_rejects_a_non_positive_count():
    with pytest.raises(ValueError, match="positive integer"):
        hw.simulate_cpu_devices(0)


# -- the notebooks' setup on a hosted runtime (stacklib.hw.hosted) --------------------------------

LOCK = hosted.read_lock((ROOT / "constraints.txt").read_text())


def test_a_colab_kernel_is_recognised_by_its_google_colab_module(monkeypatch):
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
    assert hw.hosted_runtime() is None
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    assert hw.hosted_runtime() == "colab"


def test_a_kaggle_notebook_is_recognised_by_its_environment(monkeypatch):
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    assert hw.hosted_runtime() == "kaggle"


@pytest.mark.parametrize("variable", ["TPU_ACCELERATOR_TYPE", "COLAB_TPU_ADDR", "TPU_NAME"])
def test_a_tpu_runtime_is_recognised_from_its_environment(monkeypatch, variable):
    monkeypatch.setenv(variable, "v5litepod-8")
    assert hw.accelerator_runtime() == "tpu"


@pytest.mark.parametrize(("devices", "expected"), [
    (["/dev/accel0"], "jax[tpu]"), (["/dev/vfio/0"], "jax[tpu]"),
    (["/dev/nvidia0", "/dev/nvidiactl"], "jax[cuda12]"), (["/dev/nvidiactl"], None), ([], None)])
def test_the_accelerator_build_of_the_locked_jax_follows_the_devices(monkeypatch, devices, expected):
    for variable in ("TPU_ACCELERATOR_TYPE", "COLAB_TPU_ADDR", "TPU_NAME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(hosted.glob, "glob", lambda pattern: fnmatch.filter(devices, pattern))
    requirement = hosted.accelerator_requirement(hw.accelerator_runtime())
    assert requirement == (expected and f"{expected}=={LOCK['jax']}")


def test_accelerator_support_installs_the_locked_jax_with_the_tpu_extra_under_the_lock(monkeypatch):
    calls = []
    monkeypatch.setattr(hosted, "accelerator_runtime", lambda: "tpu")
    monkeypatch.setattr(subprocess, "check_call", lambda command: calls.append(
        (command, hosted.read_lock(open(command[command.index("-c") + 1]).read()))))
    assert hw.install_accelerator_support() == f"jax[tpu]=={jax.__version__}"
    (command, constraints), = calls
    assert command[-1] == f"jax[tpu]=={jax.__version__}" and constraints == LOCK


def test_accelerator_support_does_nothing_on_a_cpu_machine(monkeypatch):
    monkeypatch.setattr(hosted, "accelerator_runtime", lambda: None)
    monkeypatch.setattr(subprocess, "check_call", lambda command: pytest.fail("pip was called"))
    assert hw.install_accelerator_support() is None


def test_the_lock_ships_with_the_package_and_is_the_repositorys():
    shipped = importlib.resources.files("stacklib.hw").joinpath(hosted.LOCK_FILE)
    assert shipped.read_text() == (ROOT / "constraints.txt").read_text()
    assert hosted.read_lock() == LOCK and LOCK["jax"] == jax.__version__


def test_a_hosted_runtime_installs_stacklibs_requirements_the_chapters_extras_and_jaxs_accelerator_build():
    wanted = hosted.requirements("tpu")
    assert {r for r in wanted if not r.startswith("jax[")} >= {"flax==0.12.8", f"openai=={LOCK['openai']}",
                                                               f"google-tunix=={LOCK['google-tunix']}"}
    assert wanted[-1] == f"jax[tpu]=={LOCK['jax']}" and not any("pytest" in r for r in wanted)


def test_what_the_chapters_install_themselves_on_colab_is_installed_by_the_setup_at_the_locks_version():
    lines = [line for path in sorted((ROOT / "chapters").glob("*.md"))
             for line in path.read_text().splitlines() if "%pip install" in line and "stacklib @" not in line]
    assert lines, "chapters 10, 13 and 14 install their comparison libraries on Colab"
    for line in lines:
        for name, version in re.findall(r"([A-Za-z0-9_.-]+)==([^\s\"']+)", line):
            assert hosted.canonical(name) in hosted.NOTEBOOK_EXTRAS, line
            assert LOCK[hosted.canonical(name)] == version, line


def test_in_cis_own_environment_nothing_is_off_the_lock():
    lock = hosted.read_lock()
    assert hosted.mismatches(hosted.requirements(None, lock), hosted.pins_for_this_host(lock)) == {}


def test_the_check_reports_missing_packages_wrong_pins_and_unmet_extras():
    numpy = importlib.metadata.version("numpy")
    assert hosted.mismatches(["numpy"], {"numpy": "1.0"}) == {"numpy": (numpy, "1.0")}
    assert hosted.mismatches(["no-such-package>=2"], {}) == {"no-such-package": (None, ">=2")}
    assert hosted.mismatches([f"jax[tpu]=={jax.__version__}"], LOCK)["libtpu"][0] is None  # none here


def test_the_hosts_kernel_packages_keep_their_installed_versions():
    pins = hosted.pins_for_this_host({**LOCK, "ipykernel": "0.1", "tornado": "0.1", "numpy": "0.1"})
    assert pins["ipykernel"] == importlib.metadata.version("ipykernel")
    assert pins["tornado"] == importlib.metadata.version("tornado")  # ipykernel requires it
    assert pins["numpy"] == "0.1"  # not the kernel's: the lock decides


def test_a_module_whose_file_pip_replaced_after_it_was_imported_is_stale(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "replaced_module.py").write_text("x = 1\n")
    (tmp_path / "kept_module.py").write_text("x = 1\n")
    os.utime(tmp_path / "replaced_module.py", (time.time() - 60,) * 2)
    os.utime(tmp_path / "kept_module.py", (time.time() - 60,) * 2)
    import kept_module  # noqa: F401
    import replaced_module  # noqa: F401

    since = time.time() - 1
    (tmp_path / "replaced_module.py").write_text("x = 2\n")
    stale = hosted.stale_modules(since)
    assert "replaced_module" in stale and "kept_module" not in stale
    (tmp_path / "replaced_module.py").unlink()
    assert "replaced_module" in hosted.stale_modules(time.time() + 60)  # removed counts too


@pytest.fixture
def runtime(monkeypatch):
    """prepare_runtime()'s collaborators replaced by recorders: the child processes and the clock."""
    calls = []
    monkeypatch.setattr(hosted, "_stale_in_this_kernel", [])
    monkeypatch.setattr(hosted, "accelerator_runtime", lambda: None)
    monkeypatch.setattr(hosted, "_child", lambda *args: calls.append(args) or 0)
    monkeypatch.setattr(hosted.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(hosted.os, "kill", lambda pid, sig: calls.append(("kill", pid, sig)))
    return calls


def test_setting_up_does_nothing_outside_colab_and_kaggle(runtime, monkeypatch):
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
    hw.prepare_runtime()
    assert runtime == []


def test_a_set_up_runtime_is_checked_then_described(runtime, monkeypatch):
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    monkeypatch.setattr(hosted, "stale_modules", lambda since: [])
    hw.prepare_runtime()
    assert runtime == [("install", "cpu"), ("describe", "kaggle")]


def test_on_colab_a_stale_module_restarts_the_runtime(runtime, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr(hosted, "stale_modules", lambda since: ["numpy", "PIL"])
    with pytest.raises(hosted.RuntimeNotReady):  # os.kill is a recorder here, so the call returns
        hw.prepare_runtime()
    assert runtime == [("install", "cpu"), ("kill", os.getpid(), signal.SIGKILL)]
    assert "Restarting the runtime: numpy, PIL" in capsys.readouterr().out


def test_elsewhere_a_stale_module_stops_the_notebook_with_one_sentence_until_the_kernel_restarts(runtime,
                                                                                                 monkeypatch):
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    monkeypatch.setattr(hosted, "stale_modules", lambda since: ["numpy"])
    for _ in range(2):
        with pytest.raises(hosted.RuntimeNotReady, match="numpy .* restart the kernel") as stopped:
            hw.prepare_runtime()
    assert runtime == [("install", "cpu")]  # the second run installs nothing and stops again
    assert stopped.value._render_traceback_() == [f"RuntimeNotReady: {stopped.value}"]  # what IPython shows


def test_a_failed_install_stops_the_notebook(runtime, monkeypatch):
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    monkeypatch.setattr(hosted, "_child", lambda *args: 1)
    with pytest.raises(hosted.RuntimeNotReady, match="pip's messages above"):
        hw.prepare_runtime()


FIND_SPEC = importlib.util.find_spec


def _run_setup_cell(monkeypatch, installed: bool) -> list:
    """Run the setup cell as plain Python; the %pip line (IPython syntax) becomes a recorder."""
    calls = []
    monkeypatch.setattr(hw, "prepare_runtime", lambda: calls.append("prepare"))
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: FIND_SPEC(name, *a) if installed or name != "stacklib" else None)
    code = re.sub(r"%pip (.*)", lambda m: f"calls.append({m.group(1)!r})", hw.setup_cell_source())
    exec(compile(code, "<setup cell>", "exec"), {"calls": calls})
    return calls


def test_the_setup_cell_does_nothing_outside_colab_and_kaggle(monkeypatch):
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
    assert _run_setup_cell(monkeypatch, installed=False) == []


@pytest.mark.parametrize("host", ["colab", "kaggle"])
def test_the_setup_cell_installs_stacklib_alone_on_a_fresh_runtime_then_prepares_it(monkeypatch, host):
    if host == "colab":
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    else:
        monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Batch")
    assert hw.hosted_runtime() == host  # the cell's test and stacklib's agree
    install = f'install --quiet --no-deps "stacklib @ git+{hw.REPOSITORY_URL}@{hw.BRANCH}"'
    assert _run_setup_cell(monkeypatch, installed=False) == [install, "prepare"]
    assert _run_setup_cell(monkeypatch, installed=True) == ["prepare"]  # a second run: no pip


def test_colab_badge_points_at_the_notebook_in_the_repository():
    badge = hw.colab_badge("chapters/00_how_to_use.ipynb")
    assert badge.endswith(
        "(https://colab.research.google.com/github/build-the-jax-ai-stack/book/blob/main/"
        "chapters/00_how_to_use.ipynb)"
    )


def test_the_multi_chip_chapters_and_only_they_show_a_kaggle_badge_beside_the_colab_one():
    assert hw.KAGGLE_NOTEBOOKS == ("chapters/07_scaling_out.ipynb", "chapters/16_capstone.ipynb")
    for path in sorted((ROOT / "chapters").glob("*.ipynb")):
        notebook = path.relative_to(ROOT).as_posix()
        title = nbformat.read(path, as_version=4).cells[0].source
        assert (f"{hw.colab_badge(notebook)} {hw.kaggle_badge(notebook)}" in title) == (
            notebook in hw.KAGGLE_NOTEBOOKS), notebook
        assert (hw.kaggle_url(notebook) in title) == (notebook in hw.KAGGLE_NOTEBOOKS), notebook


def test_kaggle_badge_imports_the_notebook_from_the_repository():
    badge = hw.kaggle_badge("chapters/07_scaling_out.ipynb")
    assert badge.startswith("[![Open in Kaggle](https://kaggle.com/static/images/open-in-kaggle.svg)]")
    assert badge.endswith("(https://kaggle.com/kernels/welcome?src=https://github.com/build-the-jax-ai-stack/book/"
                          "blob/main/chapters/07_scaling_out.ipynb)")


def test_the_accelerator_tests_are_skipped_not_passed_where_jax_sees_only_a_cpu():
    accelerator = importlib.import_module("accelerator.test_on_accelerator")
    skip = accelerator.pytestmark.mark
    assert skip.name == "skipif" and skip.args == (True,)
    assert "no GPU or TPU" in skip.kwargs["reason"] and "make test-accelerator" in skip.kwargs["reason"]


def test_glue_hands_the_value_to_myst_nb_and_returns_it(monkeypatch):
    recorded = []
    fake = types.ModuleType("myst_nb")
    fake.glue = lambda name, value, display=True: recorded.append((name, value, display))
    monkeypatch.setitem(sys.modules, "myst_nb", fake)
    assert hw.glue("speedup", 2.5, display=False) == 2.5
    assert recorded == [("speedup", 2.5, False)]


def test_glue_without_myst_nb_shows_the_value_as_a_hosted_notebook_would(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "myst_nb", None)  # an import of it now fails
    assert hw.glue("loss", 0.25) == 0.25
    assert "0.25" in capsys.readouterr().out
    assert hw.glue("quiet", 3, display=False) == 3
    assert capsys.readouterr().out == ""


def test_glue_refuses_a_name_a_myst_role_cannot_name():
    with pytest.raises(ValueError, match="letters, digits"):
        hw.glue("two words", 1)


def test_glue_hands_myst_nb_a_scalar_array_as_the_number_its_format_spec_can_read(monkeypatch):
    recorded = []
    fake = types.ModuleType("myst_nb")
    fake.glue = lambda name, value, display=True: recorded.append(value)
    monkeypatch.setitem(sys.modules, "myst_nb", fake)
    assert hw.glue("a", np.float64(0.5)) == 0.5 and hw.glue("b", jnp.int32(3)) == 3
    assert [type(value) for value in recorded] == [float, int]
    assert repr(recorded[0]) == "0.5"
