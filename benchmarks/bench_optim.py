"""Jitted training-step time: stacklib.optim against optax, on the same model and data.

The model (an MLP built with stacklib.nn), the batch, the loss and the jitted step are
identical; only the optimizer library differs. Since both libraries emit the same XLA
operations for the same update rule, the target is parity: at least 0.95x optax's speed.
Three optimizers are timed: plain adam, adamw with masked weight decay, and the
composed clip -> rmsprop(cosine) -> MultiSteps of chapter 03.
"""

from __future__ import annotations

import jax
import optax

import stacklib.nn as nnx
import stacklib.optim as ours
from benchmarks.timing import median_seconds, print_ratio


class MLP(nnx.Module):
    def __init__(self, din: int, dhidden: int, dout: int, *, rngs: nnx.Rngs):
        self.hidden1 = nnx.Linear(din, dhidden, rngs=rngs)
        self.hidden2 = nnx.Linear(dhidden, dhidden, rngs=rngs)
        self.out = nnx.Linear(dhidden, dout, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden2(nnx.relu(self.hidden1(x)))))


def _matrices_only(params):
    return jax.tree.map(lambda p: p.ndim > 1, params)


OPTIMIZERS = {
    "adam": lambda o: o.adam(1e-3),
    "adamw (masked decay)": lambda o: o.adamw(1e-3, weight_decay=1e-2, mask=_matrices_only),
    "clip -> rmsprop(cosine) -> MultiSteps(4)": lambda o: o.MultiSteps(
        o.chain(o.clip_by_global_norm(1.0), o.rmsprop(o.cosine_decay_schedule(1e-3, 1000))),
        every_k_schedule=4,
    ),
}


def _make_runner(lib, make_tx, graphdef, params, x, y, steps: int):
    """A function that runs `steps` jitted training steps and waits for the result."""
    tx = make_tx(lib)

    @jax.jit
    def train_step(params, opt_state):
        def loss_fn(params):
            logits = nnx.merge(graphdef, params, copy=True)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return lib.apply_updates(params, updates), opt_state

    state = [params, tx.init(params)]

    def run():
        for _ in range(steps):
            state[0], state[1] = train_step(state[0], state[1])
        jax.block_until_ready(state)

    run()  # compile outside the timing
    return run


def _interleaved_step_times(runners: dict, steps: int, rounds: int = 7) -> dict:
    """Median seconds per step of each runner, timed in alternating rounds.

    On a shared machine the load drifts; alternating ours/theirs round by round gives
    both the same conditions on average, and the median drops the outlier rounds.
    """
    times = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            times[name].append(median_seconds(run, repeats=1, warmup=0) / steps)
    return {name: sorted(values)[len(values) // 2] for name, values in times.items()}


def main(scale: float = 1.0) -> None:
    width = max(8, int(512 * scale))
    batch = max(8, int(256 * scale))
    steps = max(2, int(50 * scale))
    model = MLP(64, width, 10, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    x = jax.random.normal(jax.random.key(1), (batch, 64))
    y = jax.random.randint(jax.random.key(2), (batch,), 0, 10)
    print(f"MLP 64-{width}-{width}-10, batch {batch}: {steps} jitted steps per round, "
          "median of 7 alternating rounds")
    for name, make_tx in OPTIMIZERS.items():
        runners = {lib: _make_runner(lib, make_tx, graphdef, params, x, y, steps) for lib in (ours, optax)}
        times = _interleaved_step_times(runners, steps)
        print_ratio(f"{name:<42} train step", times[ours], times[optax], "optax", target=0.95)

if __name__ == "__main__":
    main()
