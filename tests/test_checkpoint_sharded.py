"""stacklib.checkpoint.sharded: one step written by several processes, simulated in one.

The test process has 8 CPU devices (conftest.py), all addressable. A "process" here is
a thread with its own `is_primary` and its own share of every array's shards (every
other shard, by a stand-in for `owned_shards`); the barrier is a `threading.Barrier`.
The real thing, two `jax.distributed` processes, runs in tests/test_llm_multihost.py.
"""

import ast
import json
import pathlib
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import stacklib.checkpoint as ocp
from stacklib.checkpoint import sharded
from stacklib.checkpoint.args import Composite, JsonSave, StandardRestore, StandardSave
from stacklib.checkpoint.manager import METADATA


def sharded_state():
    """Arrays split 4 ways and replicated 2 ways over the 8 devices, a replicated scalar, bfloat16."""
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rows, cols = NamedSharding(mesh, P("x", None)), NamedSharding(mesh, P(None, "x"))
    return {"w": jax.device_put(jnp.arange(48.0).reshape(8, 6), rows),
            "v": jax.device_put(jnp.arange(16, dtype=jnp.bfloat16).reshape(2, 8), cols),
            "count": jax.device_put(jnp.int32(7), NamedSharding(mesh, P()))}


def no_barrier(name):
    pass


def save_as_processes(monkeypatch, directory, step, args, processes=2, **options):
    """Run `save_sharded_step` in `processes` threads, each writing every `processes`-th owned shard."""
    local = threading.local()
    owned = sharded.owned_shards
    monkeypatch.setattr(sharded, "owned_shards",
                        lambda array: owned(array)[local.process::processes])
    rendezvous = threading.Barrier(processes, timeout=10)  # a bug fails the test instead of hanging it
    names = [[] for _ in range(processes)]

    def process(index):
        local.process = index

        def barrier(name):
            names[index].append(name)
            rendezvous.wait()

        sharded.save_sharded_step(directory, step, args, barrier=barrier, is_primary=index == 0, **options)

    with ThreadPoolExecutor(processes) as pool:
        for future in [pool.submit(process, index) for index in range(processes)]:
            future.result()
    return names


def test_each_process_writes_only_its_shards_at_their_offsets(tmp_path):
    w = sharded_state()["w"]
    owned = sharded.owned_shards(w)
    assert len(owned) == 4 and len(w.addressable_shards) == 8  # replica 1 of each block is not written
    file = tmp_path / "w.bin"
    sharded.write_shards(file, w, owned[:2])  # "process 0": rows 0-3
    half = np.fromfile(file, np.float32).reshape(8, 6)
    np.testing.assert_array_equal(half[:4], np.asarray(w)[:4])
    assert not half[4:].any()  # sized to the whole array, the other rows not yet written
    sharded.write_shards(file, w, owned[2:])  # "process 1": rows 4-7; the resize keeps process 0's rows
    assert file.read_bytes() == np.asarray(w).tobytes()


def test_two_processes_write_one_step_that_checkpoint_manager_restores(monkeypatch, tmp_path):
    state = sharded_state()
    args = Composite(state=StandardSave(state), data=JsonSave({"next_index": 10}))
    names = save_as_processes(monkeypatch, tmp_path / "sharded", 10, args, metrics={"loss": 1.5})
    assert names[0] == names[1] == [f"checkpoint-10-{phase}" for phase in ("created", "written", "committed")]

    manager = ocp.CheckpointManager(tmp_path / "sharded")
    assert manager.all_steps() == [10] and manager.metrics(10) == {"loss": 1.5}
    restored = manager.restore(10, args=Composite(state=StandardRestore(state)))
    for name, leaf in state.items():
        assert restored.state[name].dtype == leaf.dtype and restored.state[name].sharding == leaf.sharding
        np.testing.assert_array_equal(np.asarray(restored.state[name]), np.asarray(leaf))
    assert manager.restore(10).data == {"next_index": 10}

    # The same files, manifest and items as one process's CheckpointManager.save of the same values.
    with ocp.CheckpointManager(tmp_path / "single") as single:
        single.save(10, args=args, metrics={"loss": 1.5})
    for item in ("state", "data"):
        for file in sorted((tmp_path / "single" / "10" / item).iterdir()):
            assert (tmp_path / "sharded" / "10" / item / file.name).read_bytes() == file.read_bytes(), file
    metadata = [json.loads((tmp_path / root / "10" / METADATA).read_text()) for root in ("sharded", "single")]
    for saved in metadata:
        del saved["timestamp"]
    assert metadata[0] == metadata[1]


def test_an_interrupted_save_leaves_the_last_step_intact_and_is_cleaned_up(tmp_path):
    state = sharded_state()
    sharded.save_sharded_step(tmp_path, 1, StandardSave(state), barrier=no_barrier, is_primary=True)

    def killed_after_writing(name):
        if name.endswith("-written"):
            raise RuntimeError("process lost")  # as when a peer dies: no commit

    newer = {**state, "count": state["count"] + 1}
    with pytest.raises(RuntimeError, match="process lost"):
        sharded.save_sharded_step(tmp_path, 2, StandardSave(newer), barrier=killed_after_writing,
                                  is_primary=True)
    assert (tmp_path / "2.partial-sharded").is_dir() and not (tmp_path / "2").exists()
    assert ocp.CheckpointManager(tmp_path).restore(None)["count"] == 7  # step 1, still whole

    # The next save of that step starts afresh; retention runs after the commit.
    sharded.save_sharded_step(tmp_path, 2, StandardSave(newer), barrier=no_barrier, is_primary=True,
                              max_to_keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2"]
    assert ocp.CheckpointManager(tmp_path).restore(2)["count"] == 8

    (tmp_path / "3.partial-sharded").mkdir()  # a job killed mid-save, never resumed
    ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(cleanup_tmp_directories=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2"]


@pytest.mark.parametrize("step, args, error, fragment", [
    (1, StandardSave({"w": jnp.ones(3)}), ocp.StepAlreadyExistsError, "already exists"),
    (2, StandardSave({"w": np.ones(3)}), TypeError, r"leaf at \['w'\] is a ndarray"),
    (2, Composite(data=JsonSave({1j})), TypeError, "item 'data': JsonSave needs"),
    (-2, StandardSave({"w": jnp.ones(3)}), ValueError, "step must be a non-negative int"),
    (2.0, StandardSave({"w": jnp.ones(3)}), TypeError, "step must be a non-negative int"),
])
def test_bad_arguments_stop_every_process_before_the_first_barrier(tmp_path, step, args, error, fragment):
    sharded.save_sharded_step(tmp_path, 1, StandardSave({"w": jnp.ones(3)}), barrier=no_barrier,
                              is_primary=True)
    reached = []
    for is_primary in (True, False):
        with pytest.raises(error, match=fragment):
            sharded.save_sharded_step(tmp_path, step, args, barrier=reached.append, is_primary=is_primary)
    assert reached == [] and sorted(p.name for p in tmp_path.iterdir()) == ["1"]


def test_sharded_saves_use_only_the_public_names_of_the_other_checkpoint_modules():
    tree = ast.parse(pathlib.Path(sharded.__file__).read_text())
    private = [f"{ast.unparse(node)} (line {node.lineno})" for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and re.match(r"_[^_]", node.attr)]
    private += [f"{alias.name} (line {node.lineno})" for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) for alias in node.names if re.match(r"_[^_]", alias.name)]
    assert private == []
