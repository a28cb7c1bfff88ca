"""Autotuning with an on-disk cache: time each candidate config once, remember the fastest.

A blocked kernel has knobs — block sizes — whose best values depend on the shapes, the
dtype and the chip. Tokamax's answer (`tokamax/_src/ops/op.py`, `autotuning/`) is:

* for a *bound call* (the op, its shapes, dtypes and options), look the config up in a
  cache keyed by the device kind and that call;
* on a miss, do what the `autotuning_cache_miss_fallback` option says: `'heuristics'`
  (the default: a config computed from the shapes, no timing), `'autotune'` (time every
  candidate config and keep the fastest, storing it) or `'error'`;
* autotuning compiles each candidate, runs it a few times after a warm-up, and keeps
  the one with the lowest median time.

Here the same, small enough to read:

* `AutotuningCache(path)` — a JSON file of `{key: {"config": …, "times_ms": …}}`. The key
  (`cache_key`) holds the device kind, op, implementation, shapes, dtypes, options and
  the versions of stacklib and jax, so a result never leaks to another chip, shape or
  release. A file that cannot be read is reported with a warning and treated as empty;
  it is never fatal, and the next save replaces it.
* `Autotuner(clock=time.perf_counter, warmup=1, repeats=5)` — times candidates on random
  inputs of the call's shapes. The clock is a parameter so that tests can inject a fake
  one: the pick is then deterministic, and a cache hit can be shown to read it zero times.
* `get_config(implementation, call)` — the lookup-then-policy logic above.
* `using(cache=…, autotuner=…)` and `autotuning_cache_miss_fallback(policy)` — context
  managers that set these for a block of code; `pinned(config)` gives every tunable call
  in a block one config chosen by hand (chapter 12's model uses it for its `attention_block`).

Tuning happens when an op is *traced*, so a call under `jax.jit` or `jax.grad` is tuned
once, and the config it gets is baked into both the forward and the backward program.

Differences from tokamax: tokamax times with its own benchmarking module (and can time
the backward pass too); it ships pre-tuned cache files per device and keeps results in
memory unless you dump them; `tokamax.autotune(f, *args)` finds the ops to tune in `f`'s
HLO (which fails with jax 0.10.2). Our `autotune(f, *args)` traces `f` instead. We time
the forward pass only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import os
import pathlib
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stacklib.kernels.registry import BoundCall, Implementation

POLICIES = ("heuristics", "autotune", "error")


def _versions() -> dict[str, str]:
    return {"stacklib": importlib.metadata.version("stacklib"), "jax": jax.__version__}


def cache_key(implementation: str, call: BoundCall) -> str:
    """The cache key: device kind, op, implementation, shapes, dtypes, options, library versions."""
    key = {"device_kind": call.device_kind, "implementation": implementation, **call.describe(),
           "versions": _versions()}
    return json.dumps(key, sort_keys=True)


def default_cache_path() -> pathlib.Path:
    """$STACKLIB_AUTOTUNING_CACHE, else ~/.cache/stacklib/autotuning.json."""
    if path := os.environ.get("STACKLIB_AUTOTUNING_CACHE"):
        return pathlib.Path(path)
    return pathlib.Path.home() / ".cache" / "stacklib" / "autotuning.json"


class AutotuningCache:
    """Tuned configs on disk, read lazily on first use and written after each new result."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = pathlib.Path(path) if path is not None else default_cache_path()
        self._entries: dict[str, dict[str, Any]] | None = None

    @property
    def entries(self) -> dict[str, dict[str, Any]]:
        if self._entries is None:
            self._entries = self._load()
        return self._entries

    def _load(self) -> dict[str, dict[str, Any]]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or not all(isinstance(v, dict) and "config" in v
                                                     for v in data.values()):
                raise ValueError("expected an object of {key: {'config': ..., 'times_ms': ...}}")
        except (OSError, ValueError) as error:  # json.JSONDecodeError is a ValueError
            warnings.warn(f"the autotuning cache {self.path} cannot be read ({error}); ignoring it. "
                          f"It will be replaced on the next save; delete it to start afresh.",
                          RuntimeWarning, stacklevel=4)
            return {}
        return data

    def get(self, key: str) -> dict[str, Any] | None:
        return self.entries.get(key)

    def put(self, key: str, config: Any, times_s: dict[Any, float]) -> None:
        """Store a result and write the file (atomically: a crash leaves the old file)."""
        times_ms = {json.dumps(dataclasses.asdict(c)): t * 1e3 for c, t in times_s.items()}
        self.entries[key] = {"config": dataclasses.asdict(config), "times_ms": times_ms}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as file:
            json.dump(self.entries, file, indent=1, sort_keys=True)
        os.replace(file.name, self.path)

    def __len__(self) -> int:
        return len(self.entries)


def example_arguments(call: BoundCall, seed: int = 0) -> list[np.ndarray | None]:
    """Random arrays of the call's shapes and dtypes: floats ~ N(0, 1), masks all True, ints 1.

    NumPy arrays, not JAX ones: tuning runs while an op is being traced, where a JAX
    operation would be staged into the caller's program instead of being computed.
    """
    rng = np.random.default_rng(seed)
    args = []
    for _, spec in call.arrays:
        if spec is None:
            args.append(None)
        elif jnp.issubdtype(spec.dtype, jnp.floating):
            args.append(rng.standard_normal(spec.shape, np.float32).astype(spec.dtype))
        else:
            args.append(np.ones(spec.shape, spec.dtype))
    return args


@dataclasses.dataclass
class Autotuner:
    """Times candidate configs of a call and keeps the fastest (lowest median).

    Attributes:
      clock: returns seconds; read once before and once after each timed run (warm-up
        runs are not timed). Inject a fake clock to make tests deterministic.
      warmup: untimed runs per candidate (the first run may include one-off costs).
      repeats: timed runs per candidate; the median is kept.
    """

    clock: Callable[[], float] = time.perf_counter
    warmup: int = 1
    repeats: int = 5

    def time_configs(self, implementation: Implementation, call: BoundCall,
                     configs: list[Any] | None = None) -> dict[Any, float]:
        """Median seconds per config; configs that fail to compile or run are left out.

        Raises:
          RuntimeError: every candidate failed (the message lists why).
        """
        configs = implementation.candidate_configs(call) if configs is None else configs
        static = dict(call.static)
        times, failures = {}, {}
        args = example_arguments(call)
        for config in configs:
            try:
                # A compiled executable runs now even while the caller is being traced.
                run = jax.jit(lambda *a, config=config: implementation.run(*a, config=config, **static))
                compiled = run.lower(*args).compile()
                for _ in range(self.warmup):
                    jax.block_until_ready(compiled(*args))
                samples = []
                for _ in range(self.repeats):
                    start = self.clock()
                    jax.block_until_ready(compiled(*args))
                    samples.append(self.clock() - start)
            except Exception as error:  # a config that does not fit is a result, not a crash
                failures[config] = f"{type(error).__name__}: {error}"
                continue
            times[config] = statistics.median(samples)
        if not times:
            raise RuntimeError(f"autotuning {implementation.name!r}: every candidate failed: {failures}")
        return times


@dataclasses.dataclass
class _State:
    cache: AutotuningCache | None = None  # None: the default file, opened on first use
    autotuner: Autotuner = dataclasses.field(default_factory=Autotuner)
    policy: str = "heuristics"
    pinned: Any = None  # a config every tunable call uses, cache or not


_STATE = _State()


def current_cache() -> AutotuningCache:
    if _STATE.cache is None:
        _STATE.cache = AutotuningCache()
    return _STATE.cache


@contextlib.contextmanager
def using(cache: AutotuningCache | None = None, autotuner: Autotuner | None = None) -> Iterator[None]:
    """Use this cache and/or autotuner inside the `with` block."""
    previous = (_STATE.cache, _STATE.autotuner)
    _STATE.cache = cache if cache is not None else _STATE.cache
    _STATE.autotuner = autotuner if autotuner is not None else _STATE.autotuner
    try:
        yield
    finally:
        _STATE.cache, _STATE.autotuner = previous


@contextlib.contextmanager
def autotuning_cache_miss_fallback(policy: str) -> Iterator[None]:
    """What a cache miss does inside the `with` block: 'heuristics', 'autotune' or 'error'.

    Mirrors `tokamax.config.autotuning_cache_miss_fallback`.
    """
    if policy not in POLICIES:
        raise ValueError(f"autotuning_cache_miss_fallback must be one of {POLICIES}, got {policy!r}.")
    previous, _STATE.policy = _STATE.policy, policy
    try:
        yield
    finally:
        _STATE.policy = previous


@contextlib.contextmanager
def pinned(config: Any) -> Iterator[None]:
    """Every tunable call traced inside the `with` block uses `config`, not the cache or the policy.

    Tokamax gets the same effect by giving an op object its config
    (`DotProductAttention(config=...)`); a hand-picked tile is for experiments (chapter 12
    pins one to count the FLOPs of causal block skipping), the cache for production.
    """
    previous, _STATE.pinned = _STATE.pinned, config
    try:
        yield
    finally:
        _STATE.pinned = previous


class AutotuningCacheMiss(LookupError):
    """Policy 'error': no tuned config is cached for this call."""


def get_config(implementation: Implementation, call: BoundCall) -> Any:
    """The config for this call: cached if tuned before, else what the policy says.

    Raises:
      AutotuningCacheMiss: a miss under policy 'error'.
    """
    if not implementation.tunable:
        return None
    if _STATE.pinned is not None:
        return _STATE.pinned
    cache, key = current_cache(), cache_key(implementation.name, call)
    if (entry := cache.get(key)) is not None:
        return type(implementation.heuristic_config(call))(**entry["config"])
    if _STATE.policy == "heuristics":
        return implementation.heuristic_config(call)
    if _STATE.policy == "error":
        raise AutotuningCacheMiss(
            f"no tuned config for {implementation.name!r} in {cache.path} for this call: {call.describe()}. "
            f"Tune it once inside `with autotuning_cache_miss_fallback('autotune'):`, or use 'heuristics'.")
    times = _STATE.autotuner.time_configs(implementation, call)
    best = min(times, key=times.get)
    cache.put(key, best, times)
    return best


def autotune(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Tune every stacklib.kernels op that `fn(*args, **kwargs)` calls, and cache the results.

    `fn` is traced (not run) with the policy set to 'autotune', so each op call inside it
    is tuned for its shapes unless the cache already has it. Mirrors `tokamax.autotune`,
    which finds the ops in `fn`'s compiled HLO instead.
    """
    with autotuning_cache_miss_fallback("autotune"):
        jax.eval_shape(fn, *args, **kwargs)
