"""One configuration for a diffusion training run: a dataclass, a YAML base file, overrides.

Mirrors MaxDiffusion's configuration (`src/maxdiffusion/configs/base_xl.yml` and friends
plus `key=value` overrides on the command line of `python -m src.maxdiffusion.train
CONFIG key=value`) and chapter 12's `stacklib.llm.config`, which mirrors MaxText's: one flat
file names every setting, a run changes a few of them.

    config = load_config(None, "steps=300", "objective=ddpm")     # configs/base.yml + overrides
    config = config.replace(d_model=64)

Every key is checked before anything is built: an unknown key (with the closest valid
ones), a value of the wrong type, and settings that cannot work together. Each error
names the setting and the fix.
The reading and the per-key checks are `stacklib.flat_config`'s (shared with chapter 12's
config); this module holds the settings and the checks across them.

Differences from MaxDiffusion: ~30 keys instead of hundreds; no pretrained model path, no
text encoder, VAE or resolution buckets (we train a class-conditional DiT on pixels); no
mesh keys (the model is small enough for one device; chapter 12 shows the sharded loop).
"""

from __future__ import annotations

import dataclasses
import pathlib

from stacklib.diffusion.model import DiTConfig
from stacklib.diffusion.objectives import OBJECTIVES
from stacklib.diffusion.schedules import BETA_SCHEDULES
from stacklib.flat_config import ConfigError, FlatConfig

BASE_CONFIG = pathlib.Path(__file__).parent / "configs" / "base.yml"


@dataclasses.dataclass(frozen=True)
class Config(FlatConfig):
    """Every setting of a run; `configs/base.yml` says what each one means."""

    base_file = BASE_CONFIG

    image_size: int = 8
    patch_size: int = 2
    d_model: int = 32
    n_layers: int = 3
    n_heads: int = 4
    mlp_ratio: int = 4
    frequency_dim: int = 64
    objective: str = "flow"
    num_train_timesteps: int = 1000
    beta_schedule: str = "squaredcos_cap_v2"
    beta_start: float = 1e-4
    beta_end: float = 0.02
    label_dropout: float = 0.1
    batch_size: int = 64
    heldout_every: int = 6
    data_seed: int = 0
    steps: int = 1500
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    end_learning_rate_fraction: float = 0.05
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    seed: int = 0
    checkpoint_dir: str = ""
    checkpoint_every: int = 500
    max_to_keep: int = 2
    log_every: int = 100
    progress: bool = True

    def check(self) -> None:
        _check(self)

    @property
    def model(self) -> DiTConfig:
        """The model part: what a checkpoint's shapes depend on, and what its output predicts."""
        return DiTConfig(image_size=self.image_size, patch_size=self.patch_size, d_model=self.d_model,
                         n_layers=self.n_layers, n_heads=self.n_heads, mlp_ratio=self.mlp_ratio,
                         frequency_dim=self.frequency_dim, objective=self.objective)

    def weight_keys(self) -> tuple[str, ...]:
        """The settings a checkpoint is bound to (`FlatConfig.check_checkpoint`): the DiT's shapes,
        the objective, and for noise prediction the schedule (it decides what noise level t means)."""
        return MODEL_KEYS + (SCHEDULE_KEYS if self.objective == "ddpm" else ())


MODEL_KEYS = ("image_size", "patch_size", "d_model", "n_layers", "n_heads", "mlp_ratio", "frequency_dim",
              "objective")
"""The settings of `Config.model`: a checkpoint's shapes, and whether it predicts ε or v."""

SCHEDULE_KEYS = ("num_train_timesteps", "beta_schedule", "beta_start", "beta_end")
"""The noise schedule an ε-prediction model was trained on: the noise level its input t stands for."""


def _check(c: Config) -> None:
    """Settings that are each fine but cannot work together."""
    for name in ("image_size", "patch_size", "d_model", "n_layers", "n_heads", "mlp_ratio", "batch_size",
                 "steps", "heldout_every", "checkpoint_every", "max_to_keep", "log_every",
                 "num_train_timesteps"):
        if getattr(c, name) < 1:
            raise ConfigError(f"{name}={getattr(c, name)} must be at least 1.")
    if c.objective not in OBJECTIVES:
        raise ConfigError(f"objective={c.objective!r} is not one of {', '.join(OBJECTIVES)}.")
    if c.beta_schedule not in BETA_SCHEDULES:
        raise ConfigError(f"beta_schedule={c.beta_schedule!r} is not one of {', '.join(BETA_SCHEDULES)}.")
    if not 0.0 <= c.label_dropout < 1.0:
        raise ConfigError(f"label_dropout={c.label_dropout} must be in [0, 1): the share of labels dropped "
                          "for classifier-free guidance (0 trains no unconditional model).")
    if c.image_size != 8:
        raise ConfigError(f"image_size={c.image_size}: the digits are 8x8 images; keep image_size=8.")
    try:
        DiTConfig(image_size=c.image_size, patch_size=c.patch_size, d_model=c.d_model, n_heads=c.n_heads)
    except ValueError as error:
        raise ConfigError(str(error)) from None


parse_overrides = Config.parse_overrides
"""`["steps=300", "objective=ddpm"]` -> `{"steps": 300, "objective": "ddpm"}`, keys checked."""

load_config = Config.load
"""`load_config(path=None, *overrides, **changes)`: the YAML file `path` (default: configs/base.yml)
read into a validated `Config`, `"key=value"` overrides applied; see `FlatConfig.load`."""
