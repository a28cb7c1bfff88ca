"""stacklib.diffusion's behaviour: shapes, the losses, the samplers, guidance, the command line, the zoo."""

import dataclasses
import json
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stacklib.checkpoint as ocp
import stacklib.nn as nnx
from stacklib import diffusion
from stacklib.diffusion import data, metrics, samplers, schedules, train, zoo
from stacklib.diffusion.model import DiT, DiTConfig, patchify, unpatchify
from stacklib.flat_config import CheckpointMismatchError

# One tiny run's settings for every test that trains: the compiled step is shared between them.
TINY = dict(d_model=16, n_layers=1, n_heads=2, batch_size=32, progress=False, log_every=10, steps=40,
            learning_rate=3e-3, warmup_steps=5)


@pytest.fixture(scope="module")
def tiny_model():
    return DiT(DiTConfig(d_model=16, n_layers=1, n_heads=2), rngs=nnx.Rngs(0))


def test_patchify_and_unpatchify_are_inverse_and_patches_are_contiguous_squares():
    x = jnp.arange(2 * 8 * 8 * 3, dtype=jnp.float32).reshape(2, 8, 8, 3)
    tokens = patchify(x, 2)
    assert tokens.shape == (2, 16, 12)
    np.testing.assert_array_equal(tokens[0, 1], x[0, 0:2, 2:4].reshape(-1))  # token 1: rows 0-1, columns 2-3
    np.testing.assert_array_equal(unpatchify(tokens, 2, 3), x)


def test_the_dit_maps_images_to_images_and_starts_as_zero(tiny_model):
    x = jax.random.normal(jax.random.key(0), (5, 8, 8, 1))
    out = tiny_model(x, jnp.linspace(0, 1, 5), jnp.arange(5))
    assert out.shape == x.shape and out.dtype == jnp.float32
    np.testing.assert_array_equal(out, 0.0)  # adaLN-Zero: zero gates and a zero final projection


def test_a_wrong_image_size_is_refused_with_the_fix(tiny_model):
    with pytest.raises(ValueError, match=r"takes \(B, 8, 8, 1\) images.*DiTConfig\(image_size=16"):
        tiny_model(jnp.zeros((1, 16, 16, 1)), jnp.zeros(1), jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="patch_size=3 does not divide image_size=8"):
        DiTConfig(patch_size=3)


@pytest.mark.parametrize("objective", ["flow", "ddpm"])
def test_each_objective_trains_the_loss_down(objective):
    config = diffusion.load_config(None, objective=objective, **TINY)
    losses = train.train(config).losses
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], losses


def test_the_samplers_are_deterministic_given_a_key_and_guidance_at_scale_1_is_the_conditional(tiny_model):
    model = nnx.clone(tiny_model)
    for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param)):  # leave adaLN-Zero: outputs not all 0
        seed = zlib.crc32(repr(path).encode()) % 1000  # the same in every process, unlike hash(path)
        value.value = 0.05 * jax.random.normal(jax.random.key(seed), value.shape)
    eps_model = DiT(dataclasses.replace(model.config, objective="ddpm"), rngs=nnx.Rngs(0))
    nnx.update(eps_model, nnx.state(model, nnx.Param))  # the same weights, read as a noise prediction
    labels = jnp.arange(4)
    schedule = schedules.make_schedule()
    for method, m in (("euler", model), ("ddpm", eps_model)):  # deterministic, stochastic (ddim: ddpm's loop)
        a = samplers.sample(m, labels, jax.random.key(1), method=method, num_steps=4, schedule=schedule)
        b = samplers.sample(m, labels, jax.random.key(1), method=method, num_steps=4, schedule=schedule)
        c = samplers.sample(m, labels, jax.random.key(2), method=method, num_steps=4, schedule=schedule)
        np.testing.assert_array_equal(a.images, b.images)
        assert a.trajectory.shape == (5, 4, 8, 8, 1) and not np.allclose(a.images, c.images)
    x = jax.random.normal(jax.random.key(3), (4, 8, 8, 1))
    t = jnp.full((4,), 0.5)
    guided = jax.jit(lambda scale: samplers.guided_prediction(model, x, t, labels, scale))
    predict = jax.jit(lambda y: model(x, t, y))
    cond, uncond = predict(labels), predict(jnp.full_like(labels, 10))
    np.testing.assert_allclose(guided(1.0), cond, atol=1e-6)
    np.testing.assert_allclose(guided(3.0), uncond + 3.0 * (cond - uncond), atol=1e-5)


def test_sampler_mistakes_name_the_fix(tiny_model):
    with pytest.raises(ValueError, match="euler for a flow-matching model"):
        samplers.sample(tiny_model, jnp.arange(2), jax.random.key(0), method="heun")
    eps_model = DiT(dataclasses.replace(tiny_model.config, objective="ddpm"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="pass schedule=schedules.make_schedule"):
        samplers.sample(eps_model, jnp.arange(2), jax.random.key(0), method="ddim")
    with pytest.raises(ValueError, match=r"classes in 0..9"):
        samplers.sample(tiny_model, jnp.array([3, 11]), jax.random.key(0))
    with pytest.raises(ValueError, match="num_inference_steps=2000 must be between 1"):
        schedules.set_timesteps(1000, 2000)


@pytest.mark.parametrize("objective", ["flow", "ddpm"])
def test_a_model_records_its_objective(objective):
    config = diffusion.load_config(None, objective=objective, **TINY)
    assert train.make_model(config).config.objective == objective == config.model.objective
    with pytest.raises(ValueError, match="objective='score' is not one of flow, ddpm"):
        DiTConfig(objective="score")


def test_a_sampler_that_does_not_fit_the_models_objective_is_refused_naming_the_ones_that_do():
    flow_model = DiT(DiTConfig(d_model=16, n_layers=1, n_heads=2, objective="flow"), rngs=nnx.Rngs(0))
    eps_model = DiT(DiTConfig(d_model=16, n_layers=1, n_heads=2, objective="ddpm"), rngs=nnx.Rngs(0))
    schedule = schedules.make_schedule()
    with pytest.raises(ValueError, match=r"method='euler'.*objective='ddpm'.*method='ddim' or method='ddpm'"):
        samplers.sample(eps_model, jnp.arange(2), jax.random.key(0), method="euler")
    for method in ("ddim", "ddpm"):
        with pytest.raises(ValueError, match=rf"method='{method}'.*objective='flow'.*method='euler'"):
            samplers.sample(flow_model, jnp.arange(2), jax.random.key(0), method=method, schedule=schedule)


def test_a_checkpoint_without_its_config_is_refused_not_trusted(tmp_path):
    # Checkpoints written before the config was saved with them: what their weights mean is unknown.
    config = diffusion.load_config(None, checkpoint_dir=str(tmp_path), **TINY)
    params = nnx.state(train.make_model(config), nnx.Param)
    opt_state = train.make_optimizer(config).init(params)
    manager = ocp.CheckpointManager(tmp_path)
    manager.save(20, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
        data=ocp.args.JsonSave(iter(data.train_batches(config)).get_state())))
    manager.close()
    with pytest.raises(CheckpointMismatchError, match="holds no config.*another checkpoint_dir"):
        train.train(config)


def test_config_mistakes_name_the_fix():
    with pytest.raises(diffusion.ConfigError, match="Did you mean steps"):
        diffusion.load_config(None, "stepz=3")
    with pytest.raises(diffusion.ConfigError, match="objective='score' is not one of flow, ddpm"):
        diffusion.load_config(None, "objective=score")
    with pytest.raises(diffusion.ConfigError, match="n_heads=3 does not divide d_model=32"):
        diffusion.load_config(None, "n_heads=3")
    assert diffusion.load_config(None, "learning_rate=1e-3", "checkpoint_dir=").learning_rate == 1e-3


def test_training_resumes_from_its_checkpoint_on_the_same_batches(tmp_path):
    config = diffusion.load_config(None, checkpoint_every=20, checkpoint_dir=str(tmp_path), **TINY)
    straight = train.train(config.replace(checkpoint_dir=""))
    train.train(config, stop_after=20)  # killed after step 20
    resumed = train.train(config)
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_the_command_line_trains_and_refuses_mistakes_with_exit_2(capsys):
    argv = [f"{key}={str(value).lower()}" for key, value in TINY.items()]
    assert train.main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 40 and len(summary["losses"]) == 4
    for argv, words in [([], "nothing to train"), (["--steps", "3"], "write steps=3 instead of --steps 3"),
                        (["stepz=3"], "Did you mean steps?"), (["missing.yml"], "config file 'missing.yml'")]:
        with pytest.raises(SystemExit) as exit_info:
            train.main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and words in err.splitlines()[-1], err
    # --help and the real `python -m` command: tests/test_command_lines.py, with every entry point.


def test_the_frechet_distance_is_zero_for_one_set_and_grows_with_a_shift():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((500, 4))
    assert abs(metrics.frechet_distance(a, a)) < 1e-9
    # Two Gaussians with equal covariances: d² = |Δμ|²; the samples' own estimates are close to it.
    assert metrics.frechet_distance(a, a + 2.0) == pytest.approx(16.0, rel=1e-9)
    with pytest.raises(ValueError, match=r"same F"):
        metrics.frechet_distance(a, a[:, :3])


def test_the_judge_recognises_held_out_digits():
    images, labels = data.split()["heldout"]
    assert metrics.Judge.train().accuracy(images, labels) > 0.9


def test_a_zoo_model_is_built_once_in_the_fixed_build_process_then_loaded(tmp_path, monkeypatch, capfd):
    # The build protocol itself (same files whoever asks, corrupt caches rebuilt) is tested in
    # tests/test_llm.py; here: the diffusion zoo uses it, and loads what it built.
    monkeypatch.setenv("STACKLIB_CACHE", str(tmp_path))
    monkeypatch.setitem(zoo.ZOO, "test-tiny", dict(TINY, steps=3, warmup_steps=1))
    model, config = zoo.pretrained("test-tiny")
    assert config.steps == 3 and isinstance(model, DiT) and model.config.objective == config.objective
    again, _ = zoo.pretrained("test-tiny")
    assert capfd.readouterr().err.count("Training 'test-tiny' once") == 1  # the second call loaded
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(again)), strict=True):
        np.testing.assert_array_equal(a, b)
    built = tmp_path / "diffusion" / "test-tiny"
    assert json.loads((built / "3" / "built_with" / "item.json").read_text())["cpu_devices"] == 1
    assert len(zoo.losses("test-tiny")) == 1
    with pytest.raises(KeyError, match="digits-flow"):
        zoo.pretrained("no-such-model")
