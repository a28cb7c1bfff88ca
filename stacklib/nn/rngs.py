"""Random streams: `Rngs` hands out fresh JAX keys on demand, reproducibly.

Mirrors `flax.nnx.Rngs` and `nnx.RngStream` (flax/nnx/rnglib.py, flax 0.12.8).

JAX has no global random state: every random function takes a key, and reusing a key
repeats the numbers. Threading keys through every constructor by hand is tedious, so
NNX keeps, per named stream ("params", "dropout", ...), a base key and a counter, and
derives the n-th key as

    key_n = jax.random.fold_in(base_key, n)

Calling `rngs.params()` returns `key_n` and increments the counter. The key and the
counter are Variables (`RngKey`, `RngCount`), so they are part of a module's state:
they are split out, carried through `jit`, and merged back like weights, which makes
dropout reproducible and checkpointable.

A stream that was not named falls back to `default`: `Rngs(0).params()` works.

Differences from flax.nnx: no `split`/`broadcast` of streams (for `vmap`ed
initialisation), no `reseed`, `fork_rngs`, `split_rngs` or `with_rngs`, and no random
helper methods such as `rngs.normal(shape)`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from stacklib.nn.module import Object
from stacklib.nn.variables import Variable


class RngState(Variable):
    """Random state; the filter that selects both keys and counters."""


class RngKey(RngState):
    """A stream's base key (a typed `jax.random.key`)."""


class RngCount(RngState):
    """How many keys a stream has handed out (uint32)."""


class RngStream(Object):
    """One named stream: a base key and a counter. Call it for the next key."""

    def __init__(self, key: jax.Array | int, *, tag: str):
        if isinstance(key, int):
            key = jax.random.key(key)
        elif isinstance(key, jax.Array) and key.dtype == jnp.uint32:
            key = jax.random.wrap_key_data(key)  # a raw uint32 key from jax.random.PRNGKey
        if not (isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)):
            raise TypeError(
                f"Stream {tag!r} needs an int seed or a key from jax.random.key(seed), got {key!r}."
            )
        self.tag = tag
        self.key = RngKey(key, tag=tag)
        self.count = RngCount(jnp.zeros(key.shape, dtype=jnp.uint32), tag=tag)

    def __call__(self) -> jax.Array:
        """The next key: `fold_in(base_key, count)`; then `count += 1`."""
        key = jax.random.fold_in(self.key[...], self.count[...])
        self.count[...] += 1
        return key

    def fork(self) -> RngStream:
        """A new, independent stream seeded by this stream's next key."""
        return type(self)(self(), tag=self.tag)


class Rngs(Object):
    """A set of named random streams: `Rngs(0)`, `Rngs(params=0, dropout=1)`.

    `rngs.params()` or `rngs["params"]()` returns the next key of the `params` stream;
    `rngs()` uses `default`. A stream that does not exist falls back to `default` if there
    is one.
    """

    def __init__(self, default: int | jax.Array | None = None, **rngs: int | jax.Array | RngStream):
        if default is not None:
            rngs["default"] = default
        for tag, key in rngs.items():
            if isinstance(key, RngStream):
                key = key.key[...]
            setattr(self, tag, RngStream(key, tag=tag))

    def _stream(self, name: str, error_type: type[Exception]) -> RngStream:
        streams = vars(self)
        if name in streams:
            return streams[name]
        if "default" in streams:
            return streams["default"]
        raise error_type(
            f"No RngStream named {name!r} in Rngs, and no 'default' stream to fall back on. "
            f"Create it: nnx.Rngs({name}=0), or nnx.Rngs(0) for a default stream."
        )

    def __getitem__(self, name: str) -> RngStream:
        return self._stream(name, KeyError)

    def __getattr__(self, name: str) -> RngStream:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return self._stream(name, AttributeError)

    def __call__(self) -> jax.Array:
        return self.default()

    def __iter__(self) -> Iterator[str]:
        return (name for name, value in vars(self).items() if isinstance(value, RngStream))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, name: Any) -> bool:
        return name in vars(self)

    def items(self) -> Iterator[tuple[str, RngStream]]:
        return ((name, vars(self)[name]) for name in self)

    def fork(self) -> Rngs:
        """New Rngs whose streams are forked from these (independent, reproducible)."""
        return Rngs(**{name: stream.fork() for name, stream in self.items()})
