"""stacklib.checkpoint against orbax: the same pytrees round-trip, the same steps are saved and kept.

Comparisons are exact: a checkpoint stores bytes, so a restored leaf must equal the saved
one bit for bit, with the same dtype and the same container types, in both libraries.
"""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as orbax
import pytest

import stacklib.checkpoint as ours

# One case table per component.

TREES = {
    "float32 matrix": {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4)},
    "bfloat16": {"w": (jnp.arange(8, dtype=jnp.float32) / 3).astype(jnp.bfloat16)},
    "integers": {"i8": jnp.arange(-4, 4, dtype=jnp.int8), "i32": jnp.arange(5, dtype=jnp.int32),
                 "u32": jnp.arange(3, dtype=jnp.uint32)},
    "0-d arrays": {"step": jnp.int32(41), "loss": jnp.float32(0.125), "host": np.array(2.5)},
    "nested dicts and lists": {"layers": [{"kernel": jnp.ones((2, 2)), "bias": jnp.zeros(2)},
                                          {"kernel": jnp.full((2, 1), 3.0), "bias": jnp.ones(1)}],
                               "embed": {"table": jnp.eye(3)}},
    "NumPy and Python leaves": {"np": np.arange(6, dtype=np.float64).reshape(2, 3), "n": 7, "x": 0.5,
                                "flag": True},
    "special values": {"v": jnp.array([np.inf, -np.inf, np.nan, -0.0, 1e-45], jnp.float32)},
}


def _round_trip(library, path, tree, with_target: bool):
    manager = library.CheckpointManager(path)
    manager.save(0, args=library.args.StandardSave(tree))
    manager.wait_until_finished()
    args = library.args.StandardRestore(tree) if with_target else None
    restored = manager.restore(0, args=args)
    manager.close()
    return restored


def _describe(tree):
    """Every leaf as (type, dtype, shape, bytes): equal descriptions mean bitwise-equal trees."""
    def leaf(x):
        kind = "jax.Array" if isinstance(x, jax.Array) else type(x).__name__
        array = np.asarray(x)
        return kind, str(array.dtype), array.shape, array.tobytes()
    return jax.tree.structure(tree), [leaf(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("with_target", [True, False], ids=["into a target", "without a target"])
@pytest.mark.parametrize("name", list(TREES))
def test_pytrees_round_trip_through_both_libraries_identically(tmp_path, name, with_target):
    tree = TREES[name]
    theirs = _round_trip(orbax, tmp_path / "orbax", tree, with_target)
    mine = _round_trip(ours, tmp_path / "ours", tree, with_target)
    assert _describe(mine) == _describe(theirs)
    assert _describe(mine) == _describe(tree)


def test_both_libraries_cast_to_the_targets_dtype(tmp_path):
    tree = {"w": jnp.linspace(0, 1, 7, dtype=jnp.float32)}
    target = {"w": jax.ShapeDtypeStruct((7,), jnp.bfloat16)}
    restored = []
    for library, path in ((orbax, tmp_path / "orbax"), (ours, tmp_path / "ours")):
        manager = library.CheckpointManager(path)
        manager.save(0, args=library.args.StandardSave(tree))
        manager.wait_until_finished()
        restored.append(manager.restore(0, args=library.args.StandardRestore(target)))
        manager.close()
    assert _describe(restored[0]) == _describe(restored[1])
    assert restored[1]["w"].dtype == jnp.bfloat16


def _losses(step):
    return [0.9, 0.4, 0.6, 0.3, 0.8, 0.3, 0.5, 0.7, 0.2, 0.95, 0.35, 0.6][step % 12]


RETENTION = {  # name: (options, steps offered to save, whether to pass metrics)
    "keep all": (dict(), range(6), False),
    "max_to_keep": (dict(max_to_keep=3), range(10), False),
    "interval": (dict(save_interval_steps=4, max_to_keep=2), range(1, 20), False),
    "best min": (dict(max_to_keep=3, best_fn=lambda m: m["loss"], best_mode="min"), range(12), True),
    "best max": (dict(max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="max"), range(12), True),
    "keep none": (dict(max_to_keep=0), range(3), False),
}


def _run_retention(library, path, options, steps, with_metrics):
    manager = library.CheckpointManager(path, options=library.CheckpointManagerOptions(**options))
    saved = []
    for step in steps:
        metrics = {"loss": _losses(step)} if with_metrics else None
        if manager.save(step, args=library.args.StandardSave({"s": jnp.int32(step)}), metrics=metrics):
            saved.append(step)
        manager.wait_until_finished()
    kept = list(manager.all_steps())
    best = manager.best_step() if with_metrics else None
    manager.close()
    return saved, kept, best


@pytest.mark.parametrize("name", list(RETENTION))
def test_the_same_steps_are_saved_and_kept_as_in_orbax(tmp_path, name):
    options, steps, with_metrics = RETENTION[name]
    theirs = _run_retention(orbax, tmp_path / "orbax", options, steps, with_metrics)
    mine = _run_retention(ours, tmp_path / "ours", options, steps, with_metrics)
    assert mine == theirs


def test_a_composite_with_a_data_iterator_state_restores_the_same_in_both(tmp_path):
    import stacklib.data as grain

    pipeline = grain.MapDataset.range(10).shuffle(seed=1).to_iter_dataset(grain.ReadOptions(num_threads=0))
    iterator = iter(pipeline)
    next(iterator), next(iterator)
    state = {"params": {"w": jnp.ones((2, 2))}}
    restored = []
    for library, path in ((orbax, tmp_path / "orbax"), (ours, tmp_path / "ours")):
        manager = library.CheckpointManager(path)
        manager.save(2, args=library.args.Composite(state=library.args.StandardSave(state),
                                                    data=library.args.JsonSave(iterator.get_state())))
        manager.wait_until_finished()
        restored.append(manager.restore(2, args=library.args.Composite(
            state=library.args.StandardRestore(state), data=library.args.JsonRestore())))
        manager.close()
    assert restored[0].data == restored[1].data == {"next_index": 2}
    assert _describe(restored[0].state) == _describe(restored[1].state)
