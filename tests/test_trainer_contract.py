"""Two trainers, one contract: chapter 12's `stacklib.llm.train` and chapter 17's `stacklib.diffusion.train`.

- `stop_after=n` is a kill after step n of the run; the next call resumes from the last
  checkpoint, and a run killed and resumed ends with the uninterrupted run's weights;
- the last step is saved, whatever `checkpoint_every` says;
- a checkpoint is bound to the settings that decide what its weights mean (shapes, vocabulary,
  objective): a config that changes one is refused before any step, naming the key, both
  values and the fix; other settings (steps, learning rate, seed) may change on resume;
- on the command line such a refusal is one line on stderr and exit status 2.

Every test runs on both trainers with tiny configs (a few seconds each).
"""

import dataclasses
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax
import numpy as np
import pytest

import stacklib.checkpoint as ocp
from stacklib import diffusion, llm
from stacklib.diffusion import train as diffusion_train
from stacklib.flat_config import CheckpointMismatchError
from stacklib.llm import train as llm_train

STEPS, EVERY = 6, 4  # checkpoints at 4 (the interval) and 6 (the last step, saved whatever the interval)


@dataclasses.dataclass(frozen=True)
class Trainer:
    """A trainer as the contract sees it: its module, a tiny config, settings bound to a checkpoint."""

    name: str
    module: ModuleType  # train(config, *, stop_after=None) and main(argv)
    load_config: Callable[..., Any]
    tiny: dict[str, Any]
    bound: tuple[tuple[str, Any], ...]  # (key, another value) that changes what the weights mean

    def config(self, directory, **changes):
        return self.load_config(None, **{**self.tiny, "checkpoint_dir": str(directory), **changes})

    def argv(self, directory, **changes) -> list[str]:
        settings = {**self.tiny, "checkpoint_dir": str(directory), **changes}
        return [f"{key}={str(value).lower() if isinstance(value, bool) else value}"
                for key, value in settings.items()]


TRAINERS = [
    Trainer("llm", llm_train, llm.load_config,
            dict(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=32,
                 seq_len=32, batch_size=8, steps=STEPS, warmup_steps=2, max_corpus_bytes=200_000,
                 eval_batches=0, progress=False, peak_flops=1e11, checkpoint_every=EVERY, max_to_keep=3),
            (("d_model", 64), ("vocab_size", 512))),
    Trainer("diffusion", diffusion_train, diffusion.load_config,
            dict(d_model=16, n_layers=1, n_heads=2, batch_size=16, steps=STEPS, warmup_steps=2, log_every=2,
                 progress=False, checkpoint_every=EVERY, max_to_keep=3),
            (("objective", "ddpm"), ("d_model", 32))),
]


def saved_steps(directory) -> list[int]:
    return ocp.CheckpointManager(directory).all_steps()


def assert_same_weights(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module", params=TRAINERS, ids=lambda trainer: trainer.name)
def trainer(request) -> Trainer:
    return request.param


@pytest.fixture(scope="module")
def finished(trainer, tmp_path_factory):
    """(directory, result) of a whole run of the tiny config; no test trains further in it."""
    directory = tmp_path_factory.mktemp(f"{trainer.name}-finished")
    return directory, trainer.module.train(trainer.config(directory))


def test_stop_after_n_kills_the_run_after_its_step_n_and_the_next_call_resumes_from_the_last_checkpoint(
        trainer, finished, tmp_path):
    config = trainer.config(tmp_path)
    killed = trainer.module.train(config, stop_after=5)  # step 4 is saved, step 5 is lost
    assert killed.start_step == 0 and saved_steps(tmp_path)[-1] == 4
    again = trainer.module.train(config, stop_after=5)  # from 4, killed after 5 again: n is the run's step
    assert again.start_step == 4 and saved_steps(tmp_path)[-1] == 4
    resumed = trainer.module.train(config, stop_after=STEPS + 4)  # beyond the last step: stops there
    assert saved_steps(tmp_path)[-1] == STEPS and resumed.start_step == 4
    assert_same_weights(resumed.params, finished[1].params)  # as if never interrupted


def test_the_last_step_is_saved_whatever_the_interval(finished):
    assert STEPS % EVERY and saved_steps(finished[0])[-1] == STEPS


def test_a_setting_that_changes_what_the_weights_mean_is_refused_naming_it(trainer, finished):
    directory, _ = finished
    before = saved_steps(directory)
    for key, value in trainer.bound:
        old = trainer.tiny[key] if key in trainer.tiny else getattr(trainer.load_config(None), key)
        expected = rf"{key}: checkpoint {old!r} vs config {value!r}.*Train with .*{key}={old}"
        with pytest.raises(CheckpointMismatchError, match=expected):
            trainer.module.train(trainer.config(directory, **{key: value}))
    assert saved_steps(directory) == before  # refused before any step


def test_settings_that_keep_the_weights_meaning_may_change_on_resume(trainer, finished):
    directory, _ = finished
    saved = ocp.CheckpointManager(directory).restore(args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    longer = trainer.config(directory, steps=2 * STEPS, learning_rate=1e-3, checkpoint_every=1, seed=1)
    longer.check_checkpoint(saved.config, str(directory))  # the config saved with the run allows these


def test_the_command_line_refuses_a_mismatched_checkpoint_in_one_line_with_exit_status_2(
        trainer, finished, capsys):
    directory, _ = finished
    key, value = trainer.bound[0]
    capsys.readouterr()
    try:
        status = trainer.module.main(trainer.argv(directory, **{key: value}))
    except SystemExit as exit_info:
        status = exit_info.code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"python -m stacklib.{trainer.name}.train: error: ") and f"{key}:" in lines[0]
    assert "Traceback" not in err and out == ""
