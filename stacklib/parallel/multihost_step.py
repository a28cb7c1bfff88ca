"""A sharded training step run by several processes together: `python -m stacklib.parallel.multihost_step`.

Each process runs this same program (multi-controller JAX); `launch_local` starts
them. Together they hold one global mesh over every process's devices, train the
MLP of `stacklib.parallel.mlp` (built with `stacklib.nn`) with FSDP (batch and
hidden units split over all devices, so every step all-gathers parameters across
processes), and print one JSON line `RESULT {...}` with what this process saw: its
index, its local devices, which rows of the batch it holds, the losses, and the
final parameters (gathered).

Every process generates the whole batch from the same seed and feeds only its own
rows, the way each host of a pod reads its own share of the data.

Each step is waited for (`block_until_ready`) before the next is dispatched: with
several devices per process, a long queue of un-waited collectives can deadlock gloo.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

# Rules of the step every process runs: data parallel over the batch, parameters
# sharded over the same axis (FSDP).
FSDP_RULES = (("batch", "data"), ("hidden", "data"))


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m stacklib.parallel.multihost_step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--features", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args(argv)

    from stacklib.parallel.launch import initialize_from_env

    initialize_from_env()  # before anything else touches JAX

    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import stacklib.nn as nnx
    from stacklib.parallel.mesh import make_mesh
    from stacklib.parallel.mlp import MLPClassifier, make_blobs, make_sgd_step
    from stacklib.parallel.state import get_named_sharding, shard_state

    mesh = make_mesh((jax.device_count(),), ("data",), (AxisType.Auto,), devices=jax.devices())
    model = MLPClassifier(options.features, options.hidden, options.classes, rngs=nnx.Rngs(options.seed))
    graphdef, state = nnx.split(model)
    state = shard_state(state, mesh, FSDP_RULES)  # same values in every process: each keeps its shards

    x, y = make_blobs(options.seed + 1, options.batch, options.features, options.classes)
    rows = options.batch // jax.process_count()
    mine = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
    batch_sharding = NamedSharding(mesh, P("data"))
    x = jax.make_array_from_process_local_data(batch_sharding, np.asarray(x[mine]))
    y = jax.make_array_from_process_local_data(batch_sharding, np.asarray(y[mine]))

    state_shardings = get_named_sharding(state, mesh, FSDP_RULES)
    step = jax.jit(make_sgd_step(graphdef, options.learning_rate),
                   out_shardings=(state_shardings, NamedSharding(mesh, P())))
    losses = []
    for _ in range(options.steps):
        state, loss = step(state, x, y)
        loss.block_until_ready()
        losses.append(float(loss))

    replicated = jax.jit(lambda s: s, out_shardings=NamedSharding(mesh, P()))(nnx.to_pure_dict(state))
    result = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_ids": [d.id for d in jax.local_devices()],
        "batch_rows_held": sorted({(s.index[0].start, s.index[0].stop) for s in x.addressable_shards}),
        "kernel_shard_shape": list(state["fc1"]["kernel"][...].addressable_shards[0].data.shape),
        "losses": losses,
        "params": jax.tree.map(lambda a: np.asarray(a).tolist(), replicated),
    }
    print("RESULT " + json.dumps(result), flush=True)
    jax.distributed.shutdown()
    return result


if __name__ == "__main__":
    main()
