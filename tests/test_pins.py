"""One pinned stack: pyproject.toml, environment.yml, constraints.txt and this venv agree."""

import importlib.metadata
import re
import tomllib

import yaml
from conftest import ROOT

PINNED = ["jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "qwix"]


def _pins(requirements):
    pins = {}
    for line in requirements:
        match = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==([^\s;#]+).*", line)
        if match:
            pins[match.group(1).lower()] = match.group(3)
    return pins


def project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_pyproject_pins_the_stack_exactly():
    pins = _pins(project()["dependencies"])
    assert set(PINNED) <= set(pins), set(PINNED) - set(pins)
    assert pins["jax"] == pins["jaxlib"] == "0.10.2"


def test_environment_yml_pins_the_same_versions():
    environment = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in environment["dependencies"] if isinstance(d, dict))
    pins = _pins(pip_section)
    expected = _pins(project()["dependencies"])
    assert {name: pins.get(name) for name in PINNED} == {name: expected[name] for name in PINNED}


def test_constraints_lock_agrees_with_pyproject():
    locked = _pins((ROOT / "constraints.txt").read_text().splitlines())
    for name, version in _pins(project()["dependencies"]).items():
        assert locked.get(name) == version, f"constraints.txt has {name}=={locked.get(name)}"
    book = _pins(project()["optional-dependencies"]["book"])
    assert locked["jupyter-book"] == book["jupyter-book"]


def test_the_accelerator_extras_pin_the_same_jax():
    extras = project()["optional-dependencies"]
    assert _pins(extras["tpu"])["jax"] == _pins(project()["dependencies"])["jax"]


def test_this_environment_has_the_pinned_versions_installed():
    for name, version in _pins(project()["dependencies"]).items():
        assert importlib.metadata.version(name) == version, name
