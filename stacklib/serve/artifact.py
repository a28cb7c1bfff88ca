"""An exported model as a self-describing folder: program, weights, manifest with hashes.

`export` traces the model's function once with `jax.export`, with a *symbolic* batch
dimension, and writes

    program.bin          the serialized `jax.export.Exported` (StableHLO + calling convention)
    weights/             the parameters in `stacklib.checkpoint`'s tree format (CRC-32 per leaf)
    manifest.json        input/output signatures (symbolic dims as strings), platforms,
                         versions, and the SHA-256 of every other file

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
           vjp_order: int = 0, metadata: dict | None = None) -> dict:
    """Export `fn(params, *args)` with a symbolic leading (batch) dimension on every arg.

    The function is traced once. The program takes the weights as its first argument
    (so they travel as a checkpoint, not as constants baked into the StableHLO) and can
    be called at any batch size.

    Args:
      fn: a pure function `fn(params, *args) -> outputs` (close over a graphdef, not state).
      params: nested dicts of arrays, e.g. `nnx.to_pure_dict(nnx.state(model, nnx.Param))`.
      example_args: arrays (or ShapeDtypeStructs) giving each argument's shape and dtype;
        their leading dimension becomes the symbolic `batch_dim`.
      directory: where to write; must not exist. Written beside it, then renamed into place,
        so a reader (the model server) sees the whole artifact or none of it.
      platforms: lowering platforms ('cpu', 'tpu', 'cuda', 'rocm'); all work from a CPU.
      batch_dim: the name of the symbolic dimension.
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
    arg_specs = jax_export.symbolic_args_specs(tuple(example_args), f"{batch_dim}, ...")
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
    """'f32[b,64] -> f32[b,10]': the signature as error messages and the chapter print it."""
    def one(specs):
        return ", ".join(f"{s['dtype']}[{','.join(map(str, s['shape']))}]" for s in specs)
    return f"({one(manifest['inputs'])}) -> ({one(manifest['outputs'])})"


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
        return self._call(self.weights, *args)

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
