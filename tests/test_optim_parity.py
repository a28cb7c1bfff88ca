"""stacklib.optim agrees with optax: the same optimizer, run on the same problem, gives the same numbers.

Each case runs 200 steps on a random least-squares-plus-tanh problem whose gradients
change every step. In float64 our moment updates are the same operations as optax's in
the same order, so the parameters agree to 1e-8 (measured: at most ~1e-14). In float32
rounding differences compound over 200 steps through Adam's division by sqrt(nu), so
the float32 tolerance is 1e-5 (measured: at most ~1e-6).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stacklib.optim as ours

STEPS = 200


def _problem(dtype):
    rng = np.random.default_rng(0)
    params = {
        "layer": {
            "kernel": jnp.asarray(rng.normal(size=(6, 4)), dtype),
            "bias": jnp.asarray(rng.normal(size=4), dtype),
        },
        "scale": jnp.asarray(rng.normal(size=()), dtype),
    }
    inputs = jnp.asarray(rng.normal(size=(STEPS, 8, 6)), dtype)
    targets = jnp.asarray(rng.normal(size=(STEPS, 8, 4)), dtype)

    def loss(p, x, y):
        return jnp.mean((p["scale"] * jnp.tanh(x @ p["layer"]["kernel"] + p["layer"]["bias"]) - y) ** 2)

    return params, inputs, targets, loss


def _run(lib, make_tx, dtype):
    params, inputs, targets, loss = _problem(dtype)
    tx = make_tx(lib)
    state = tx.init(params)

    @jax.jit
    def step(params, state, x, y):
        grads = jax.grad(loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return lib.apply_updates(params, updates), state

    for i in range(STEPS):
        params, state = step(params, state, inputs[i], targets[i])
    return params, state


def _decay_matrices(params):
    return jax.tree.map(lambda p: p.ndim > 1, params)


# One case per optimizer and building block: (name, factory taking the library).
OPTIMIZERS = [
    ("sgd", lambda o: o.sgd(0.1)),
    ("sgd_momentum", lambda o: o.sgd(0.05, momentum=0.9)),
    ("sgd_nesterov", lambda o: o.sgd(0.05, momentum=0.9, nesterov=True)),
    ("adam", lambda o: o.adam(1e-2)),
    ("adam_eps_root_nesterov", lambda o: o.adam(1e-2, b1=0.8, eps_root=1e-8, nesterov=True)),
    ("adamw", lambda o: o.adamw(1e-2, weight_decay=0.1)),
    ("adamw_masked", lambda o: o.adamw(1e-2, weight_decay=0.1, mask=_decay_matrices)),
    ("rmsprop", lambda o: o.rmsprop(1e-2)),
    ("rmsprop_momentum_pytorch_eps", lambda o: o.rmsprop(1e-2, momentum=0.9, eps_in_sqrt=False)),
    ("rmsprop_bias_correction", lambda o: o.rmsprop(1e-2, bias_correction=True, initial_scale=0.1)),
    ("lion", lambda o: o.lion(1e-3)),
    ("lion_masked", lambda o: o.lion(1e-3, weight_decay=0.5, mask=_decay_matrices)),
    ("adam_warmup_cosine", lambda o: o.adam(o.warmup_cosine_decay_schedule(0.0, 3e-2, 20, STEPS, 1e-3))),
    ("sgd_linear_schedule", lambda o: o.sgd(o.linear_schedule(0.1, 0.01, 150, 20), momentum=0.5)),
    ("adamw_scheduled_decay", lambda o: o.adamw(1e-2, weight_decay=o.cosine_decay_schedule(0.1, 100))),
    ("clip", lambda o: o.chain(o.clip(0.05), o.sgd(0.1))),
    ("clip_by_global_norm", lambda o: o.chain(o.clip_by_global_norm(0.1), o.adam(1e-2))),
    ("scale_by_rms_then_trace", lambda o: o.chain(o.scale_by_rms(), o.trace(0.9), o.scale(-1e-3))),
    ("masked_set_to_zero", lambda o: o.chain(o.masked(o.set_to_zero(), _decay_matrices), o.sgd(0.1))),
    ("inject_hyperparams",
     lambda o: o.inject_hyperparams(o.adam)(learning_rate=o.cosine_decay_schedule(0.02, 150))),
    ("multisteps_adam",
     lambda o: o.MultiSteps(o.adam(1e-2), every_k_schedule=4, accumulator_dtype=jnp.float64)),
    # The composed optimizer of the book's stack overview: clip, rmsprop on a cosine
    # schedule, and accumulation over 4 mini-batches.
    ("composed_clip_rmsprop_cosine_accumulate", lambda o: o.MultiSteps(
        o.chain(o.clip_by_global_norm(1.0), o.rmsprop(o.cosine_decay_schedule(1e-2, STEPS // 4))),
        every_k_schedule=4, accumulator_dtype=jnp.float64)),
]


def _paths(tree):
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


@pytest.mark.parametrize("name, make_tx", OPTIMIZERS, ids=[case[0] for case in OPTIMIZERS])
def test_200_steps_agree_with_optax_to_1e_8_in_float64(name, make_tx):
    with jax.enable_x64(True):
        ours_params, ours_state = _run(ours, make_tx, jnp.float64)
        optax_params, optax_state = _run(optax, make_tx, jnp.float64)
        for mine, theirs in zip(jax.tree.leaves(ours_params), jax.tree.leaves(optax_params), strict=True):
            assert mine.dtype == theirs.dtype == jnp.float64
            np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-8)
        # The states correspond leaf by leaf, at the same paths (optax's inject_hyperparams
        # also keeps a count per schedule in `hyperparams_states`; ours does not).
        if name != "inject_hyperparams":
            assert _paths(ours_state) == _paths(optax_state)
            for mine, theirs in zip(jax.tree.leaves(ours_state), jax.tree.leaves(optax_state), strict=True):
                np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-8)


@pytest.mark.parametrize("name, make_tx", OPTIMIZERS[:12], ids=[case[0] for case in OPTIMIZERS[:12]])
def test_200_steps_agree_with_optax_to_1e_5_in_float32(name, make_tx):
    ours_params, _ = _run(ours, make_tx, jnp.float32)
    optax_params, _ = _run(optax, make_tx, jnp.float32)
    for mine, theirs in zip(jax.tree.leaves(ours_params), jax.tree.leaves(optax_params), strict=True):
        assert mine.dtype == theirs.dtype == jnp.float32
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5)


# Schedules: the same function of the step, for every step of a run and past its end.
SCHEDULES = [
    ("constant", lambda o: o.constant_schedule(0.3)),
    ("linear", lambda o: o.linear_schedule(1.0, 0.1, transition_steps=100)),
    ("linear_delayed", lambda o: o.linear_schedule(1.0, 0.1, transition_steps=100, transition_begin=30)),
    ("polynomial", lambda o: o.polynomial_schedule(1.0, 0.0, power=2, transition_steps=120)),
    ("cosine", lambda o: o.cosine_decay_schedule(0.5, decay_steps=150)),
    ("cosine_alpha_exponent", lambda o: o.cosine_decay_schedule(0.5, 150, alpha=0.1, exponent=2.0)),
    ("warmup_cosine", lambda o: o.warmup_cosine_decay_schedule(0.0, 1.0, 25, 200, end_value=0.05)),
    ("join", lambda o: o.join_schedules(
        [o.constant_schedule(1.0), o.linear_schedule(1.0, 0.0, 50), o.constant_schedule(0.2)], [40, 120])),
]


@pytest.mark.parametrize("name, make_schedule", SCHEDULES, ids=[case[0] for case in SCHEDULES])
def test_schedules_agree_with_optax_at_every_step(name, make_schedule):
    with jax.enable_x64(True):
        steps = jnp.arange(300, dtype=jnp.int32)
        mine, theirs = jax.vmap(make_schedule(ours))(steps), jax.vmap(make_schedule(optax))(steps)
        # Same operations on the same float64 values: 1e-12 leaves room only for rounding.
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-12)


def test_a_schedule_is_also_evaluated_at_python_ints_like_optax():
    for name, make_schedule in SCHEDULES:
        for step in (0, 1, 25, 199, 500):
            np.testing.assert_allclose(
                make_schedule(ours)(step), make_schedule(optax)(step), rtol=1e-6, err_msg=f"{name} at {step}"
            )


def test_losses_agree_with_optax():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(16, 10)) * 5, jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, size=16))
    one_hot = jax.nn.one_hot(labels, 10)
    # float32 log-sum-exp over 10 logits of size ~5: agreement to a few ulps of ~10.
    np.testing.assert_allclose(
        ours.softmax_cross_entropy_with_integer_labels(logits, labels),
        optax.softmax_cross_entropy_with_integer_labels(logits, labels), rtol=1e-6, atol=1e-6,
    )
    np.testing.assert_allclose(
        ours.softmax_cross_entropy(logits, one_hot), optax.softmax_cross_entropy(logits, one_hot),
        rtol=1e-6, atol=1e-6,
    )


# Complex parameters: the second moments average |g|^2 = conj(g) g, as optax's do.
COMPLEX_OPTIMIZERS = [
    ("adam", lambda o: o.adam(1e-2)),
    ("adamw", lambda o: o.adamw(1e-2, weight_decay=0.1)),
    ("rmsprop", lambda o: o.rmsprop(1e-2)),
    ("clip_by_global_norm_adam", lambda o: o.chain(o.clip_by_global_norm(0.5), o.adam(1e-2))),
]


@pytest.mark.parametrize("name, make_tx", COMPLEX_OPTIMIZERS, ids=[case[0] for case in COMPLEX_OPTIMIZERS])
def test_complex_parameters_get_optaxs_updates_and_states(name, make_tx):
    rng = np.random.default_rng(2)

    def complex_normal(*shape):
        return jnp.asarray(rng.normal(size=shape) + 1j * rng.normal(size=shape), jnp.complex128)

    with jax.enable_x64(True):
        params = {"w": complex_normal(3, 2), "b": complex_normal(2)}
        grads = [{"w": complex_normal(3, 2), "b": complex_normal(2)} for _ in range(20)]
        results = []
        for lib in (ours, optax):
            tx, p = make_tx(lib), params
            state = tx.init(p)
            for g in grads:
                updates, state = tx.update(g, state, p)
                p = lib.apply_updates(p, updates)
            results.append((p, updates, state))
        for mine, theirs in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
            assert mine.dtype == theirs.dtype
            # The same operations in complex128: agreement to rounding error.
            np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-12)


def test_add_decayed_weights_passes_none_updates_through_like_optax():
    params = {"frozen": jnp.ones(2), "trained": jnp.full(2, 2.0)}
    updates = {"frozen": None, "trained": jnp.ones(2)}
    results = []
    for lib in (ours, optax):
        tx = lib.add_decayed_weights(0.5)
        results.append(tx.update(updates, tx.init(params), params)[0])
    assert results[0]["frozen"] is None and results[1]["frozen"] is None
    np.testing.assert_array_equal(results[0]["trained"], results[1]["trained"])
