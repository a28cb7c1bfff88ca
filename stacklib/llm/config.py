"""One configuration for a training run: a dataclass, a YAML base file, `key=value` overrides.

Mirrors MaxText's configuration (`MaxText/configs/base.yml` plus command-line overrides,
`python -m MaxText.train MaxText/configs/base.yml steps=300 per_device_batch_size=8`):
one flat file names every setting, and a run changes a few of them on the command line.

    config = load_config("stacklib/llm/configs/base.yml", "steps=300", "d_model=128")
    config = config.replace(n_layers=2)      # in code, a frozen dataclass

What MaxText's pyconfig checks, this module checks too, before anything is built: a key
that does not exist (a typo would otherwise silently train the default), a value of the
wrong type, and settings that cannot work together (heads that do not divide the mesh, a
sequence longer than the model's maximum). Each error names the setting and the fix.
The reading and the per-key checks are `stacklib.flat_config`'s (shared with chapter 17's
diffusion config); this module holds the settings and the checks across them.

Differences from MaxText: a single dataclass with ~40 keys instead of several hundred;
no derived "base_" scaling keys, no per-model YAML inheritance (`model_name=`), no
environment-variable overrides; the global batch is `batch_size`, not
`per_device_batch_size` times the device count.
"""

from __future__ import annotations

import dataclasses
import pathlib
import typing

from stacklib.flat_config import ConfigError, FlatConfig

BASE_CONFIG = pathlib.Path(__file__).parent / "configs" / "base.yml"

# RoPE frequency scalings: none, or Llama 3.1's (chapter 18).
ROPE_SCALINGS = ("none", "llama3")

# "auto", or one implementation of stacklib.kernels.ATTENTION (chapter 10) by name.
ATTENTION_CHOICES = ("auto", "xla", "xla_chunked", "pallas", "cudnn")


@dataclasses.dataclass(frozen=True)
class Config(FlatConfig):
    """Every setting of a run; see `configs/base.yml` for what each one means."""

    base_file = BASE_CONFIG

    # Model
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    d_ff: int = 384
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qk_norm: bool = False
    rope_scaling: str = "none"
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    attention: str = "auto"
    attention_block: int = 0
    remat: bool = False
    # Data
    seq_len: int = 128
    batch_size: int = 16
    heldout_percent: int = 5
    max_corpus_bytes: int = 0
    data_seed: int = 0
    # Optimizer
    steps: int = 300
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    end_learning_rate_fraction: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0
    seed: int = 0
    # Mesh
    data_parallelism: int = 1
    fsdp_parallelism: int = 1
    tensor_parallelism: int = 1
    pipeline_parallelism: int = 1
    num_pipeline_microbatches: int = 0
    # Checkpoints and logs
    checkpoint_dir: str = ""
    checkpoint_every: int = 100
    local_checkpoint_dir: str = ""
    local_checkpoint_every: int = 10
    max_to_keep: int = 2
    async_checkpointing: bool = True
    metrics_file: str = ""
    eval_every: int = 0
    eval_batches: int = 4
    peak_flops: float = 0.0
    progress: bool = True

    def check(self) -> None:
        _check(self)

    def weight_keys(self) -> tuple[str, ...]:
        """`MODEL_KEYS` and `OPEN_MODEL_KEYS`: a checkpoint resumes only under the same values."""
        return MODEL_KEYS + OPEN_MODEL_KEYS

    def check_checkpoint(self, saved, where: str) -> None:
        """`FlatConfig.check_checkpoint`, reading an absent `OPEN_MODEL_KEYS` setting as its default.

        A checkpoint saved before those settings existed was a model without them, which
        is what their defaults mean.
        """
        if saved is not None:
            saved = {**{key: _DEFAULTS[key] for key in OPEN_MODEL_KEYS}, **saved}
        super().check_checkpoint(saved, where)

    def to_dict(self) -> dict:
        """Every setting, except the `OPEN_MODEL_KEYS` left at their defaults.

        So the config saved with a checkpoint of the book's own models reads (and hashes)
        as it did before chapter 18 added those settings; `load(**saved)` fills them in.
        """
        return {key: value for key, value in super().to_dict().items()
                if key not in OPEN_MODEL_KEYS or value != _DEFAULTS[key]}

    @property
    def rope_scaling_params(self) -> RopeScaling | None:
        """Llama 3's RoPE frequency scaling as one value (None without scaling), for `model.rope_angles`."""
        if self.rope_scaling == "none":
            return None
        return RopeScaling(self.rope_scaling_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                           self.rope_original_max_len)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """(data, fsdp, tensor): the device mesh this config trains on; (pipeline, data, fsdp, tensor)
        when pipeline_parallelism > 1."""
        shape = (self.data_parallelism, self.fsdp_parallelism, self.tensor_parallelism)
        return shape if self.pipeline_parallelism == 1 else (self.pipeline_parallelism, *shape)

    @property
    def num_microbatches(self) -> int:
        """The microbatches a pipelined step cuts the batch into (0 in the config: one per stage)."""
        return self.num_pipeline_microbatches or self.pipeline_parallelism


MODEL_KEYS = (
    "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
    "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings",
)
"""The settings that decide the parameters' shapes and meaning: a checkpoint fits only a
model with the same values. (`attention`, `remat` change how it is computed, not what.)"""

OPEN_MODEL_KEYS = (
    "qk_norm", "rope_scaling", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
    "rope_original_max_len",
)
"""What open-weight families add to the book's architecture (chapter 18: Qwen3's RMSNorm on
queries and keys, Llama 3's RoPE frequency scaling). They decide what the weights mean too,
and are off by default, so the book's own models are the architecture they always were."""

_DEFAULTS = {field.name: field.default for field in dataclasses.fields(Config)}


class RopeScaling(typing.NamedTuple):
    """Llama 3.1's RoPE frequency scaling (Hugging Face's `rope_scaling` with `rope_type: llama3`).

    Wavelengths shorter than `original_max_len / high_freq_factor` keep their frequency, those
    longer than `original_max_len / low_freq_factor` are slowed by `factor`, and the ones
    between are interpolated; see `stacklib.llm.model.rope_frequencies`.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_len: int


def _check(c: Config) -> None:
    """Settings that are each fine but cannot work together."""
    positive = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                "max_seq_len", "seq_len", "batch_size", "steps",
                "data_parallelism", "fsdp_parallelism", "tensor_parallelism", "pipeline_parallelism",
                "checkpoint_every",
                "local_checkpoint_every", "max_to_keep")
    for name in positive:
        if getattr(c, name) < 1:
            raise ConfigError(f"{name}={getattr(c, name)} must be at least 1.")
    if c.attention not in ATTENTION_CHOICES:
        raise ConfigError(f"attention={c.attention!r} is not one of {', '.join(ATTENTION_CHOICES)}.")
    if c.rope_scaling not in ROPE_SCALINGS:
        raise ConfigError(f"rope_scaling={c.rope_scaling!r} is not one of {', '.join(ROPE_SCALINGS)}.")
    if c.rope_scaling == "llama3":
        _check_rope_scaling(c)
    if c.head_dim % 2:
        raise ConfigError(f"head_dim={c.head_dim} must be even: RoPE rotates pairs of features.")
    if c.n_heads % c.n_kv_heads:
        raise ConfigError(
            f"n_heads={c.n_heads} is not a multiple of n_kv_heads={c.n_kv_heads}: in grouped-query "
            "attention each key/value head serves the same number of query heads. Choose n_kv_heads "
            f"among {[k for k in range(1, c.n_heads + 1) if c.n_heads % k == 0]}."
        )
    if c.seq_len > c.max_seq_len:
        raise ConfigError(
            f"seq_len={c.seq_len} is longer than the model's max_seq_len={c.max_seq_len}. "
            f"Set seq_len<={c.max_seq_len}, or max_seq_len>={c.seq_len} (a new model)."
        )
    if c.attention_block < 0:
        raise ConfigError(f"attention_block={c.attention_block} must be >= 0 (0: the autotuning cache, "
                          "else the kernel library's heuristic).")
    if c.local_checkpoint_dir:
        _check_local_tier(c)
    if c.eval_batches < 0 or c.eval_every < 0:
        raise ConfigError(f"eval_batches={c.eval_batches} and eval_every={c.eval_every} must be >= 0.")
    if not 0 <= c.heldout_percent < 100:
        raise ConfigError(f"heldout_percent={c.heldout_percent} must be in [0, 100).")
    batch_shards = c.data_parallelism * c.fsdp_parallelism
    if c.batch_size % batch_shards:
        raise ConfigError(
            f"batch_size={c.batch_size} does not divide over data_parallelism * fsdp_parallelism = "
            f"{c.data_parallelism} * {c.fsdp_parallelism} = {batch_shards} devices. Make batch_size "
            f"a multiple of {batch_shards} (e.g. {batch_shards * max(1, c.batch_size // batch_shards)})."
        )
    for name in ("n_heads", "n_kv_heads", "d_ff", "vocab_size"):
        if getattr(c, name) % c.tensor_parallelism:
            raise ConfigError(
                f"{name}={getattr(c, name)} does not divide over tensor_parallelism="
                f"{c.tensor_parallelism}: tensor parallelism gives each device whole heads and equal "
                f"shares of the MLP and the vocabulary. Choose tensor_parallelism dividing {name}."
            )
    if c.d_model % c.fsdp_parallelism:
        raise ConfigError(
            f"d_model={c.d_model} does not divide over fsdp_parallelism={c.fsdp_parallelism}: FSDP "
            "splits every weight along its d_model axis. Choose fsdp_parallelism dividing d_model."
        )
    if c.num_pipeline_microbatches < 0:
        raise ConfigError(f"num_pipeline_microbatches={c.num_pipeline_microbatches} must be >= 0 "
                          "(0: one microbatch per pipeline stage).")
    if c.pipeline_parallelism > 1:
        _check_pipeline(c)


def _check_rope_scaling(c: Config) -> None:
    """Llama 3's scaling: slow the low frequencies (factor >= 1), between two distinct wavelengths."""
    if c.rope_scaling_factor < 1 or c.rope_original_max_len < 1:
        raise ConfigError(f"rope_scaling_factor={c.rope_scaling_factor} must be >= 1 and "
                          f"rope_original_max_len={c.rope_original_max_len} >= 1 (Llama 3.1: 8.0 and 8192).")
    if not 0 < c.rope_low_freq_factor < c.rope_high_freq_factor:
        raise ConfigError(
            f"rope_low_freq_factor={c.rope_low_freq_factor} must be positive and below rope_high_freq_factor="
            f"{c.rope_high_freq_factor}: the scaling interpolates between those two wavelengths "
            "(Llama 3.1: 1.0 and 4.0).")


def _check_pipeline(c: Config) -> None:
    """A pipeline (pipeline.py): equal stages of whole layers, equal microbatches from every data shard."""
    p = c.pipeline_parallelism
    if c.n_layers % p:
        raise ConfigError(
            f"n_layers={c.n_layers} does not split into pipeline_parallelism={p} equal stages: each stage "
            "runs n_layers / pipeline_parallelism consecutive layers. Choose pipeline_parallelism among "
            f"{[k for k in range(1, c.n_layers + 1) if c.n_layers % k == 0]}, or n_layers a multiple of {p}."
        )
    shards = c.data_parallelism * c.fsdp_parallelism
    rows, m = c.batch_size // shards, c.num_microbatches
    if rows % m:
        implied = " (0 means one per stage)" if c.num_pipeline_microbatches == 0 else ""
        divisors = [k for k in range(1, rows + 1) if rows % k == 0]
        raise ConfigError(
            f"num_pipeline_microbatches={c.num_pipeline_microbatches}{implied} gives {m} microbatches, which "
            f"do not divide the {rows} rows of each data shard (batch_size={c.batch_size} over "
            f"data_parallelism * fsdp_parallelism = {shards}): every microbatch takes the same rows from "
            f"every shard. Choose num_pipeline_microbatches among {divisors}, or batch_size="
            f"{shards * m * max(1, rows // m)}."
        )


def _check_local_tier(c: Config) -> None:
    """A local tier (chapter 05's two-tier manager) next to `checkpoint_dir`, on its own schedule."""
    if not c.checkpoint_dir:
        raise ConfigError(
            f"local_checkpoint_dir={c.local_checkpoint_dir!r} needs checkpoint_dir: the local tier is lost "
            "with the machine, so it only adds to a persistent one. Set checkpoint_dir too, or "
            "local_checkpoint_dir= (empty) for no local tier."
        )
    if c.checkpoint_every % c.local_checkpoint_every:
        below = c.checkpoint_every // c.local_checkpoint_every * c.local_checkpoint_every
        nearest = " or ".join(f"checkpoint_every={k}" for k in (below, below + c.local_checkpoint_every) if k)
        raise ConfigError(
            f"checkpoint_every={c.checkpoint_every} is not a multiple of local_checkpoint_every="
            f"{c.local_checkpoint_every}: every persistent checkpoint must also be a local step. Use "
            f"{nearest}, or a local_checkpoint_every that divides {c.checkpoint_every}."
        )
    local, persistent = (pathlib.Path(d).resolve() for d in (c.local_checkpoint_dir, c.checkpoint_dir))
    if local == persistent or local.is_relative_to(persistent) or persistent.is_relative_to(local):
        raise ConfigError(
            f"local_checkpoint_dir={c.local_checkpoint_dir!r} and checkpoint_dir={c.checkpoint_dir!r} must "
            "be separate folders, neither inside the other: the persistent tier must survive losing the "
            "local one. Put the local tier on the machine (e.g. local_checkpoint_dir=/dev/shm/run)."
        )


parse_overrides = Config.parse_overrides
"""`["steps=300", "remat=true"]` -> `{"steps": 300, "remat": True}`, keys checked."""

load_config = Config.load
"""`load_config(path=None, *overrides, **changes)`: the YAML file `path` (default: the base
file) read into a validated `Config`, `"key=value"` overrides applied; see `FlatConfig.load`."""
