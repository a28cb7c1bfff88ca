"""stacklib.llm.train as one process per host (multihost.py): 2 processes x 2 CPU devices on localhost.

The slow tests start real processes that join one JAX job through `jax.distributed`
(gloo on localhost). Every wait is bounded and ends with SIGKILL: JAX's preemption
notifier swallows SIGTERM (PITFALLS.md).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from conftest import ROOT

import stacklib.checkpoint as ocp
from stacklib import parallel
from stacklib.llm import data, multihost, train
from stacklib.llm.config import load_config

# A tiny model, FSDP over 4 devices in 1 process or in 2: every weight is split across the
# processes, so each process writes half of every array into the checkpoint.
TINY = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64, seq_len=32,
            max_seq_len=32, batch_size=8, max_corpus_bytes=200_000, eval_batches=0, peak_flops=1e12,
            progress=False, steps=10, data_parallelism=1, fsdp_parallelism=4)
ARGS = [f"{key}={value}" for key, value in TINY.items()]


def tiny(**changes):
    return load_config(None, **{**TINY, **changes})


# ---- the job's shape from the environment (no processes started)

def test_no_job_variables_mean_one_process():
    assert multihost.job_from_env({}) is None


def test_the_launcher_variables_and_jax_variables_describe_the_job():
    launched = {"STACKLIB_COORDINATOR_ADDRESS": "127.0.0.1:1234", "STACKLIB_NUM_PROCESSES": "2",
                "STACKLIB_PROCESS_ID": "1", "STACKLIB_LOCAL_DEVICE_COUNT": "2"}
    assert multihost.job_from_env(launched) == {"coordinator_address": "127.0.0.1:1234", "num_processes": 2,
                                                "process_id": 1, "local_device_count": 2}
    cluster = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:8476", "JAX_NUM_PROCESSES": "16", "JAX_PROCESS_ID": "3"}
    assert multihost.job_from_env(cluster)["num_processes"] == 16
    assert multihost.job_from_env({"STACKLIB_DISTRIBUTED": "auto"}) == {}  # Cloud TPU: from the runtime


@pytest.mark.parametrize("environ, fragment", [
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, "not below"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"}, "integer"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "0"}, "JAX_NUM_PROCESSES is not set"),
])
def test_a_wrong_job_variable_is_named(environ, fragment):
    with pytest.raises(multihost.DistributedInitError, match=fragment):
        multihost.job_from_env(environ)


def test_the_processes_shards_of_a_batch_are_its_rows_in_order():
    config = tiny()
    whole = iter(data.train_dataset(config))
    shards = [iter(data.train_dataset(config, shard_index=i, shard_count=2)) for i in range(2)]
    for _ in range(3):
        np.testing.assert_array_equal(np.concatenate([next(s) for s in shards]), next(whole))
    assert shards[1].get_state() == whole.get_state()  # the state counts steps, whatever the count
    with pytest.raises(ValueError, match="multiple of 3"):
        data.train_dataset(config, shard_count=3)


# ---- real processes

def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_process(process_id, num_processes, port, args, **env):
    """One `python -m stacklib.llm.train` process of a job, as launch_local starts it."""
    environ = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
                   STACKLIB_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   STACKLIB_NUM_PROCESSES=str(num_processes), STACKLIB_PROCESS_ID=str(process_id),
                   STACKLIB_LOCAL_DEVICE_COUNT="2", **env)
    err = tempfile.TemporaryFile("w+")
    process = subprocess.Popen([sys.executable, "-m", "stacklib.llm.train", *args], env=environ, cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    process.stderr_file = err
    return process


def finish(process, deadline):
    """(exit status, seconds waited, stderr); SIGKILL at `deadline` (monotonic) and fail."""
    began = time.monotonic()
    try:
        process.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        pytest.fail(f"process {process.args} did not exit in time; SIGKILLed")
    process.stderr_file.seek(0)
    return process.returncode, time.monotonic() - began, process.stderr_file.read()


def kill_all(processes):
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def launch_job(tmp_path, *extra):
    """The tiny config as 2 processes x 2 devices; (losses from process 0's metrics file, results)."""
    metrics = tmp_path / "metrics.jsonl"
    processes = parallel.launch_local("stacklib.llm.train", 2, local_device_count=2, timeout_s=150,
                                      args=[*ARGS, f"metrics_file={metrics}", *extra])
    return [json.loads(line) for line in metrics.read_text().splitlines()], processes


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One 2-process run of 10 steps with checkpoints at 5 and 10, shared by the tests below."""
    tmp_path = tmp_path_factory.mktemp("job")
    checkpoints = tmp_path / "ckpt"
    began = time.monotonic()
    records, processes = launch_job(tmp_path, f"checkpoint_dir={checkpoints}", "checkpoint_every=5",
                                    "async_checkpointing=false")
    return {"records": records, "processes": processes, "checkpoints": checkpoints,
            "seconds": time.monotonic() - began}


@pytest.mark.slow
def test_two_processes_train_like_one_and_write_one_checkpoint_that_one_process_resumes(job, tmp_path):
    processes, checkpoints, records = job["processes"], job["checkpoints"], job["records"]
    two_process_seconds = job["seconds"]
    assert '"final_loss"' in processes[0].stdout and '"final_loss"' not in processes[1].stdout
    assert [r["step"] for r in records] == list(range(1, 11))  # process 0 only: not 20 lines
    two = [r["loss"] for r in records]

    one = train.train(tiny()).losses  # 1 process x 4 devices (this test process has 8)
    # Same batches, same mesh; gloo sums across processes in another order: ~1e-7 apart.
    np.testing.assert_allclose(two, one, rtol=1e-5)
    assert max(abs(a - b) / b for a, b in zip(two, one, strict=True)) < 1e-5

    manager = ocp.CheckpointManager(checkpoints)
    assert manager.all_steps() == [5, 10]
    resumed_dir = tmp_path / "resume"
    resumed_dir.mkdir()
    shutil.copytree(checkpoints / "5", resumed_dir / "5")  # the two processes' step 5, alone
    resumed = train.train(tiny(checkpoint_dir=str(resumed_dir), async_checkpointing=False))
    assert resumed.start_step == 5 and [r["step"] for r in resumed.history] == [6, 7, 8, 9, 10]
    np.testing.assert_allclose(resumed.losses, two[5:], rtol=1e-5)  # the right batches, the same state

    # Bitwise: what the 2 processes wrote at step 10 is, file for file, what one process
    # writes after restoring it (the shards landed at the right offsets).
    restored = manager.restore(10)
    copy = ocp.CheckpointManager(tmp_path / "copy", options=ocp.CheckpointManagerOptions(
        enable_async_checkpointing=False))
    copy.save(10, args=ocp.args.Composite(state=ocp.args.StandardSave(restored.state),
                                          data=ocp.args.JsonSave(restored.data)))
    written = json.loads((checkpoints / "10" / "state" / "manifest.json").read_text())["leaves"]
    rewritten = json.loads((tmp_path / "copy" / "10" / "state" / "manifest.json").read_text())["leaves"]
    # (restored without a target, the tree's containers are dicts and lists: compare the bytes)
    assert sorted((e["shape"], e["crc32"]) for e in written) == \
        sorted((e["shape"], e["crc32"]) for e in rewritten)
    assert restored.data == {"next_index": 10}
    print("2 processes x 2 devices:", " ".join(f"{x:.8f}" for x in two))
    print("1 process   x 4 devices:", " ".join(f"{x:.8f}" for x in one))
    print(f"2x2 run {two_process_seconds:.1f} s; max relative loss difference vs 1x4 "
          f"{max(abs(a - b) / b for a, b in zip(two, one, strict=True)):.2e}")


@pytest.mark.slow
def test_a_restarted_two_process_job_resumes_bitwise_like_the_uninterrupted_one(job, tmp_path):
    restart = tmp_path / "ckpt"
    shutil.copytree(job["checkpoints"] / "5", restart / "5")  # the job died after step 5's save
    records, _ = launch_job(tmp_path, f"checkpoint_dir={restart}", "checkpoint_every=5")
    assert [r["step"] for r in records] == [6, 7, 8, 9, 10]
    assert [r["loss"] for r in records] == [r["loss"] for r in job["records"][5:]]  # bit for bit


@pytest.mark.slow
def test_killing_one_process_stops_the_other_with_a_clear_error(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    port = _port()
    args = [*ARGS, "steps=2000", f"metrics_file={metrics}"]
    processes = [start_process(i, 2, port, args, STACKLIB_HEARTBEAT_TIMEOUT="5") for i in range(2)]
    try:
        deadline = time.monotonic() + 90
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert time.monotonic() < deadline and processes[0].poll() is None, "the job never trained"
            time.sleep(0.1)
        os.killpg(processes[1].pid, signal.SIGKILL)
        status, seconds, stderr = finish(processes[0], time.monotonic() + 45)
    finally:
        kill_all(processes)
    assert status != 0
    assert "another task died" in stderr and "stopped sending heartbeats" in stderr
    assert seconds < 45


@pytest.mark.slow
def test_a_coordinator_that_never_answers_is_an_error_within_the_init_timeout():
    began = time.monotonic()
    process = start_process(1, 2, _port(), ARGS, STACKLIB_INIT_TIMEOUT="3")  # nobody is process 0
    status, _, stderr = finish(process, time.monotonic() + 60)
    assert status == 1
    assert "DistributedInitError" in stderr and "did not answer within 3 s" in stderr
    assert time.monotonic() - began < 60


@pytest.mark.slow
def test_processes_that_disagree_on_the_process_count_stop_with_an_error():
    port = _port()
    processes = [start_process(0, 2, port, ARGS, STACKLIB_INIT_TIMEOUT="10", STACKLIB_HEARTBEAT_TIMEOUT="5"),
                 start_process(1, 3, port, ARGS, STACKLIB_INIT_TIMEOUT="10", STACKLIB_HEARTBEAT_TIMEOUT="5")]
    try:
        deadline = time.monotonic() + 75
        second = finish(processes[1], deadline)
        first = finish(processes[0], deadline)
    finally:
        kill_all(processes)
    # The error, then JAX's exit barrier gives up on process 0 after the heartbeat timeout (SIGABRT).
    assert second[0] != 0 and "DistributedInitError" in second[2]
    assert "told the job has 3 processes" in second[2] and "formed a job of 2" in second[2]
    assert first[0] != 0  # process 0 loses its peer: JAX stops it (see the test above)
    print(f"mismatch: process 1 {second[1]:.1f} s, process 0 {first[1]:.1f} s more")


def test_the_module_documents_every_variable_it_reads():
    doc = multihost.__doc__
    for name in ("STACKLIB_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
                 "JAX_PROCESS_ID", "STACKLIB_DISTRIBUTED=auto", "STACKLIB_INIT_TIMEOUT",
                 "STACKLIB_HEARTBEAT_TIMEOUT"):
        assert name in doc
