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
    batcher: DynamicBatcher | None = None

    def status(self) -> dict[str, Any]:
        status = {"version": self.number, "state": self.state}
        if self.model is not None:
            status["signature"] = self.model.signature
            status["platforms"] = self.model.manifest["platforms"]
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


class ModelRepository:
    """The versions under `root`, loaded and batched; `get(name, version)` picks one."""

    def __init__(self, root: str | pathlib.Path, *, max_batch_size: int = 32, batch_timeout: float = 0.002,
                 poll_interval: float = 1.0):
        self.root = pathlib.Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"the model directory {self.root} does not exist; create it and export "
                                    "models into <name>/<version>/ inside it.")
        self.max_batch_size, self.batch_timeout = max_batch_size, batch_timeout
        self.poll_interval = poll_interval
        self._models: dict[str, dict[int, Version]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    def _load(self, name: str, number: int, path: pathlib.Path, fingerprint: tuple) -> Version:
        try:
            model = artifact.load(path)
            if len(model.manifest["inputs"]) != 1:
                raise artifact.ArtifactError(f"{path} takes {len(model.manifest['inputs'])} inputs; the "
                                             "server serves models with one input array.")
            spec = model.manifest["inputs"][0]
            batcher = DynamicBatcher(model, max_batch_size=self.max_batch_size,
                                     batch_timeout=self.batch_timeout)
            try:
                batcher.warm_up(np.zeros([d for d in spec["shape"][1:]], spec["dtype"]))
            except Exception:
                batcher.close()
                raise
        except Exception as error:  # any failure leaves this version FAILED and the others serving
            return Version(name, number, path, FAILED, fingerprint, error=f"{type(error).__name__}: {error}")
        return Version(name, number, path, AVAILABLE, fingerprint, model=model, batcher=batcher)

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
            batchers = [v.batcher for vs in self._models.values() for v in vs.values() if v.batcher]
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
            batchers = [v.batcher for vs in self._models.values() for v in vs.values() if v.batcher]
        for batcher in batchers:
            batcher.close()
