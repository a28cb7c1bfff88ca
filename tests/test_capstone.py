"""stacklib.capstone's pieces at tiny sizes (chapter 16 runs them all, end to end, under nbval)."""

import dataclasses
import json
import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT
from jax.sharding import NamedSharding, PartitionSpec

import stacklib.nn as nnx
from stacklib.capstone import post_training, profiling, quantization, run, serving, training
from stacklib.llm import train
from stacklib.llm.config import load_config

TINY = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=32,
            seq_len=32, batch_size=8, steps=6, warmup_steps=2, max_corpus_bytes=200_000,
            eval_batches=2, progress=False, peak_flops=1e11)


def test_the_mesh_is_2x2x2_on_eight_devices_and_data_parallel_below():
    assert training.mesh_overrides(8) == dict(data_parallelism=2, fsdp_parallelism=2, tensor_parallelism=2)
    assert training.mesh_overrides(1) == dict(data_parallelism=1, fsdp_parallelism=1, tensor_parallelism=1)
    assert training.mesh_overrides(4)["data_parallelism"] == 4
    config = training.capstone_config("/tmp/unused")
    assert config.mesh_shape == (2, 2, 2) and config.async_checkpointing
    assert config.checkpoint_dir == "/tmp/unused" and config.local_checkpoint_dir == ""
    assert training.kill_after() % config.checkpoint_every != 0  # the kill lands between two checkpoints
    # ... and between two local ones, so that the local tier's lost work is not zero by construction
    assert training.kill_after() % config.local_checkpoint_every != 0
    tiered = training.capstone_config("/tmp/unused", local_checkpoint_dir="/tmp/unused-local")
    assert tiered.local_checkpoint_dir == "/tmp/unused-local"


def test_the_report_counts_the_work_lost_with_and_without_the_local_tier():
    records = [{"step": step, "loss": 1.0} for step in range(1, 15)]
    killed = training.KilledRun(records, committed_steps=[1, 8], returncode=-9, local_committed_steps=[8, 12])
    assert killed.killed_at == 14 and killed.last_persistent_step == 8
    resumed = SimpleNamespace(start_step=12)
    report = run.CapstoneReport(None, killed, resumed, None, None, None, None, None, "unused")
    assert (report.steps_lost_with_local_tier, report.steps_lost_without_local_tier) == (2, 6)
    # A persistent step written later, by the resumed run, is not one the kill could fall back to.
    later = dataclasses.replace(killed, committed_steps=[8, 16])
    assert later.last_persistent_step == 8


def test_a_kill_before_the_first_checkpoint_is_refused_before_any_process_starts(tmp_path):
    config = load_config(None, **TINY, checkpoint_dir=str(tmp_path), checkpoint_every=4)
    with pytest.raises(ValueError, match=r"kill_after=3 comes before the first checkpoint.*Kill later"):
        training.run_and_kill(config, 3)
    assert not any(tmp_path.iterdir())


def test_stage_4_runs_here_because_stacklib_align_is_installed():
    assert post_training.available()  # chapter 16's notebook then runs GRPO (stage 4) under nbval


def test_bitwise_equal_compares_every_leaf():
    a = {"w": np.ones(3, np.float32), "b": np.zeros(2, np.float32)}
    b = {"w": np.ones(3, np.float32), "b": np.array([0.0, np.float32(1e-45)], np.float32)}  # one denormal bit
    assert training.bitwise_equal(a, dict(a)) and not training.bitwise_equal(a, b)
    assert not training.bitwise_equal(a, {"w": a["w"]})


def test_op_groups_name_matmuls_collectives_and_fusions():
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    sharded = NamedSharding(mesh, PartitionSpec("x"))

    def f(a, b):
        return jnp.tanh(a @ b).sum()  # a dot, elementwise work, and a sum over the sharded rows

    a = jax.device_put(jnp.ones((8, 16)), sharded)
    compiled = jax.jit(f).lower(a, jnp.ones((16, 4))).compile()
    kinds = set(profiling.op_groups(compiled).values())
    assert {"matmul", "collective"} <= kinds and kinds <= set(profiling.GROUPS)


def test_int8_ptq_keeps_the_loss_within_the_margin_and_shrinks_the_kernels():
    config = load_config(None, **TINY)
    model = train.make_model(config)
    batches = [np.random.default_rng(i).integers(0, 256, (4, 33)).astype(np.int32) for i in range(2)]
    result = quantization.quantize_and_score(model, batches)
    assert result.within_margin and abs(result.loss_increase) < quantization.LOSS_MARGIN
    assert result.int8_bytes < result.float_bytes / 2
    assert result.quantized is not model  # a copy: the float model is unchanged
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_the_exported_model_loads_in_a_fresh_process_and_generates_like_the_model(tmp_path):
    model = train.make_model(load_config(None, **TINY))
    tokens = np.arange(2 * 8, dtype=np.int32).reshape(2, 8)
    result = serving.export_and_load_elsewhere(model, tokens, 5, tmp_path / "1")
    assert result.bitwise and result.generated_equal and result.model_code_imported == []
    assert result.generated.shape == (2, 13) and np.array_equal(result.generated[:, :8], tokens)
    assert set(result.manifest["platforms"]) == {"cpu", "tpu", "cuda"}


# A report whose every claim holds, built without running anything, and one planted failure per
# claim family. The same source runs here and in a `python -O` child (where `assert` is removed).
PLANTED_REPORTS = """
import dataclasses
from types import SimpleNamespace as NS
import numpy as np
from stacklib.capstone import post_training, quantization, run, training

LOSSES = [3.0 - 0.1 * step for step in range(20)]


def good_report(**changes):
    killed = training.KilledRun([{"step": s, "loss": LOSSES[s - 1]} for s in range(1, 15)],
                                committed_steps=[8], returncode=-9, local_committed_steps=[8, 12])
    tiers = NS(local_checkpoint_dir="/tmp/local", local_checkpoint_every=4, checkpoint_every=8)
    whole = NS(losses=list(LOSSES), params={"w": np.ones(3, np.float32)})
    resumed = NS(config=tiers, start_step=12, losses=LOSSES[12:], params={"w": np.ones(3, np.float32)})
    profile = NS(steps=1, groups={"matmul": 0.75, "other": 0.25}, mfu=0.3)
    grpo = post_training.GrpoStage("grpo", None, None, [], 10.0, 40.0, [0.2, 0.5], 1.0, {}, [])
    quant = quantization.QuantResult(None, 1.50, 1.505, 4000, 1100, 40.0, 39.0)
    served = NS(completions=["a", "b"], engine_completions=["a", "b"])
    export = NS(bitwise=True, generated_equal=True, model_code_imported=[])
    parts = dict(training=whole, killed=killed, resumed=resumed, profile=profile, post_training=grpo,
                 quant=quant, serving=served, export=export, served_model="grpo")
    parts.update(changes)
    return run.CapstoneReport(**parts)


def changed(namespace, **changes):
    return NS(**{**vars(namespace), **changes})


def planted():
    good = good_report()
    return {
        "not killed by SIGKILL": good_report(killed=dataclasses.replace(good.killed, returncode=0)),
        "resumed losses differ": good_report(resumed=changed(good.resumed, losses=LOSSES[12:-1] + [9.0])),
        "resumed weights differ": good_report(resumed=changed(good.resumed, params={"w": np.zeros(3)})),
        "did not learn": good_report(training=NS(losses=LOSSES[::-1], params=good.training.params)),
        "MFU above 1": good_report(profile=NS(steps=1, groups={"matmul": 1.0}, mfu=1.7)),
        "int8 over the margin": good_report(quant=dataclasses.replace(good.quant, int8_loss=2.0)),
        "served completions differ": good_report(serving=changed(good.serving, completions=["a", "c"])),
        "artifact not bitwise": good_report(export=changed(good.export, bitwise=False)),
        "GRPO gained too little": good_report(post_training=dataclasses.replace(good.post_training,
                                                                               accuracy_after=11.0)),
    }
"""


def test_a_report_whose_claims_hold_passes_and_a_failed_claim_says_what_was_expected_and_measured():
    from stacklib.capstone.claims import ClaimFailed

    namespace = {}
    exec(PLANTED_REPORTS, namespace)
    namespace["good_report"]().check()
    broken = namespace["planted"]()["not killed by SIGKILL"]
    with pytest.raises(ClaimFailed, match="SIGKILL: expected return code -9, measured return code 0"):
        broken.check()


def test_every_planted_claim_failure_raises_under_python_O():
    # `assert` statements vanish under -O: the claims must be explicit raises.
    code = PLANTED_REPORTS + """
import json
run.CapstoneReport.check(good_report())
raised = {}
for name, report in planted().items():
    try:
        report.check()
        raised[name] = None
    except AssertionError as error:
        raised[name] = type(error).__name__
print(json.dumps(raised))
"""
    result = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    raised = json.loads(result.stdout.strip().splitlines()[-1])
    assert raised == {name: "ClaimFailed" for name in raised}, raised
