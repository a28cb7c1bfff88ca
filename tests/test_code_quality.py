"""stacklib's layering (the list in stacklib/__init__.py's docstring) and lint."""

import ast
import pathlib
import re
import subprocess
import sys

from conftest import ROOT

# A stacklib module imports only from layers below its own; stacklib/__init__.py lists
# the same layers for readers. `cases` (exercise cases) and `examples` (whole programs)
# sit on top, like tests, and may import anything.
ON_TOP = {"cases", "examples"}
LAYERS = {
    "hw": 0, "grading": 0, "transforms": 0, "flat_config": 0,
    "nn": 1, "optim": 1, "data": 1, "checkpoint": 1, "compile": 1, "profile": 1, "http": 1,
    "parallel": 2, "kernels": 2, "quant": 2,
    "llm": 3, "diffusion": 3,
    "align": 4, "infer": 4, "serve": 4,
    "capstone": 5,
}
TOP = 6


def _component(path: pathlib.Path) -> str:
    relative = path.relative_to(ROOT / "stacklib")
    return relative.parts[0].removesuffix(".py")


def _stacklib_imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "stacklib" and len(parts) > 1 and parts[1] in LAYERS:
                yield parts[1]


def test_every_component_has_a_layer():
    for path in (ROOT / "stacklib").iterdir():
        name = path.name.removesuffix(".py")
        if name.startswith("_") or name in ON_TOP:
            continue
        assert name in LAYERS, (f"stacklib/{path.name} is in no layer; add it to LAYERS here and to the "
                                "layer list in stacklib/__init__.py")


def test_the_layers_here_are_the_ones_stacklib_documents():
    docstring = ast.get_docstring(ast.parse((ROOT / "stacklib" / "__init__.py").read_text()))
    documented = {name: int(layer) for layer, names in re.findall(r"^\s+(\d)\s+(.+)$", docstring, re.M)
                  for name in names.split(", ")}
    assert documented == LAYERS


def test_modules_import_only_from_lower_layers():
    violations = []
    for path in (ROOT / "stacklib").rglob("*.py"):
        component = _component(path)
        if component.startswith("_"):
            continue
        layer = LAYERS.get(component, TOP)
        for imported in _stacklib_imports(path):
            if imported != component and LAYERS[imported] >= layer:
                violations.append(f"{path.relative_to(ROOT)} (layer {layer}) imports "
                                  f"stacklib.{imported} (layer {LAYERS[imported]})")
    assert not violations, "\n".join(violations)


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "stacklib", "tests", "benchmarks"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
