"""stacklib.diffusion: a class-conditional diffusion transformer, like MaxDiffusion, from the book's parts.

    python -m stacklib.diffusion.train stacklib/diffusion/configs/base.yml steps=300 objective=ddpm

    from stacklib import diffusion
    model, config = diffusion.pretrained("digits-flow")             # trained once, cached
    out = diffusion.sample(model, labels, key, method="euler", num_steps=20, guidance_scale=2.0)
    judge = diffusion.metrics.Judge.train()                          # chapter 02's classifier
    judge.accuracy(out.images, labels)

The pieces, one file each:
  schedules.py   β/ᾱ schedules (linear, scaled_linear, cosine), the forward process, timesteps
  model.py       DiT: patchify, timestep and class embeddings, adaLN-Zero blocks, unpatchify
  objectives.py  the losses: DDPM noise prediction and rectified flow (flow matching)
  samplers.py    DDPM ancestral, DDIM, Euler (flow); classifier-free guidance
  config.py      Config (one dataclass), configs/base.yml, key=value overrides, checks
  data.py        scikit-learn's 8×8 digits through a stacklib.data pipeline, held-out split
  train.py       the checkpointed training loop and its command line
  zoo.py         pretrained(name): train once per machine, cache under $STACKLIB_CACHE
  metrics.py     class accuracy and a Fréchet distance on the digits classifier's features

Layer 3 (beside llm, which it does not import): it uses nn, optim, data, checkpoint
(layer 1) and kernels (layer 2). Each file's docstring says how it differs from
MaxDiffusion and diffusers.
"""

from stacklib.diffusion import metrics, schedules
from stacklib.diffusion.config import Config, ConfigError, load_config
from stacklib.diffusion.model import DiT, DiTConfig, count_params
from stacklib.diffusion.samplers import Samples, sample


def pretrained(name: str = "digits-flow"):
    """`stacklib.diffusion.zoo.pretrained`: a trained model and its config, trained once and cached.

    Imported on first use, so that `python -m stacklib.diffusion.train` does not find its
    own module already imported by the package (runpy warns about that).
    """
    from stacklib.diffusion import zoo

    return zoo.pretrained(name)


__all__ = ["Config", "ConfigError", "DiT", "DiTConfig", "Samples", "count_params", "load_config", "metrics",
           "pretrained", "sample", "schedules"]
