"""`EngineConfig`: every setting of the engine, in one place, for `LLMEngine`, `LLM` and the server.

    llm = LLM("stdlib-bytes", max_num_seqs=8, block_size=4)          # keyword arguments ...
    engine = LLMEngine(model, config=EngineConfig(max_num_seqs=8))    # ... are an EngineConfig
    python -m stacklib.infer.serve --max-num-seqs 8 --quantization int8   # so are the flags

The command line's flags are made from the fields (`add_cli_args`), with the same names,
defaults and help, so a setting is declared once: its name, type, default, what it means and
what values it accepts. Settings that depend on the model (`max_model_len` defaults to its
`max_seq_len`) are resolved by `resolve(max_seq_len)`, which also sizes the cache.

Mirrors `vllm.EngineArgs` (`add_cli_args`, `from_cli_args`, one dataclass behind `LLM(**kwargs)`
and `vllm serve`). Differences: one flat dataclass (vLLM splits the resolved settings into
`VllmConfig`'s model, cache, scheduler and parallel configs); `quantization` names weight-only
PTQ with our `stacklib.quant` ('int8', 'int4'), not a checkpoint format.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

QUANTIZATIONS = ("int8", "int4")

# What each setting means, for the docstrings' readers and the command line's --help.
HELP = {
    "max_model_len": "the longest prompt + output (default: the model's max_seq_len)",
    "max_num_seqs": "the most sequences decoded in one step",
    "max_num_batched_tokens": "the most tokens one step may run; a longer prompt is pre-filled in chunks "
                              "(default: max(max_model_len, 512, max_num_seqs)); at least max_num_seqs",
    "block_size": "token slots per KV-cache block",
    "num_gpu_blocks_override": "the KV cache's size in blocks (default: max_num_seqs full sequences)",
    "enable_prefix_caching": "share full prompt blocks between requests",
    "quantization": "quantize the weights, per output channel, with stacklib.quant: int8 or int4",
    "seed": "seeds the requests that give no seed of their own",
}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's settings; see `HELP` for each one. Checked when made.

    Raises:
      ValueError: a setting of the wrong type or out of range; the message names it.
    """

    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    quantization: str | None = None
    seed: int = 0

    def __post_init__(self):
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "num_gpu_blocks_override"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive integer ({HELP[name]}).")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            # Every running sequence needs at least one token of a step's budget; with fewer, the
            # sequences at the back of the batch would wait step after step (vLLM refuses it too).
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                             f"max_num_seqs={self.max_num_seqs}: a step could not give every running "
                             f"sequence its next token. Use max_num_batched_tokens>={self.max_num_seqs} "
                             "or lower max_num_seqs.")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization={self.quantization!r} is not one of {', '.join(QUANTIZATIONS)}; "
                             "leave it None for float weights.")

    def resolve(self, max_seq_len: int) -> EngineConfig:
        """This config with the model's defaults filled in: max_model_len, max_num_batched_tokens,
        and the cache's size in blocks (num_gpu_blocks_override: max_num_seqs full sequences + the
        null block).

        Raises:
          ValueError: the settings cannot work with this model; the message says the fix.
        """
        max_model_len = self.max_model_len or max_seq_len
        if max_model_len > max_seq_len:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_seq_len={max_seq_len}; "
                             f"use max_model_len<={max_seq_len}.")
        # A longer prompt is chunked; the budget always holds one token per running sequence.
        batched = self.max_num_batched_tokens or max(max_model_len, 512, self.max_num_seqs)
        blocks_per_seq = -(-max_model_len // self.block_size)
        num_blocks = self.num_gpu_blocks_override or self.max_num_seqs * blocks_per_seq + 1
        if num_blocks - 1 < blocks_per_seq:
            raise ValueError(f"num_gpu_blocks_override={num_blocks} cannot hold one sequence of "
                             f"max_model_len={max_model_len} ({blocks_per_seq} blocks of {self.block_size} "
                             f"plus the null block); use at least {blocks_per_seq + 1}.")
        return dataclasses.replace(self, max_model_len=max_model_len, max_num_batched_tokens=batched,
                                   num_gpu_blocks_override=num_blocks)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add a flag per setting: `--max-num-seqs 8`, `--no-enable-prefix-caching`, `--quantization int8`."""
        for field in dataclasses.fields(EngineConfig):
            flag = "--" + field.name.replace("_", "-")
            if field.default is True:
                parser.add_argument(f"--no-{flag[2:]}", dest=field.name, action="store_false",
                                    help=f"do not {HELP[field.name]}")
            elif field.name == "quantization":
                parser.add_argument(flag, choices=QUANTIZATIONS, default=None, help=HELP[field.name])
            else:
                shown = "" if field.default is None else " (default: %(default)s)"  # else HELP says it
                parser.add_argument(flag, type=int, default=field.default, help=HELP[field.name] + shown)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        """The config of the flags `add_cli_args` added, as parsed."""
        return cls(**{field.name: getattr(args, field.name) for field in dataclasses.fields(cls)})

    @classmethod
    def from_kwargs(cls, **settings: Any) -> EngineConfig:
        """`EngineConfig(**settings)`, with an unknown name refused by listing the known ones."""
        known = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise TypeError(f"Unknown engine setting(s) {', '.join(unknown)}; the settings are "
                            f"{', '.join(known)}.")
        return cls(**settings)
