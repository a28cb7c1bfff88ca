"""A model zoo: `pretrained(name)` returns a trained model, training it once per machine.

Chapters 13-15 start from a trained language model. Downloading one is not allowed (the
book needs no network at run time) and training it in every notebook would cost a
minute each, so the first call trains it deterministically with `train.py` and caches the
parameters; later calls, in any process, load them in a second:

    model, tokenizer = stacklib.llm.pretrained("stdlib-bytes")
    model = stacklib.llm.zoo.load_model_dir(folder)   # a folder in the zoo's format (the engine's)

The cache is `$STACKLIB_CACHE/llm/<name>/` (default `~/.cache/stacklib/llm/<name>/`).
Three things can go wrong with a cache, and all are handled:

* **The files depend on who built them.** XLA's CPU code rounds differently under 8
  simulated devices than under 1, and on one core than on two, so a model trained in
  whichever process asks first would differ from machine to machine. Training always
  runs in a fresh process with one CPU device and one core (zoo_build.py), and every
  caller, the first included, loads the files it wrote.

* **Two processes ask at once** (the test suite runs notebooks in parallel). An
  exclusive lock on `<name>.lock` (`fcntl.flock`, released by the kernel if the process
  dies) makes the second wait while the first trains; it then finds the model and loads
  it. Training happens once.
* **A partial or corrupt cache** (a process killed mid-write, a damaged file). The model
  is written into a temporary directory and renamed into place only when complete (an
  atomic commit, as in chapter 05), and every file carries a CRC-32 (stacklib.checkpoint).
  A cache that fails to load for any reason (missing, checksum, other shapes) is deleted
  and rebuilt, with a warning that says why.

Mirrors the shape of `transformers.AutoModel.from_pretrained` (a name in, a model out,
a local cache keyed by name, an environment variable to move it) with training in place
of downloading. Differences: no hub, no revisions; the "weights" are a function of this
library's code and this Python's standard library, so a cache is only valid on the
CPU instruction set that made it (copy it elsewhere at your own risk).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import shutil
import sys
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax

import stacklib.checkpoint as ocp
import stacklib.nn as nnx
from stacklib.llm import train, zoo_build
from stacklib.llm.config import MODEL_KEYS, Config, load_config
from stacklib.llm.model import Transformer
from stacklib.llm.tokenizer import ByteTokenizer

CACHE_ENV = "STACKLIB_CACHE"
T = TypeVar("T")

# name -> the settings that differ from configs/base.yml. Each trains in about a minute
# on an idle 2-core CPU.
ZOO: dict[str, dict[str, Any]] = {
    "stdlib-bytes": dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=192,
                         seq_len=128, batch_size=16, steps=300, learning_rate=3e-3),
}


def register(name: str, **overrides: Any) -> None:
    """Add a model to the zoo: `overrides` of the base config (checked now)."""
    load_config(None, **{**overrides, "progress": False})
    ZOO[name] = dict(overrides)


def cache_dir() -> pathlib.Path:
    """Where trained models are kept: `$STACKLIB_CACHE/llm`, default `~/.cache/stacklib/llm`."""
    base = os.environ.get(CACHE_ENV) or pathlib.Path.home() / ".cache" / "stacklib"
    return pathlib.Path(base) / "llm"


def zoo_config(name: str) -> Config:
    """The full config of zoo model `name`.

    Raises:
      KeyError: no such model; the message lists the zoo.
    """
    if name not in ZOO:
        raise KeyError(f"No model {name!r} in the zoo; choose one of {sorted(ZOO)}, or "
                       "stacklib.llm.zoo.register(name, **config_overrides) a new one.")
    return load_config(None, **{**ZOO[name], "progress": False, "checkpoint_dir": "", "metrics_file": ""})


@contextlib.contextmanager
def _exclusive(lock_path: pathlib.Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # blocks while another process holds it
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_or_build(directory: pathlib.Path, load: Callable[[pathlib.Path], T],
                  build: str, request: dict[str, Any]) -> T:
    """The cache protocol every zoo shares: `load(directory)`, building it once first if needed.

    Under an exclusive lock on `<directory>.lock`: delete the partial writes a killed process
    left behind, then load `directory` if it exists; if it cannot be loaded for any reason,
    delete it with a warning that says why. If there is nothing to load, run `build`
    ("module:function", called as `function(directory=..., **request)`) in the fixed build
    process of zoo_build.py, then load what it wrote: the first caller gets the same model,
    from the same files, as every later one. `build` must write `directory` atomically (into
    a temporary name, renamed into place when complete).
    """
    root, key = directory.parent, directory.name
    with _exclusive(root / f"{key}.lock"):
        for leftover in root.glob(f"{key}.partial-*"):  # from a process killed mid-write
            shutil.rmtree(leftover, ignore_errors=True)
        if directory.exists():
            try:
                return load(directory)
            except Exception as error:  # noqa: BLE001 - any unreadable cache is rebuilt, and we say why
                warnings.warn(f"The cached model {key!r} in {directory} cannot be loaded "
                              f"({type(error).__name__}: {error}); training it again.", stacklevel=3)
                shutil.rmtree(directory)
        if not zoo_build.in_builder():
            print(f"Training {key!r} once for this machine (in a fresh process: 1 CPU device, 1 core); "
                  f"it will be cached in {directory}.", file=sys.stderr, flush=True)
        zoo_build.run(build, {"directory": str(directory), **request})
        return load(directory)


def write_atomically(directory: pathlib.Path, step: int, items: dict[str, Any]) -> None:
    """Save `items` (name -> `ocp.args` save argument) as checkpoint `step` of a new `directory`.

    Written into a temporary sibling and renamed into place when complete, so a reader
    sees the whole model or none of it. The step's build configuration is saved with it.
    """
    staging = directory.with_name(f"{directory.name}.partial-{uuid.uuid4().hex[:8]}")
    manager = ocp.CheckpointManager(staging, options=ocp.CheckpointManagerOptions(
        enable_async_checkpointing=False))
    manager.save(step, args=ocp.args.Composite(
        **items, built_with=ocp.args.JsonSave(zoo_build.build_configuration())))
    manager.close()
    os.replace(staging, directory)  # directory does not exist here: the rename is atomic


def _abstract_params(config: Config) -> tuple[nnx.GraphDef, Any]:
    """The graphdef and parameter shapes of `config`'s model, without initialising it."""
    abstract = jax.eval_shape(lambda: train.make_model(config))
    graphdef, params = nnx.split(abstract, nnx.Param)
    return graphdef, params


def load_model_dir(directory: str | os.PathLike, config: Config | None = None) -> Transformer:
    """The model saved in `directory` in the zoo's format (`params` and `config` items).

    Args:
      directory: a folder the zoo (or `write_atomically` with the same items) wrote.
      config: the architecture the caller expects, checked against the saved one; default:
        the saved architecture.

    Raises:
      FileNotFoundError: the folder holds no committed model.
      ArchitectureMismatchError: the saved model is not `config`'s architecture.
    """
    directory = pathlib.Path(directory)
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True))
    step = manager.latest_step()
    if step is None:
        raise FileNotFoundError(f"{directory} holds no committed model; save one with "
                                "stacklib.llm.pretrained (the zoo's format: params + config).")
    saved = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config
    if config is None:
        config = load_config(None, **{key: saved[key] for key in MODEL_KEYS}, progress=False)
    train.check_architecture(saved, config, str(directory))
    graphdef, abstract = _abstract_params(config)
    restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))
    return nnx.merge(graphdef, restored.params)


def build(directory: str, config: dict[str, Any]) -> None:
    """Train the model of `config` (a full `Config` dict) and write it into `directory`.

    Run by zoo_build.py in the fixed build process; call `pretrained` instead.
    """
    config = load_config(None, **config)
    result = train.train(config)
    write_atomically(pathlib.Path(directory), config.steps, {
        "params": ocp.args.StandardSave(result.params),
        "config": ocp.args.JsonSave(config.to_dict()),
        "metrics": ocp.args.JsonSave({"eval_loss": result.eval_loss, "losses": result.losses})})


def pretrained(name: str = "stdlib-bytes") -> tuple[Transformer, ByteTokenizer]:
    """Zoo model `name` and its tokenizer, trained on the first call and cached after.

    Safe to call from several processes at once: one trains, the others wait and load.

    Raises:
      KeyError: `name` is not in the zoo.
    """
    config = zoo_config(name)
    model = load_or_build(cache_dir() / name, lambda directory: load_model_dir(directory, config),
                          "stacklib.llm.zoo:build", {"config": config.to_dict()})
    return model, ByteTokenizer()
