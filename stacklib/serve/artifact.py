"""An exported model as a self-describing folder: program, weights, manifest with hashes.

`export` traces the model's function once with `jax.export`, with a *symbolic* batch
dimension (and, for a sequence model, a symbolic length bounded by a constraint such as
`"t <= 128"`), and writes

    program.bin          the serialized `jax.export.Exported` (StableHLO + calling convention)
    weights/             the parameters in `stacklib.checkpoint`'s tree format (CRC-32 per leaf)
    manifest.json        input/output signatures (symbolic dims as strings), the
                         constraints on them, platforms, versions, and the SHA-256 of
                         every other file

`load` reads it back in a process that needs neither the model's code nor flax: it
verifies every hash *before* it deserializes anything (a tampered or truncated file is
refused with an error that names it), checks that this machine's platform is one the
program was lowered for, and returns a callable with the weights bound in.

Differences from orbax-export (`orbax.export.ExportManager`): no TensorFlow SavedModel,
no `tf.function` pre/post-processing, no TF Serving signatures; the artifact is only
readable by JAX. The manifest is not signed: its hashes catch damage and tampering with
the program or weights, not an attacker who rewrites the manifest too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import pathlib
import platform as platform_lib
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import export as jax_export

import stacklib
from stacklib.checkpoint import atomic, tree_files

FORMAT = "stacklib.serve.artifact/1"
MANIFEST = "manifest.json"
PROGRAM = "program.bin"
WEIGHTS = "weights"
# jax.export names the GPU platform 'cuda' (or 'rocm'); jax.default_backend() says 'gpu'.
_BACKEND_TO_PLATFORMS = {"cpu": ("cpu",), "tpu": ("tpu",), "gpu": ("cuda", "rocm")}


class ArtifactError(ValueError):
    """An exported artifact is missing a file, fails a hash, or cannot run here."""


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_pure_dict(params: Any) -> None:
    """The weights must round-trip through the tree format as nested dicts of arrays."""
    for key_path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not all(isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, str) for k in key_path):
            raise TypeError(
                f"params must be nested dicts with str keys, but the leaf at "
                f"{jax.tree_util.keystr(key_path)} is not. For an nnx State pass "
                "nnx.to_pure_dict(state): an nnx.State cannot be serialized."
            )


def _signature(avals: Sequence[Any]) -> list[dict]:
    """Shapes as strings ('b', 64) so that symbolic dimensions survive JSON."""
    return [{"shape": [d if isinstance(d, int) else str(d) for d in aval.shape],
             "dtype": np.dtype(aval.dtype).name} for aval in avals]


def export(fn: Callable, params: Any, example_args: Sequence[Any], directory: str | pathlib.Path, *,
           platforms: Sequence[str] = ("cpu", "tpu", "cuda"), batch_dim: str = "b",
           polymorphic_shapes: Sequence[str] | None = None, constraints: Sequence[str] = (),
           pad_value: int | float | None = None, vjp_order: int = 0, metadata: dict | None = None) -> dict:
    """Export `fn(params, *args)` with a symbolic leading (batch) dimension on every arg.

    The function is traced once. The program takes the weights as its first argument
    (so they travel as a checkpoint, not as constants baked into the StableHLO) and can
    be called at any batch size (and any length, for a sequence model, within its
    constraints).

    Args:
      fn: a pure function `fn(params, *args) -> outputs` (close over a graphdef, not state).
      params: nested dicts of arrays with str keys, e.g.
        `nnx.to_pure_dict(nnx.state(model, nnx.Param))`.
      example_args: arrays (or ShapeDtypeStructs) giving each argument's shape and dtype;
        their leading dimension becomes the symbolic `batch_dim`.
      directory: where to write; must not exist. Written beside it, then renamed into place,
        so a reader (the model server) sees the whole artifact or none of it.
      platforms: lowering platforms ('cpu', 'tpu', 'cuda', 'rocm'); all work from a CPU.
      batch_dim: the name of the symbolic dimension.
      polymorphic_shapes: one `jax.export` shape spec per argument, replacing the default
        `"b, ..."`; e.g. `["b, t"]` for tokens of any batch and any length.
      constraints: `jax.export` symbolic constraints, e.g. `["t <= 128"]`: the program
        refuses other shapes, and code that compares `t` with 128 traces (it would be
        undecidable for an unbounded `t`).
      pad_value: the value that pads a symbolic non-batch dimension (a sequence model's
        `-1` padding token); the model server needs it to put requests of different
        lengths into one call.
      vjp_order: how many orders of derivatives to serialize (1 lets `jax.grad` run on
        the loaded function).
      metadata: extra JSON-serializable facts to record in the manifest.

    Returns:
      The manifest, as written.
    """
    _check_pure_dict(params)
    directory = pathlib.Path(directory)
    if directory.exists():
        raise FileExistsError(f"{directory} exists already; export into a new directory (a new version).")
    params_spec = jax.tree.map(lambda p: jax.ShapeDtypeStruct(np.shape(p), p.dtype), params)
    shapes = list(polymorphic_shapes) if polymorphic_shapes is not None else f"{batch_dim}, ..."
    arg_specs = jax_export.symbolic_args_specs(tuple(example_args), shapes, constraints=tuple(constraints))
    exported = jax_export.export(jax.jit(fn), platforms=tuple(platforms))(params_spec, *arg_specs)
    n_params = len(jax.tree.leaves(params_spec))

    temporary = atomic.temporary_directory(directory)
    temporary.mkdir(parents=True)
    tree_files.write_file(temporary / PROGRAM, exported.serialize(vjp_order=vjp_order))
    tree_files.write_tree(temporary / WEIGHTS, tree_files.snapshot(params))
    files = sorted(p for p in temporary.rglob("*") if p.is_file())
    manifest = {
        "format": FORMAT,
        "function": exported.fun_name,
        "inputs": _signature(exported.in_avals[n_params:]),
        "outputs": _signature(exported.out_avals),
        "weights": _signature(exported.in_avals[:n_params]),
        "constraints": list(constraints),
        "pad_value": pad_value,
        "platforms": list(exported.platforms),
        "vjp_order": vjp_order,
        "versions": {"jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"),
                     "stacklib": stacklib.__version__,
                     "python": platform_lib.python_version(),
                     "calling_convention": exported.calling_convention_version},
        "metadata": metadata or {},
        "files": {p.relative_to(temporary).as_posix(): _sha256(p) for p in files},
    }
    tree_files.write_file(temporary / MANIFEST, json.dumps(manifest, indent=1).encode())
    atomic.commit(temporary, directory)
    return manifest


def read_manifest(directory: str | pathlib.Path) -> dict:
    """The artifact's manifest; ArtifactError if it is missing or not ours."""
    path = pathlib.Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{path} is missing: {directory} is not a complete exported artifact "
                            "(still being written, or not an export).") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise ArtifactError(f"{path} is damaged (not valid JSON: {error}).") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a {FORMAT} manifest.")
    return manifest


def verify(directory: str | pathlib.Path) -> dict:
    """Check the SHA-256 of every file the manifest lists; return the manifest.

    Raises:
      ArtifactError: naming the first missing, truncated or altered file, or an extra
        file that the manifest does not list.
    """
    directory = pathlib.Path(directory)
    manifest = read_manifest(directory)
    for name, expected in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            raise ArtifactError(f"{path} is missing from the artifact; re-export the model.")
        if _sha256(path) != expected:
            raise ArtifactError(f"{path} fails its SHA-256 check (altered or truncated); refusing to load "
                                "it. Re-export the model or restore the file.")
    extra = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                   if p.is_file() and p.name != MANIFEST and p.relative_to(directory).as_posix()
                   not in manifest["files"])
    if extra:
        raise ArtifactError(f"{directory} has files the manifest does not list: {extra}; refusing to load "
                            "it.")
    return manifest


def signature_text(manifest: dict) -> str:
    """'(float32[b,64]) -> (float32[b,10])', with its constraints: as errors and the chapter print it."""
    def one(specs):
        return ", ".join(f"{s['dtype']}[{','.join(map(str, s['shape']))}]" for s in specs)
    constraints = manifest.get("constraints") or []
    where = f" where {', '.join(constraints)}" if constraints else ""
    return f"({one(manifest['inputs'])}) -> ({one(manifest['outputs'])}){where}"


_BOUND = re.compile(r"^\s*([A-Za-z_]\w*)\s*(<=|>=|<|>)\s*(-?\d+)\s*$")


def dim_bounds(manifest: dict) -> dict[str, tuple[int, int | None]]:
    """Each symbolic dimension's (smallest, largest) size, read from the simple constraints.

    `"t <= 128"` gives `{"t": (1, 128)}`; a dimension without an upper bound gets None.
    Constraints of another form (`"a == b + 1"`) are left to `jax.export`'s own check.
    """
    names = {d for spec in manifest["inputs"] for d in spec["shape"] if isinstance(d, str)}
    bounds = {name: [1, None] for name in names}
    for constraint in manifest.get("constraints") or []:
        match = _BOUND.match(constraint)
        if not match or match[1] not in bounds:
            continue
        value = int(match[3])
        if match[2] in ("<=", "<"):
            bounds[match[1]][1] = value - (match[2] == "<")
        else:
            bounds[match[1]][0] = value + (match[2] == ">")
    return {name: (low, high) for name, (low, high) in bounds.items()}


@dataclasses.dataclass
class LoadedModel:
    """An exported function with its weights bound in: `model(*args)`.

    Each new input shape compiles the same deserialized StableHLO once for that shape;
    nothing is traced from the model's Python code (there is none in this process).
    """

    manifest: dict
    exported: jax_export.Exported
    weights: Any

    def __post_init__(self):
        self._call = jax.jit(self.exported.call)

    @property
    def signature(self) -> str:
        return signature_text(self.manifest)

    def __call__(self, *args: Any) -> Any:
        self.check_shapes(*args)
        return self._call(self.weights, *args)

    def check_shapes(self, *args: Any) -> None:
        """ValueError naming the signature if an argument's rank, fixed size or bounded size is off.

        `jax.export` checks too, but its "Error refining shapes" does not say which
        dimension broke which constraint.
        """
        specs, bounds, seen = self.manifest["inputs"], dim_bounds(self.manifest), {}
        if len(args) != len(specs):
            raise TypeError(f"the model takes {len(specs)} argument(s), got {len(args)}; "
                            f"signature {self.signature}.")
        for position, (arg, spec) in enumerate(zip(args, specs, strict=True)):
            shape = tuple(np.shape(arg))
            if len(shape) != len(spec["shape"]):
                raise ValueError(f"argument {position} has shape {shape}; the signature is {self.signature}.")
            for size, dim in zip(shape, spec["shape"], strict=True):
                if isinstance(dim, int):
                    ok = size == dim
                else:
                    low, high = bounds[dim]
                    ok = low <= size and (high is None or size <= high) and seen.setdefault(dim, size) == size
                if not ok:
                    raise ValueError(f"argument {position} has shape {shape}, which does not fit "
                                     f"{self.signature}.")

    def compiled_shapes(self) -> int:
        """How many input shapes have been compiled so far (one per batch size seen)."""
        return self._call._cache_size()


def load(directory: str | pathlib.Path, *, platform: str | None = None) -> LoadedModel:
    """Verify, then load, an artifact written by `export`.

    Args:
      directory: the artifact folder.
      platform: the platform to run on (default: `jax.default_backend()`).

    Raises:
      ArtifactError: a file is missing or fails its hash, or the program was not lowered
        for this platform (the message lists the platforms it was lowered for).
    """
    directory = pathlib.Path(directory)
    manifest = verify(directory)
    backend = platform or jax.default_backend()
    wanted = _BACKEND_TO_PLATFORMS.get(backend, (backend,))
    if not set(wanted) & set(manifest["platforms"]):
        raise ArtifactError(f"{directory} was exported for {manifest['platforms']}, not for this {backend} "
                            f"machine; export again with platforms=(..., {wanted[0]!r}).")
    exported = jax_export.deserialize(bytearray((directory / PROGRAM).read_bytes()))
    weights = tree_files.read_tree(directory / WEIGHTS)
    return LoadedModel(manifest, exported, weights)
