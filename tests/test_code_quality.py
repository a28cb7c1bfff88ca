"""stacklib's layering (the list in stacklib/__init__.py's docstring) and lint."""

import ast
import pathlib
import re
import subprocess
import sys

from conftest import ROOT

# A stacklib module imports only from layers below its own; stacklib/__init__.py lists
# the same layers for readers. Every stacklib import is checked, whichever package it is
# in. The one exception is `cases` (the grader's per-chapter exercise cases): they sit on
# top, like tests, and may import anything, and nothing in stacklib imports them (the
# grader loads them by id, through importlib).
ON_TOP = "cases"
LAYERS = {
    "hw": 0, "grading": 0, "transforms": 0, "flat_config": 0,
    "nn": 1, "optim": 1, "data": 1, "checkpoint": 1, "compile": 1, "profile": 1, "http": 1,
    "parallel": 2, "kernels": 2, "quant": 2,
    "llm": 3, "diffusion": 3,
    "align": 4, "infer": 4, "serve": 4,
    "capstone": 5, "examples": 5,
}
TOP = 6


def _component(path: pathlib.Path) -> str:
    relative = path.relative_to(ROOT / "stacklib")
    return relative.parts[0].removesuffix(".py")


def _stacklib_imports(path: pathlib.Path):
    """The stacklib component each import in `path` names: absolute, relative, `from stacklib import x`."""
    package = list(path.relative_to(ROOT).parts[:-1])  # the package a relative import starts from
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[:len(package) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" if base else alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "stacklib" and len(parts) > 1 and parts[1] != "__version__":
                yield parts[1]


def test_every_component_has_a_layer():
    for path in (ROOT / "stacklib").iterdir():
        name = path.name.removesuffix(".py")
        if name.startswith(("_", ".")) or name == ON_TOP:
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
        layer = TOP if component == ON_TOP else LAYERS[component]
        for imported in _stacklib_imports(path):
            if imported == component:
                continue
            if imported == ON_TOP:
                violations.append(f"{path.relative_to(ROOT)} imports stacklib.{ON_TOP}: the exercise cases "
                                  "sit on top of stacklib, and only the grader loads them (by id)")
            elif imported not in LAYERS:
                violations.append(f"{path.relative_to(ROOT)} imports stacklib.{imported}, in no layer")
            elif LAYERS[imported] >= layer:
                violations.append(f"{path.relative_to(ROOT)} (layer {layer}) imports "
                                  f"stacklib.{imported} (layer {LAYERS[imported]})")
    assert not violations, "\n".join(violations)


# Python salts the hash of str and bytes per process (PYTHONHASHSEED): a seed taken from
# hash("name") or hash(path) changes on every run, so a test that seeds with it draws
# different numbers each time and passes or fails by chance.
SEEDERS = {"key", "PRNGKey", "fold_in", "seed", "default_rng", "Random", "RandomState", "SeedSequence",
           "Generator", "Rngs"}
SEED_WORDS = ("seed", "rng")  # in a keyword argument's or an assigned variable's name (or a keyword `key=`)


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else ""


def _hash_used_as_seed(tree: ast.AST):
    """Line numbers of `hash(...)` calls whose result seeds a random generator."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hash"):
            continue
        if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, int):
            continue  # hash(5) == 5 in every process
        child, parent = node, parents.get(node)
        while parent is not None and not isinstance(parent, (ast.stmt, ast.Lambda)):
            if isinstance(parent, ast.Call) and child is not parent.func and _name(parent.func) in SEEDERS:
                yield node.lineno
                break
            if isinstance(parent, ast.keyword) and (parent.arg == "key" or any(
                    w in (parent.arg or "").lower() for w in SEED_WORDS)):
                yield node.lineno
                break
            child, parent = parent, parents.get(parent)
        else:
            targets = getattr(parent, "targets", None) or [getattr(parent, "target", None)]
            if isinstance(parent, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and any(  # `seed = hash(...)`
                    w in _name(t).lower() for t in targets if t is not None for w in SEED_WORDS):
                yield node.lineno


def test_no_seed_comes_from_the_builtin_hash():
    paths = [path for folder in ("stacklib", "tests", "benchmarks")
             for path in sorted((ROOT / folder).rglob("*.py"))]
    found = [f"{path.relative_to(ROOT)}:{line}" for path in paths
             for line in _hash_used_as_seed(ast.parse(path.read_text()))]
    assert not found, ("these seeds come from hash(), which changes in every process for str, bytes and "
                       "tuples of them (PYTHONHASHSEED); use a stable hash such as "
                       "zlib.crc32(repr(x).encode()):\n" + "\n".join(found))


def test_the_hash_seed_scan_finds_what_it_should_and_nothing_else():
    flagged = """
jax.random.key(hash(path) % 1000)
np.random.default_rng(hash("name"))
random.seed(hash(name))
nnx.Rngs(params=hash(name))
seed = hash(name) % 2**32
sample(x, key=hash(name))
"""
    for line in flagged.strip().splitlines():
        assert list(_hash_used_as_seed(ast.parse(line))), line
    fine = """
jax.random.key(zlib.crc32(repr(path).encode()) % 1000)
block = hash((parent, tuple(tokens)))
cache_key = hash(name)
mix_seed = feistel(lambda seed, right: hash((seed, right)))
jax.random.key(hash(5))
def __hash__(self): return hash(self.value)
"""
    assert not list(_hash_used_as_seed(ast.parse(fine)))


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "stacklib", "tests", "benchmarks"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
