"""stacklib.llm with a `pipeline` mesh axis: the pipelined run trains as the unpipelined one does.

A tiny model of 4 layers (so that 2 and 4 stages divide it) on the 8 simulated CPU devices
of conftest.py, a few steps each. Pipelining changes no arithmetic a row sees, only the
order of some sums: each layer's weight gradient is summed microbatch by microbatch in
the backward loop instead of in one matmul over the batch, and the optimizer's global
gradient norm adds the staged leaves in another grouping. Float32 rounding, then, and the
tolerances below are a few times what was measured (largest loss difference over the
steps: see each test).
"""

import json

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_llm import TINY, tiny

import stacklib.nn as nnx
from stacklib import parallel
from stacklib.llm import pipeline, train
from stacklib.llm.config import BASE_CONFIG, ConfigError, load_config

STEPS = 4
LOSS_ATOL = 1e-5  # nats, on losses of about 5.5; measured: at most 1e-6 over the STEPS steps
PARAMS_ATOL = 1e-6  # on weights after STEPS AdamW updates; measured: at most 1.4e-7


def pipelined(**changes):
    return tiny(n_layers=4, steps=STEPS, **changes)


@pytest.fixture(scope="module")
def unpipelined():
    return train.train(pipelined())


@pytest.mark.parametrize("mesh", [
    dict(pipeline_parallelism=4, num_pipeline_microbatches=8),  # one row per microbatch
    dict(pipeline_parallelism=2, data_parallelism=2, num_pipeline_microbatches=2),
    dict(pipeline_parallelism=2, fsdp_parallelism=2, tensor_parallelism=2),  # 8 devices, 2 microbatches
], ids=["p4-m8", "p2-data2-m2", "p2-fsdp2-tensor2"])
def test_a_pipelined_run_has_the_losses_and_weights_of_the_unpipelined_run(mesh, unpipelined):
    result = train.train(pipelined(**mesh))
    difference = np.max(np.abs(np.subtract(result.losses, unpipelined.losses)))
    print(f"{mesh}: largest loss difference {difference:.1e}")
    assert difference < LOSS_ATOL
    # The result is per layer again (unstaged), so it compares key by key.
    for a, b in zip(jax.tree.leaves(result.params), jax.tree.leaves(unpipelined.params), strict=True):
        np.testing.assert_allclose(a, b, atol=PARAMS_ATOL)


def test_a_pipelined_checkpoint_is_keyed_per_layer_and_resumes_without_a_pipeline(tmp_path, unpipelined):
    config = pipelined(pipeline_parallelism=2, num_pipeline_microbatches=2, checkpoint_dir=str(tmp_path),
                       checkpoint_every=2)
    first = train.train(config, stop_after=2)  # saves step 2, with the layers staged in memory
    np.testing.assert_allclose(first.losses, unpipelined.losses[:2], atol=LOSS_ATOL)
    resumed = train.train(config.replace(pipeline_parallelism=1, num_pipeline_microbatches=0))
    assert resumed.start_step == 2
    np.testing.assert_allclose(resumed.losses, unpipelined.losses[2:], atol=LOSS_ATOL)


def test_staging_stacks_the_layers_of_params_and_moments_and_shards_stages_over_the_pipeline():
    config = pipelined(pipeline_parallelism=2, fsdp_parallelism=2, tensor_parallelism=2)
    params = nnx.state(train.make_model(config), nnx.Param)
    tx = train.make_optimizer(config)
    opt_state = tx.init(params)
    staged_params, staged_opt_state = pipeline.stage_layers((params, opt_state), 2)
    kernel = staged_params["layers"]["mlp"]["gate_proj"]["kernel"]
    assert kernel.shape == (2, 2, 32, 64) and kernel.out_sharding == ("stage", "layer", "embed", "mlp")
    np.testing.assert_array_equal(kernel[1, 0], params["layers"][2]["mlp"]["gate_proj"]["kernel"][...])
    rules = train.SHARDING_RULES + pipeline.PIPELINE_RULES
    sharding = parallel.get_named_sharding(staged_params, train.make_mesh(config), rules)
    assert sharding["layers"]["mlp"]["gate_proj"]["kernel"][...].spec == P("pipeline", None, "fsdp", "tensor")
    assert sharding["embed_tokens"]["embedding"][...].spec == P("tensor", "fsdp")  # not staged: as before
    # Weight decay still skips the norms' scales, now (stages, layers, d_model) arrays.
    mask = pipeline.staged_decay_mask(staged_params)["layers"]
    assert not mask["input_layernorm"]["scale"][...] and mask["mlp"]["gate_proj"]["kernel"][...]
    # And back: the same keys, shapes, names and values as before.
    for before, after in [(params, staged_params), (opt_state, staged_opt_state)]:
        back = pipeline.unstage_layers(after)
        assert jax.tree.structure(back) == jax.tree.structure(before)
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(before), strict=True):
            np.testing.assert_array_equal(a, b)
    assert pipeline.unstage_layers(params) is params  # a per-layer tree is left alone


@pytest.mark.parametrize("overrides, message", [
    (["pipeline_parallelism=3"], r"n_layers=4 does not split into pipeline_parallelism=3 equal stages.*"
                                 r"among \[1, 2, 4\]"),
    (["pipeline_parallelism=2", "num_pipeline_microbatches=3"],
     r"gives 3 microbatches, which do not divide the 16 rows of each data shard .* among \[1, 2, 4, 8, 16\]"),
    (["pipeline_parallelism=2", "data_parallelism=4", "num_pipeline_microbatches=8"],
     r"the 4 rows of each data shard \(batch_size=16 over data_parallelism \* fsdp_parallelism = 4\)"),
    (["pipeline_parallelism=4", "data_parallelism=16", "batch_size=48"],
     r"num_pipeline_microbatches=0 \(0 means one per stage\) gives 4 microbatches"),
    (["num_pipeline_microbatches=-1"], r"num_pipeline_microbatches=-1 must be >= 0"),
    (["pipeline_parallelism=0"], r"pipeline_parallelism=0 must be at least 1"),
])
def test_pipeline_settings_that_cannot_work_name_the_setting_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, *overrides)


def test_a_pipeline_mesh_larger_than_the_machine_names_all_four_settings():
    expected = r"pipeline_parallelism \* data_parallelism \* fsdp_parallelism \* tensor_parallelism = 16 "
    with pytest.raises(ConfigError, match=expected):
        train.make_mesh(load_config(None, "pipeline_parallelism=4", "data_parallelism=4"))
    assert load_config(None, "pipeline_parallelism=2").mesh_shape == (2, 1, 1, 1)
    assert load_config(None).mesh_shape == (1, 1, 1)  # no pipeline: the mesh of before


def test_the_command_line_trains_with_a_pipeline_to_the_same_losses(tmp_path, capsys, unpipelined):
    metrics = tmp_path / "metrics.jsonl"
    overrides = [f"{key}={value}" for key, value in TINY.items()]
    assert train.main([str(BASE_CONFIG), *overrides, "n_layers=4", f"steps={STEPS}", "pipeline_parallelism=2",
                       "num_pipeline_microbatches=4", f"metrics_file={metrics}"]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)) and all(r["mfu"] > 0 for r in records)
    np.testing.assert_allclose([r["loss"] for r in records], unpipelined.losses, atol=LOSS_ATOL)
    assert json.loads(capsys.readouterr().out)["final_loss"] == records[-1]["loss"]


def test_the_pipelined_forward_pass_gives_an_open_models_logits_rope_scaling_and_qk_norm_included():
    # Chapter 18's settings live inside the layers (qk_norm) and in the RoPE angles the pipeline
    # computes itself (rope_scaling): both must reach the stages.
    config = pipelined(pipeline_parallelism=2, num_pipeline_microbatches=2, qk_norm=True,
                       rope_scaling="llama3", rope_original_max_len=16)
    model = train.make_model(config)
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jax.random.randint(jax.random.key(0), (8, 16), 0, config.vocab_size)
    forward = pipeline.make_forward(graphdef, params, config, train.make_mesh(config))
    logits = jax.jit(forward)(pipeline.stage_layers(params, 2), tokens)
    np.testing.assert_allclose(logits, model(tokens), atol=1e-5)  # float32 rounding of reordered sums
