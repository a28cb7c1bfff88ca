"""Flat run configurations: one YAML file per run, `key=value` overrides, every key checked first.

Mirrors the way MaxText (`MaxText/configs/base.yml`, read by `pyconfig`) and MaxDiffusion
(`src/maxdiffusion/configs/base_xl.yml`) configure a run: one flat file names every
setting, and the command line changes a few of them,

    python -m MaxText.train MaxText/configs/base.yml steps=300 per_device_batch_size=8

Every key and value is checked before anything is built: a key that does not exist (a
typo would otherwise silently train the default), a value of the wrong type, and, through
each config's `check()`, settings that cannot work together. Each error names the setting
and the fix.

A config is a frozen dataclass that subclasses `FlatConfig` and names its base file:

    @dataclasses.dataclass(frozen=True)
    class Config(FlatConfig):
        base_file = pathlib.Path("configs/base.yml")
        steps: int = 300
        learning_rate: float = 3e-3

        def check(self) -> None:
            if self.steps < 1:
                raise ConfigError(f"steps={self.steps} must be at least 1.")

    config = Config.load(None, "steps=10")          # the base file, then the overrides
    config = config.replace(learning_rate=1e-3)     # in code

Both `stacklib.llm.config` (chapter 12) and `stacklib.diffusion.config` (chapter 17) are
built on it, and both trainers save the config with every checkpoint. A checkpoint is bound
to the settings that decide what its weights mean (`weight_keys()`: shapes, vocabulary,
objective); `check_checkpoint` refuses to resume from one saved under other values, naming
each key, the checkpoint's value, the config's and the fix, where continuing would silently
train another model's weights.

Differences from MaxText's pyconfig: a field's type is its default's type (`int`, `float`,
`bool` or `str`); no derived keys, no YAML inheritance between files, no
environment-variable overrides.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, Self

import yaml


class ConfigError(ValueError):
    """A configuration key, value or combination that cannot work; the message says the fix."""


class CheckpointMismatchError(ConfigError):
    """A checkpoint was saved under settings that give its weights another meaning than the config's."""


class FlatConfig:
    """The behaviour of a frozen dataclass of flat settings; subclasses declare the fields.

    Each field's type is its default's type; an `int` given for a `float` field is promoted
    (`learning_rate: 1` means 1.0), and an `int` is not a `bool` (nor a `bool` an `int`).
    """

    base_file: ClassVar[pathlib.Path]
    """The YAML file `load(None)` reads: every setting with its default."""

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value, expected = getattr(self, field.name), type(field.default)
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, field.name, float(value))  # `learning_rate: 1` means 1.0
            elif not _is_type(value, expected):
                raise ConfigError(
                    f"{field.name}={value!r} has type {type(value).__name__}; it must be "
                    f"{expected.__name__} (default {field.default!r})."
                )
        self.check()

    def check(self) -> None:
        """Raise `ConfigError` for settings that are each fine but cannot work together."""

    def weight_keys(self) -> tuple[str, ...]:
        """The settings that decide what the weights mean (shapes, vocabulary, objective); default none.

        A checkpoint fits only a config with the same values: `check_checkpoint` refuses the rest.
        Settings of how the weights are trained or computed (learning rate, steps, remat) may change.
        """
        return ()

    def check_checkpoint(self, saved: Mapping[str, Any] | None, where: str) -> None:
        """Refuse a checkpoint whose saved config differs from this one in a `weight_keys()` setting.

        Args:
          saved: the config saved with the checkpoint (`to_dict()`), or None if it holds none.
          where: the checkpoint's directory, for the message.

        Raises:
          CheckpointMismatchError: naming each differing key, the checkpoint's value and the
            config's, and the overrides that fit; or that the checkpoint holds no config.
        """
        keys = self.weight_keys()
        if saved is None:
            raise CheckpointMismatchError(
                f"The checkpoint in {where} holds no config (it was written before runs saved theirs), so "
                f"nothing says what its weights mean ({', '.join(keys)}). Start a new run in another "
                "checkpoint_dir, or delete that checkpoint.")
        different = {key: (saved.get(key), getattr(self, key)) for key in keys
                     if saved.get(key) != getattr(self, key)}
        if different:
            rows = ", ".join(f"{key}: checkpoint {old!r} vs config {new!r}"
                             for key, (old, new) in different.items())
            fix = " ".join(f"{key}={old}" for key, (old, _) in different.items())
            raise CheckpointMismatchError(
                f"The checkpoint in {where} was written with other settings that decide what its weights "
                f"mean ({rows}); resuming would continue from another model's weights. Train with the "
                f"checkpoint's settings ({fix}), or start a new run in another checkpoint_dir.")

    def replace(self, **changes: Any) -> Self:
        """A copy with some settings changed (unknown names are refused, as in `load`)."""
        self._check_keys(changes)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every setting's name, in the order the dataclass declares them."""
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def _check_keys(cls, keys: Iterable[str]) -> None:
        valid = cls.keys()
        for key in keys:
            if key not in valid:
                close = difflib.get_close_matches(key, valid, n=3)
                hint = f" Did you mean {' or '.join(close)}?" if close else ""
                raise ConfigError(
                    f"Unknown config key {key!r}.{hint} Valid keys: {', '.join(valid)}."
                )

    @classmethod
    def _type(cls, key: str) -> type:
        return type(cls.__dataclass_fields__[key].default)

    @classmethod
    def _yaml_float(cls, key: str, value: Any) -> Any:
        """YAML 1.1 reads `1e-3` (no dot) as a string; a float setting takes it as the number."""
        if cls._type(key) is float and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        return value

    @classmethod
    def _parse_value(cls, key: str, text: str) -> Any:
        """A command-line value, read as YAML would read it (`true`, `3`, `0.1`, `dense`)."""
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ConfigError(f"{key}={text!r}: cannot read the value ({error}).") from None
        if value is None:
            value = ""  # `checkpoint_dir=` means the empty string
        if cls._type(key) is str and not isinstance(value, str):
            value = text  # `metrics_file=123` is a name, not a number
        return cls._yaml_float(key, value)

    @classmethod
    def parse_overrides(cls, overrides: Iterable[str]) -> dict[str, Any]:
        """`["steps=300", "remat=true"]` -> `{"steps": 300, "remat": True}`, keys checked."""
        parsed = {}
        for item in overrides:
            key, sep, text = item.partition("=")
            if not sep or not key:
                raise ConfigError(f"Override {item!r} is not of the form key=value, e.g. steps=300.")
            cls._check_keys([key])
            parsed[key] = cls._parse_value(key, text)
        return parsed

    @classmethod
    def load(cls, path: str | pathlib.Path | None = None, *overrides: str, **changes: Any) -> Self:
        """The config in the YAML file `path` (default: `base_file`), with overrides applied.

        Args:
          path: a flat YAML file of `key: value` lines; every key must be a field.
          *overrides: `"key=value"` strings, as on the command line; later ones win.
          **changes: the same, as Python values (`load(None, steps=10)`).

        Returns:
          A validated, frozen config.

        Raises:
          ConfigError: an unknown key (the message lists the valid ones), a value of the
            wrong type, or settings that cannot work together.
        """
        path = pathlib.Path(path) if path is not None else cls.base_file
        try:
            values = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"{path} is not valid YAML: {error}") from None
        if not isinstance(values, Mapping):
            raise ConfigError(f"{path} must hold flat `key: value` lines, got a {type(values).__name__}.")
        cls._check_keys(values)
        values = {key: "" if value is None else cls._yaml_float(key, value)  # `checkpoint_dir:` is ""
                  for key, value in values.items()}
        values.update(cls.parse_overrides(overrides))
        cls._check_keys(changes)
        values.update(changes)
        return cls(**values)

    @classmethod
    def from_command_line(cls, argv: Sequence[str], parser: argparse.ArgumentParser, example: str) -> Self:
        """The config `argv` (`[CONFIG.yml] key=value ...`) asks for; a mistake exits with status 2.

        Each mistake is one `parser.error` line naming the fix: an option (`--steps 20`:
        "write steps=20 instead"), no argument at all (a run needs a config file or an
        override, not a silent minutes-long default run), a missing file, or a `ConfigError`.

        Args:
          argv: the command line's arguments, without the program's name.
          parser: the program's parser; it prints `--help` and the errors.
          example: a whole command line, shown when there is nothing to train.
        """
        parser.parse_known_args(argv)  # --help prints the usage and exits
        items = list(argv)
        options = [index for index, item in enumerate(items) if item.startswith("-")]
        if options:
            option = items[options[0]]
            key, _, value = option.lstrip("-").replace("-", "_").partition("=")
            following = items[options[0] + 1:options[0] + 2]
            if not value and following and "=" not in following[0]:
                option, value = f"{option} {following[0]}", following[0]
            parser.error(f"settings are key=value, not options: write {key}={value or 'VALUE'} "
                         f"instead of {option}.")
        if not items:
            parser.error(f"nothing to train: give a config file and/or key=value overrides, e.g. {example}")
        path = items.pop(0) if "=" not in items[0] else None
        if path is not None and not pathlib.Path(path).is_file():
            parser.error(f"config file {path!r} not found (and it is not a key=value override). The base "
                         f"config is {cls.base_file}.")
        try:
            return cls.load(path, *items)
        except ConfigError as error:
            parser.error(str(error))


def _is_type(value: Any, expected: type) -> bool:
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)
