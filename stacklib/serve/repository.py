"""A model repository on disk, `models/<name>/<version>/`, rescanned while serving.

Each version is an artifact written by `stacklib.serve.export` into a folder named by
an integer. A scan (every `poll_interval` seconds in a background thread) loads each
version it has not seen: verify every hash, deserialize, compile the batch shape
with a warm-up call. Only a version that got through all of that becomes AVAILABLE.

The rules that keep a server up while models change under it:

* requests without a version go to the newest AVAILABLE version; a newer folder that
  fails to load is marked FAILED, with its error in the status, and never served;
* a FAILED version is retried only when its files change (a copy still in progress
  finishes, a bad file is replaced), not on every scan;
* `export` writes beside the final name and renames, so a scan sees a whole artifact or
  none; folders whose names are not integers (`3.partial-1a2b`) are ignored;
* a version, once loaded, keeps serving from memory whatever happens to its folder.

A sequence model (input `int32[b, t]` with a bound such as `t <= 128` and a `pad_value`
in its manifest, as `stacklib.serve.lm.export` writes) gets one batcher per *length
bucket*: powers of two from 8 up to the bound (8, 16, 32, 64, 128). A request of n tokens
is padded to the smallest bucket that holds it, so prompts of 20 and 30 tokens share a
call of length 32, and each bucket's one call shape is compiled at load time.
`max_batch_tokens` caps rows x length per call (vLLM's `max_num_batched_tokens`): a
bucket of length L batches at most `max_batch_tokens // L` rows. On a CPU a long call is
compute-bound, and because every call is padded to its bucket's full batch (the one-shape
rule), a 64-row call of length 128 made for 5 real rows costs as much as 64 of them.

Differences from TF Serving's model manager: every loaded version stays loaded (no
version policy, no unloading); no resource estimation before loading.
"""

from __future__ import annotations

import dataclasses
import pathlib
import threading
from typing import Any

import numpy as np

from stacklib.serve import artifact
from stacklib.serve.batching import DynamicBatcher

AVAILABLE, FAILED = "AVAILABLE", "FAILED"


@dataclasses.dataclass
class Version:
    name: str
    number: int
    path: pathlib.Path
    state: str
    fingerprint: tuple
    error: str | None = None
    model: artifact.LoadedModel | None = None
    batchers: dict[int | None, DynamicBatcher] = dataclasses.field(default_factory=dict)

    @property
    def batcher(self) -> DynamicBatcher:
        """The batcher of a fixed-shape model (a sequence model has one per length bucket)."""
        return self.batchers[None]

    @property
    def length_buckets(self) -> list[int]:
        """The padded lengths of a sequence model, increasing ([] for a fixed-shape model)."""
        return sorted(length for length in self.batchers if length is not None)

    def bucket(self, length: int) -> int:
        """The smallest length bucket that holds `length` tokens."""
        return next(b for b in self.length_buckets if b >= length)

    def status(self) -> dict[str, Any]:
        status = {"version": self.number, "state": self.state}
        if self.model is not None:
            status["signature"] = self.model.signature
            status["platforms"] = self.model.manifest["platforms"]
            if self.length_buckets:
                status["length_buckets"] = self.length_buckets
                status["rows_per_call"] = [self.batchers[b].max_batch_size for b in self.length_buckets]
        if self.error:
            status["error"] = self.error
        return status


def _fingerprint(path: pathlib.Path) -> tuple:
    """The folder's files with sizes and modification times: changes when anything is written."""
    try:
        return tuple(sorted((p.relative_to(path).as_posix(), p.stat().st_size, p.stat().st_mtime_ns)
                            for p in path.rglob("*") if p.is_file()))
    except FileNotFoundError:  # a file vanished mid-scan: it is still being written
        return ("changing",)


def length_buckets(max_length: int, smallest: int = 8) -> list[int]:
    """Powers of two from `smallest` below `max_length`, then `max_length`: [8, 16, ..., max]."""
    sizes, size = [], smallest
    while size < max_length:
        sizes.append(size)
        size *= 2
    return [*sizes, max_length]


def _sequence_length_bound(model: artifact.LoadedModel, path: pathlib.Path) -> int | None:
    """None for a fixed-shape input; the largest length for a (batch, length) sequence input."""
    spec = model.manifest["inputs"][0]
    variable = [d for d in spec["shape"][1:] if isinstance(d, str)]
    if not variable:
        return None
    if len(spec["shape"]) != 2 or np.dtype(spec["dtype"]).kind not in "iu":
        raise artifact.ArtifactError(f"{path} takes {spec['dtype']}{spec['shape']}; the server serves "
                                     "fixed shapes, or integer (batch, length) token sequences.")
    high = artifact.dim_bounds(model.manifest)[variable[0]][1]
    if high is None or model.manifest.get("pad_value") is None:
        raise artifact.ArtifactError(
            f"{path} has a symbolic length {variable[0]!r} without an upper bound or a pad_value; export "
            f"with constraints=['{variable[0]} <= N'] and pad_value=... (stacklib.serve.lm.export does).")
    return high


class ModelRepository:
    """The versions under `root`, loaded and batched; `get(name, version)` picks one."""

    def __init__(self, root: str | pathlib.Path, *, max_batch_size: int = 32, batch_timeout: float = 0.002,
                 poll_interval: float = 1.0, max_batch_tokens: int | None = None):
        self.root = pathlib.Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"the model directory {self.root} does not exist; create it and export "
                                    "models into <name>/<version>/ inside it.")
        if max_batch_size < 1 or (max_batch_tokens is not None and max_batch_tokens < 1):
            raise ValueError(f"max_batch_size={max_batch_size} and max_batch_tokens={max_batch_tokens} "
                             "must be at least 1 (max_batch_tokens=None: no cap).")
        if batch_timeout < 0 or poll_interval <= 0:
            raise ValueError(f"batch_timeout={batch_timeout} must be >= 0 and poll_interval={poll_interval} "
                             "> 0 (seconds).")
        self.max_batch_size, self.batch_timeout = max_batch_size, batch_timeout
        self.max_batch_tokens = max_batch_tokens
        self.poll_interval = poll_interval
        self._models: dict[str, dict[int, Version]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    def _load(self, name: str, number: int, path: pathlib.Path, fingerprint: tuple) -> Version:
        batchers: dict[int | None, DynamicBatcher] = {}
        try:
            model = artifact.load(path)
            if len(model.manifest["inputs"]) != 1:
                raise artifact.ArtifactError(f"{path} takes {len(model.manifest['inputs'])} inputs; the "
                                             "server serves models with one input array.")
            spec = model.manifest["inputs"][0]
            bound = _sequence_length_bound(model, path)
            for length in [None] if bound is None else length_buckets(bound):
                batchers[length] = DynamicBatcher(model, max_batch_size=self.rows_per_call(length),
                                                  batch_timeout=self.batch_timeout)
                row_shape = spec["shape"][1:] if length is None else [length]
                batchers[length].warm_up(np.zeros(row_shape, spec["dtype"]))
        except Exception as error:  # any failure leaves this version FAILED and the others serving
            for batcher in batchers.values():
                batcher.close()
            return Version(name, number, path, FAILED, fingerprint, error=f"{type(error).__name__}: {error}")
        return Version(name, number, path, AVAILABLE, fingerprint, model=model, batchers=batchers)

    def rows_per_call(self, length: int | None) -> int:
        """The batch size of a call: max_batch_size, fewer for long buckets under max_batch_tokens."""
        if length is None or self.max_batch_tokens is None:
            return self.max_batch_size
        return max(1, min(self.max_batch_size, self.max_batch_tokens // length))

    def scan(self) -> list[str]:
        """Load new versions (and retry changed failed ones); return what happened, one line each."""
        events = []
        for model_dir in sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            for path in sorted(p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()):
                known = self._models.get(model_dir.name, {}).get(int(path.name))
                fingerprint = _fingerprint(path)
                if known is not None and (known.state == AVAILABLE or known.fingerprint == fingerprint):
                    continue
                version = self._load(model_dir.name, int(path.name), path, fingerprint)
                with self._lock:
                    self._models.setdefault(model_dir.name, {})[version.number] = version
                events.append(f"{model_dir.name} version {version.number}: {version.state}"
                              + (f" ({version.error})" if version.error else ""))
        return events

    def get(self, name: str, version: int | None = None) -> Version:
        """The newest AVAILABLE version of `name`, or the pinned `version`.

        Raises:
          KeyError: with a message naming what exists (the server answers 404 with it).
        """
        with self._lock:
            versions = dict(self._models.get(name, {}))
        if not versions:
            raise KeyError(f"no model named {name!r}; models: {sorted(self._models)}.")
        available = sorted(n for n, v in versions.items() if v.state == AVAILABLE)
        if version is None:
            if not available:
                raise KeyError(f"model {name!r} has no loadable version: {self.status(name)['versions']}.")
            return versions[available[-1]]
        if version not in available:
            raise KeyError(f"model {name!r} has no available version {version}; available: {available}.")
        return versions[version]

    def status(self, name: str | None = None) -> dict[str, Any]:
        with self._lock:
            models = {n: dict(v) for n, v in self._models.items()}
        if name is not None:
            if name not in models:
                raise KeyError(f"no model named {name!r}; models: {sorted(models)}.")
            versions = models[name]
            available = [n for n, v in versions.items() if v.state == AVAILABLE]
            return {"name": name, "default_version": max(available, default=None),
                    "versions": [versions[n].status() for n in sorted(versions)]}
        return {"models": [self.status(n) for n in sorted(models)]}

    def batch_sizes(self) -> dict[int, int]:
        """Rows per model call -> number of calls, over every loaded version."""
        totals: dict[int, int] = {}
        with self._lock:
            batchers = [b for vs in self._models.values() for v in vs.values() for b in v.batchers.values()]
        for batcher in batchers:
            for size, calls in list(batcher.batch_sizes.items()):
                totals[size] = totals.get(size, 0) + calls
        return dict(sorted(totals.items()))

    def start(self) -> ModelRepository:
        """Scan now, then every `poll_interval` seconds in a background thread."""
        self.scan()
        self._poller = threading.Thread(target=self._poll, daemon=True, name="ModelRepository")
        self._poller.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_interval):
            try:
                self.scan()
            except OSError:  # a folder vanished mid-scan; the next scan sees the settled state
                continue

    def close(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join()
        with self._lock:
            batchers = [b for vs in self._models.values() for v in vs.values() for b in v.batchers.values()]
        for batcher in batchers:
            batcher.close()
