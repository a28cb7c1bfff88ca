"""stacklib.optim's behaviour: convergence, dtypes, compilation, accumulation, injection, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stacklib.optim as optax

# Every optimizer of the subset, with a learning rate that suits a small quadratic.
OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.04),  # stable while lr < 2 / max curvature = 0.1
    "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adam": lambda: optax.adam(0.1),
    "adamw": lambda: optax.adamw(0.1, weight_decay=1e-4),
    "rmsprop": lambda: optax.rmsprop(0.05),
    "lion": lambda: optax.lion(0.02, weight_decay=0.0),
    "multisteps_sgd": lambda: optax.MultiSteps(optax.sgd(0.04), every_k_schedule=2),
}


def _quadratic(params):
    # Minimum 0 at w = (1, -2, 3), b = 0.5; condition number 10.
    return jnp.sum(jnp.array([1.0, 3.0, 10.0]) * (params["w"] - jnp.array([1.0, -2.0, 3.0])) ** 2) + (
        params["b"] - 0.5
    ) ** 2


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_optimizer_minimises_a_quadratic(name):
    tx = OPTIMIZERS[name]()
    params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        updates, state = tx.update(jax.grad(_quadratic)(params), state, params)
        return optax.apply_updates(params, updates), state

    start = _quadratic(params)
    for _ in range(400):
        params, state = step(params, state)
    assert _quadratic(params) < 1e-2 * start, f"{name}: loss {_quadratic(params)} from {start}"


def _expected_state_dtype(path: str, leaf) -> jnp.dtype:
    if jnp.issubdtype(leaf.dtype, jnp.integer):
        return jnp.int32  # step counts
    if ".acc_grads" in path:
        return jnp.float32  # MultiSteps accumulates in float32 by default, as optax's does
    return jnp.bfloat16  # moments and traces keep the params' dtype


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_updates_state_and_params_keep_bfloat16(name):
    # apply_updates casts back to the params' dtype, so the params alone would hide a
    # transformation that promotes its updates or its state to float32: check all three.
    tx = OPTIMIZERS[name]()
    params = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.ones((), jnp.bfloat16)}
    state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    for _ in range(2):  # MultiSteps emits its first update on the second call
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        assert [leaf.dtype for leaf in jax.tree.leaves(updates)] == [jnp.bfloat16] * 2
        assert [leaf.dtype for leaf in jax.tree.leaves(params)] == [jnp.bfloat16] * 2
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
            path = jax.tree_util.keystr(path)
            assert leaf.dtype == _expected_state_dtype(path, leaf), f"{name}: state{path} is {leaf.dtype}"


def test_a_jitted_step_compiles_once_and_is_reused():
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(optax.cosine_decay_schedule(0.1, 50)))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    traces = []

    @jax.jit
    def step(params, state):
        traces.append(1)  # runs only while tracing
        updates, state = tx.update(jax.grad(lambda p: jnp.sum(p["w"] ** 2))(params), state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(5):
        params, state = step(params, state)
    assert len(traces) == 1


def test_the_step_count_lives_in_the_state_and_drives_the_schedule():
    schedule = optax.linear_schedule(1.0, 0.0, transition_steps=4)
    tx = optax.sgd(schedule)
    params = jnp.zeros(())
    state = tx.init(params)
    steps = []
    for _ in range(6):
        updates, state = tx.update(jnp.ones(()), state)
        steps.append(float(-updates))
    np.testing.assert_allclose(steps, [1.0, 0.75, 0.5, 0.25, 0.0, 0.0])


def test_clip_by_global_norm_shortens_long_updates_and_keeps_short_ones():
    clip = optax.clip_by_global_norm(1.0)
    long = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([4.0])}  # norm 5
    clipped, _ = clip.update(long, clip.init(long))
    np.testing.assert_allclose(optax.global_norm(clipped), 1.0, rtol=1e-6)
    np.testing.assert_allclose(clipped["a"], [0.6, 0.0], rtol=1e-6)  # same direction
    short = {"a": jnp.array([0.3, 0.0]), "b": jnp.array([0.4])}
    unchanged, _ = clip.update(short, clip.init(short))
    np.testing.assert_array_equal(unchanged["a"], short["a"])


def test_masked_weight_decay_skips_biases():
    params = {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}
    tx = optax.add_decayed_weights(0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zero_grads, tx.init(params), params)
    np.testing.assert_allclose(updates["kernel"], 0.1)
    np.testing.assert_allclose(updates["bias"], 0.0)


def test_multisteps_steps_once_every_k_calls_with_the_mean_gradient():
    k = 3
    tx = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=k)
    params = jnp.zeros(())
    state = tx.init(params)
    emitted = []
    for grad in [1.0, 2.0, 6.0, 1.0, 1.0, 1.0]:
        updates, state = tx.update(jnp.array(grad), state, params)
        emitted.append(float(updates))
    # Zeros until the k-th call, then -lr * mean(1, 2, 6) = -3; then -mean(1, 1, 1) = -1.
    np.testing.assert_allclose(emitted, [0, 0, -3, 0, 0, -1])
    assert int(state.gradient_step) == 2 and bool(tx.has_updated(state))


def test_multisteps_equals_one_big_batch_step():
    w = jnp.array([0.5, -1.0])
    xs = jax.random.normal(jax.random.key(0), (4, 8, 2))
    loss = lambda w, x: jnp.mean((x @ w - 1.0) ** 2)  # noqa: E731
    big = optax.adam(0.1)
    big_updates, _ = big.update(jax.grad(loss)(w, xs.reshape(32, 2)), big.init(w), w)
    accumulate = optax.MultiSteps(optax.adam(0.1), every_k_schedule=4)
    state = accumulate.init(w)
    for x in xs:
        updates, state = accumulate.update(jax.grad(loss)(w, x), state, w)
    np.testing.assert_allclose(updates, big_updates, rtol=1e-5, atol=1e-6)


def test_inject_hyperparams_exposes_and_lets_you_change_the_learning_rate_without_recompiling():
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.0)
    params = jnp.ones(())
    state = tx.init(params)
    traces = []

    @jax.jit
    def step(params, state):
        traces.append(1)
        updates, state = tx.update(jnp.ones(()), state, params)
        return optax.apply_updates(params, updates), state

    params, state = step(params, state)
    np.testing.assert_allclose(state.hyperparams["learning_rate"], 0.1)
    # A strongly typed float32, like the value it replaces: a weakly typed jnp.asarray(0.5)
    # would be a different abstract value, and jit would trace again.
    state.hyperparams["learning_rate"] = jnp.asarray(0.5, jnp.float32)
    new_params, state = step(params, state)
    np.testing.assert_allclose(params - new_params, 0.5, rtol=1e-6)
    assert len(traces) == 1


def test_apply_updates_names_the_paths_that_differ():
    params = {"dense": {"kernel": jnp.ones(2), "bias": jnp.ones(2)}}
    updates = {"dense": {"kernel": jnp.ones(2), "scale": jnp.ones(2)}}
    with pytest.raises(ValueError, match=r"only in updates: \[\"\['dense'\]\['scale'\]\"\]") as error:
        optax.apply_updates(params, updates)
    assert "['dense']['bias']" in str(error.value)


def test_adam_update_with_a_different_tree_names_the_paths():
    tx = optax.adam(0.1)
    state = tx.init({"w": jnp.ones(2)})
    with pytest.raises(ValueError, match=r"\['v'\].*\['w'\]"):
        tx.update({"v": jnp.ones(2)}, state)


def test_a_chain_rejects_a_state_from_another_optimizer():
    with pytest.raises(ValueError, match="chain of 2 transformations got a state with 1"):
        optax.adam(0.1).update(jnp.ones(2), optax.sgd(0.1, momentum=0.9).init(jnp.ones(2))[:1])


def test_weight_decay_without_params_says_to_pass_them():
    tx = optax.adamw(0.1)
    with pytest.raises(ValueError, match="tx.update\\(grads, opt_state, params\\)"):
        tx.update(jnp.ones(2), tx.init(jnp.ones(2)))


def test_unsupported_options_fail_loudly():
    with pytest.raises(NotImplementedError, match="centered"):
        optax.rmsprop(0.1, centered=True)
    with pytest.raises(NotImplementedError, match="should_skip_update_fn"):
        optax.MultiSteps(optax.sgd(0.1), 2, should_skip_update_fn=lambda *a: None)
    with pytest.raises(ValueError, match="decay_steps > 0"):
        optax.cosine_decay_schedule(1.0, 0)
