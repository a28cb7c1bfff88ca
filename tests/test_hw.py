"""stacklib.hw: hardware description, problem sizes, simulated devices, notebook setup."""

import importlib
import subprocess
import textwrap

import jax
import pytest
from conftest import run_python

from stacklib import hw


def test_sizes_returns_the_table_row_of_the_requested_backend():
    for backend in hw.BACKENDS:
        assert vars(hw.sizes("matmul", backend)) == hw.PROBLEM_SIZES["matmul"][backend]


def test_sizes_defaults_to_the_backend_jax_runs_on():
    assert vars(hw.sizes("matmul")) == hw.PROBLEM_SIZES["matmul"][jax.default_backend()]


def test_every_problem_has_the_same_positive_sizes_for_every_backend():
    for problem, rows in hw.PROBLEM_SIZES.items():
        assert set(rows) == set(hw.BACKENDS), problem
        keys = {tuple(sorted(row)) for row in rows.values()}
        assert len(keys) == 1, f"{problem}: backends disagree on which sizes exist: {keys}"
        assert all(isinstance(v, int) and v > 0 for row in rows.values() for v in row.values())


def test_cpu_sizes_are_never_larger_than_accelerator_sizes():
    for problem, rows in hw.PROBLEM_SIZES.items():
        for key, cpu_value in rows["cpu"].items():
            assert cpu_value <= rows["tpu"][key], f"{problem}.{key}"


def test_unknown_problem_error_lists_known_problems():
    with pytest.raises(KeyError, match="Known problems: .*matmul"):
        hw.sizes("matmull")


def test_unknown_backend_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match="'cpu', 'gpu' or 'tpu'"):
        hw.sizes("matmul", backend="metal")


def test_describe_matches_jax():
    machine = hw.describe()
    assert machine.backend == jax.default_backend()
    assert machine.device_count == len(jax.devices())
    assert machine.jax_version == jax.__version__
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


@pytest.mark.parametrize("variable", ["TPU_ACCELERATOR_TYPE", "COLAB_TPU_ADDR", "TPU_NAME"])
def test_a_tpu_runtime_is_recognised_from_its_environment(monkeypatch, variable):
    monkeypatch.setenv(variable, "v5litepod-1")
    assert hw.accelerator_runtime() == "tpu"


def test_accelerator_support_installs_the_pinned_jax_with_the_tpu_extra(monkeypatch):
    calls = []
    monkeypatch.setattr(hw, "accelerator_runtime", lambda: "tpu")
    monkeypatch.setattr(subprocess, "check_call", lambda command: calls.append(command))
    assert hw.install_accelerator_support() == f"jax[tpu]=={jax.__version__}"
    assert calls and calls[0][-1] == f"jax[tpu]=={jax.__version__}"


def test_accelerator_support_does_nothing_on_a_cpu_machine(monkeypatch):
    monkeypatch.setattr(hw, "accelerator_runtime", lambda: None)
    monkeypatch.setattr(subprocess, "check_call", lambda command: pytest.fail("pip was called"))
    assert hw.install_accelerator_support() is None


def test_setup_cell_installs_stacklib_from_the_repository_only_on_colab():
    source = hw.setup_cell_source()
    assert f"git+{hw.REPOSITORY_URL}@{hw.BRANCH}" in source
    assert 'if "google.colab" in sys.modules:' in source
    assert all(line.startswith("    ") for line in source.split("if ")[-1].splitlines()[1:] if line)


def test_setup_cell_does_nothing_outside_colab():
    # Run the cell as plain Python (the %pip line is IPython syntax, so swap it for a marker).
    code = hw.setup_cell_source().replace("%pip", "raise SystemExit  #")
    exec(compile(code, "<setup cell>", "exec"), {})


def test_colab_badge_points_at_the_notebook_in_the_repository():
    badge = hw.colab_badge("chapters/00_how_to_use.ipynb")
    assert badge.endswith(
        "(https://colab.research.google.com/github/build-the-jax-ai-stack/book/blob/main/"
        "chapters/00_how_to_use.ipynb)"
    )


def test_the_accelerator_tests_are_skipped_not_passed_where_jax_sees_only_a_cpu():
    accelerator = importlib.import_module("accelerator.test_on_accelerator")
    skip = accelerator.pytestmark.mark
    assert skip.name == "skipif" and skip.args == (True,)
    assert "no GPU or TPU" in skip.kwargs["reason"] and "make test-accelerator" in skip.kwargs["reason"]
