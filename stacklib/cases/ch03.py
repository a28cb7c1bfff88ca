"""Chapter 03's exercises: scale_by_adam, a warm-up-cosine schedule, clipping, accumulation.

Each answer is compared with optax on the same inputs. Answers must be written with
`jax.numpy` so that they also work on traced values under `jax.jit`, which the last case
of each exercise checks. Expected values are computed first, and `init` and `update` get
copies of the trees they are given (`call_on_copies`): an update that writes into the
caller's dict of gradients is told so.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax

import stacklib.optim as ours
from stacklib.grading import Exercise, call_on_copies, expect, expect_close


def _random_tree(seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.normal(size=(3, 4)), dtype), "b": jnp.asarray(rng.normal(size=4), dtype)}


def _state_paths(tree):
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


# The exercises are to write these transformations: one that hands back the library's own
# (optax's, or stacklib.optim's, which mirrors it) learns nothing and earns nothing.
_LIBRARIES = ("optax", "stacklib.optim")


def _expect_written_here(function, what: str) -> None:
    module = getattr(inspect.unwrap(getattr(function, "func", function)), "__module__", None) or ""
    expect(not module.startswith(_LIBRARIES),
           f"{what} is {module}'s own: the exercise is to write it, with jax.numpy and jax.tree.map",
           hint="")


def _init(tx, params):
    _expect_written_here(tx.init, "init")
    _expect_written_here(tx.update, "update")
    return call_on_copies(tx.init, params, what="init")


def _update(tx, updates, state, params=None, *, jit=False):
    _expect_written_here(tx.update, "update")
    update = jax.jit(tx.update) if jit else tx.update
    if params is None:
        return call_on_copies(update, updates, state, what="update")
    return call_on_copies(update, updates, state, params, what="update")


# -- 03.scale_by_adam -------------------------------------------------------------------------

adam = Exercise("03.scale_by_adam", "scale_by_adam")


@adam.case(points=2, hint="init returns ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros like "
                          "params, nu=zeros like params).")
def init_returns_count_and_zero_moments(scale_by_adam):
    params = _random_tree(0)
    expected_paths = _state_paths(optax.scale_by_adam().init(params))
    zeros = jax.tree.map(np.zeros_like, params)
    state = _init(scale_by_adam(), params)
    expect(_state_paths(state) == expected_paths,
           f"state paths {_state_paths(state)}, expected {expected_paths}")
    count = state.count
    expect(getattr(count, "dtype", None) == jnp.int32 and np.shape(count) == () and int(count) == 0,
           f"count is {count!r} ({type(count).__name__}): init must return count = jnp.zeros([], jnp.int32), "
           "an int32 array of shape (), not a Python number or a float")
    expect_close(state.mu, zeros, what="mu")
    expect_close(state.nu, zeros, what="nu")


@adam.case(hint="Divide m and v by (1 - b1**t) and (1 - b2**t) with t the new count (1 on the first "
                "step): then the first update is g / (|g| + eps).")
def first_update_is_bias_corrected(scale_by_adam):
    grads = _random_tree(1)
    expected, _ = optax.scale_by_adam().update(grads, optax.scale_by_adam().init(grads))
    tx = scale_by_adam()
    updates, _ = _update(tx, grads, _init(tx, grads))
    expect_close(updates, expected, rtol=1e-5, atol=1e-6, what="the first update")


@adam.case(points=2, hint="u = m_hat / (sqrt(v_hat) + eps): eps outside the square root; keep count, "
                          "mu and nu in the returned state.")
def matches_optax_for_30_steps_in_float64(scale_by_adam):
    with jax.enable_x64(True):
        options = dict(b1=0.8, b2=0.95, eps=1e-3)  # a large eps tells inside from outside the root
        mine, theirs = scale_by_adam(**options), optax.scale_by_adam(**options)
        params = _random_tree(2, jnp.float64)
        my_state, their_state = _init(mine, params), theirs.init(params)
        for step in range(30):  # b2 = 0.95: the bias correction still matters at step 30
            grads = _random_tree(100 + step, jnp.float64)
            their_updates, their_state = theirs.update(grads, their_state)
            my_updates, my_state = _update(mine, grads, my_state)
        expect_close(my_updates, their_updates, rtol=1e-10, atol=1e-12, what="the 30th update")
        expect_close(my_state.nu, their_state.nu, rtol=1e-10, atol=1e-12, what="nu after 30 steps")


@adam.case(points=2, hint="Use jax.numpy and jax.tree.map only: no Python conditionals on the count, and no "
                          "int(count) or float(count), which need a value that a traced count does not have. "
                          "The returned state holds the new count: 3 after three steps.")
def works_under_jit(scale_by_adam):
    tx = scale_by_adam()
    params = _random_tree(3)
    state = _init(tx, params)
    for _ in range(3):
        updates, state = _update(tx, params, state, jit=True)
    expect(int(state.count) == 3, f"count after 3 jitted steps is {int(state.count)}")


# -- 03.warmup_cosine -------------------------------------------------------------------------

warmup_cosine = Exercise("03.warmup_cosine", "A warm-up-cosine learning-rate schedule")


@warmup_cosine.case(hint="init_value at step 0, peak_value at warmup_steps, end_value from decay_steps on.")
def hits_the_landmarks(make_schedule):
    schedule = make_schedule(0.0, 1.0, 10, 100, 0.1)
    _expect_written_here(schedule, "the schedule")
    got = [float(schedule(step)) for step in (0, 5, 10, 100, 150)]
    expect_close(got, [0.0, 0.5, 1.0, 0.1, 0.1], rtol=1e-5, atol=1e-6,
                 what="values at steps 0, 5, 10, 100, 150")


@warmup_cosine.case(points=2, hint="Some steps differ from optax: check that the warm-up starts at "
                                   "init_value, that decay_steps counts the warm-up too (T = decay_steps "
                                   "- warmup_steps), and that t is clipped to [0, T], as in the formula.")
def matches_optax_at_every_step(make_schedule):
    for args in [(0.0, 1.0, 10, 100, 0.1), (1e-4, 3e-3, 50, 300, 0.0)]:
        schedule, reference = make_schedule(*args), optax.warmup_cosine_decay_schedule(*args)
        _expect_written_here(schedule, "the schedule")
        steps = np.arange(0, args[3] + 20)
        got = np.array([float(schedule(int(step))) for step in steps])
        expected = np.array([float(reference(int(step))) for step in steps])
        expect_close(got, expected, rtol=1e-5, atol=1e-7, what=f"schedule{args} over steps 0..{args[3] + 19}")


@warmup_cosine.case(points=2, hint="The step is a traced array under jit: combine the two phases with "
                                   "jnp.where, not a Python `if`. (If a case above fails too, fix it first: "
                                   "this one runs the same kind of input under jit.)")
def works_on_traced_step_counts(make_schedule):
    schedule = make_schedule(0.0, 1.0, 10, 100, 0.1)
    _expect_written_here(schedule, "the schedule")
    got = jax.jit(jax.vmap(schedule))(jnp.arange(120))
    expect_close(got, jax.vmap(optax.warmup_cosine_decay_schedule(0.0, 1.0, 10, 100, 0.1))(jnp.arange(120)),
                 rtol=1e-5, atol=1e-7, what="the schedule on jnp.arange(120) under jit(vmap)")


# -- 03.clip_by_global_norm -------------------------------------------------------------------

clip = Exercise("03.clip_by_global_norm", "Clipping by the global norm")


def _global_norm(tree):
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree))))


@clip.case(points=2, hint="The norm is over all leaves together: sqrt(sum of every leaf's sum of squares). "
                          "Scale every leaf by max_norm / norm.")
def shortens_long_updates_to_max_norm_keeping_direction(clip_by_global_norm):
    grads = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([[4.0]])}  # global norm 5; leaf norms 3 and 4
    expected = {"a": np.array([0.6, 0.0]), "b": np.array([[0.8]])}
    tx = clip_by_global_norm(1.0)
    clipped, _ = _update(tx, grads, _init(tx, grads))
    expect_close(_global_norm(clipped), 1.0, rtol=1e-5, what="the global norm after clipping")
    expect_close(clipped, expected, rtol=1e-5, what="the clipped tree")


# An all-zero update (a frozen layer, a batch that masks everything) has norm 0, below any
# max_norm: it must come back as zeros. g / norm * min(norm, max_norm) gives 0 / 0 = NaN there.
@clip.case(points=2, hint="Leave updates whose global norm is below max_norm exactly as they are, including "
                          "an all-zero update, whose norm is 0: nothing may divide by that norm unless it is "
                          "chosen.")
def leaves_short_updates_alone_even_all_zero_ones(clip_by_global_norm):
    tx = clip_by_global_norm(1.0)
    grads = {"a": jnp.array([0.3, 0.0]), "b": jnp.array([[0.4]])}
    expected = {"a": np.array([0.3, 0.0]), "b": np.array([[0.4]])}
    unchanged, _ = _update(tx, grads, _init(tx, grads))
    expect_close(unchanged, expected, rtol=1e-6, atol=0)
    zeros = {"a": jnp.zeros(2), "b": jnp.zeros((1, 1))}
    unchanged, _ = _update(tx, zeros, _init(tx, zeros))
    expect_close(unchanged, jax.tree.map(np.asarray, zeros), rtol=0, atol=0, what="an all-zero update")


@clip.case(points=2, hint="Under jit the norm is a traced value: a Python `if`, min() or float() on it "
                          "cannot work, so choose with jax.numpy (the note above the exercises). (If a case "
                          "above fails too, fix it first: this one runs the same kind of input under jit.)")
def matches_optax_under_jit(clip_by_global_norm):
    for seed, max_norm in [(0, 0.5), (1, 100.0)]:
        grads = _random_tree(seed)
        expected, _ = optax.clip_by_global_norm(max_norm).update(grads, ())
        tx = clip_by_global_norm(max_norm)
        got, _ = _update(tx, grads, _init(tx, grads), jit=True)
        expect_close(got, expected, rtol=1e-5, atol=1e-6, what=f"clipping to {max_norm}")


# -- 03.accumulate ----------------------------------------------------------------------------

accumulate = Exercise("03.accumulate", "Gradient accumulation over k mini-batches")


@accumulate.case(points=2, hint="Keep a running mean of the gradients and a mini-step counter in the state; "
                                "on the k-th call return inner.update(mean, ...), otherwise zeros.")
def returns_zeros_then_the_inner_update_of_the_mean(accumulate_gradients):
    tx = accumulate_gradients(ours.sgd(1.0), 3)
    params = jnp.zeros(2)
    state = _init(tx, params)
    emitted = []
    for grad in [[1.0, 0.0], [2.0, 3.0], [6.0, 0.0]]:
        updates, state = _update(tx, jnp.array(grad), state, params)
        emitted.append(np.asarray(updates))
    expect_close(np.stack(emitted), np.array([[0.0, 0.0], [0.0, 0.0], [-3.0, -1.0]]), rtol=1e-6,
                 what="the three updates")


@accumulate.case(hint="After the k-th call reset the counter and the accumulator, ready for the next k.")
def starts_over_after_each_step(accumulate_gradients):
    tx = accumulate_gradients(ours.sgd(1.0), 2)
    params = jnp.zeros(())
    state = _init(tx, params)
    emitted = []
    for grad in [1.0, 3.0, 10.0, 20.0]:
        updates, state = _update(tx, jnp.array(grad), state, params)
        emitted.append(float(updates))
    expect_close(emitted, [0.0, -2.0, 0.0, -15.0], rtol=1e-6, what="four updates with k=2")
    # k = 1, the edge where every call is the k-th: no call returns zeros.
    tx = accumulate_gradients(ours.sgd(1.0), 1)
    state = _init(tx, params)
    emitted = []
    for grad in [1.0, 3.0]:
        updates, state = _update(tx, jnp.array(grad), state, params)
        emitted.append(float(updates))
    expect_close(emitted, [-1.0, -3.0], rtol=1e-6, what="two updates with k=1",
                 hint="With k = 1 every call is the k-th: each one steps with its own gradient.")


@accumulate.case(points=2, hint="The inner optimizer must see only the mean gradient, once per k calls, with "
                                "the params passed on (weight decay reads them), and keep its state "
                                "unchanged in between.")
def equals_one_big_batch_step_of_momentum_with_weight_decay(accumulate_gradients):
    w = jnp.array([0.5, -1.0, 2.0])
    x = jax.random.normal(jax.random.key(0), (32, 3))
    loss = lambda w, x: jnp.mean((x @ w - 1.0) ** 2)  # noqa: E731
    # SGD with momentum: stateful, and (unlike Adam) not blind to the gradient's scale. Weight
    # decay needs the params: an update that does not pass them on fails here.
    big = optax.chain(optax.add_decayed_weights(0.01), optax.sgd(0.1, momentum=0.9))
    expected = []
    big_state = big.init(w)
    tx = accumulate_gradients(ours.chain(ours.add_decayed_weights(0.01), ours.sgd(0.1, momentum=0.9)), 4)
    state = _init(tx, w)
    for half in x.reshape(2, 16, 3):
        step, big_state = big.update(jax.grad(loss)(w, half), big_state, w)
        expected.append(np.asarray(step))
        for chunk in half.reshape(4, 4, 3):
            updates, state = _update(tx, jax.grad(loss)(w, chunk), state, w)
        expect_close(updates, expected[-1], rtol=1e-5, atol=1e-6, what=f"accumulated step {len(expected)}")


# The state is the learner's own NamedTuple, so its counter's type is theirs too: a Python int 0
# from `init` is accepted on purpose (the first update, eager or jitted, returns an int32 array,
# and jit does not retrace for it), unlike scale_by_adam's count, whose type optax's state fixes.
@accumulate.case(points=2, hint="Under jit the counter is traced: compute both branches and select with "
                                "jnp.where (or jax.lax.cond); a Python `if` on it cannot work. The 4th call "
                                "with k=2 must step. (If a case above fails too, fix it first: this one runs "
                                "the same kind of input under jit.)")
def compiles_once_under_jit(accumulate_gradients):
    tx = accumulate_gradients(ours.adam(0.1), 2)
    params = jnp.ones(3)
    state = _init(tx, params)
    traces = []

    def update(grads, state, params):
        traces.append(1)
        return tx.update(grads, state, params)

    jitted = jax.jit(update)
    for _ in range(4):
        updates, state = jitted(jnp.ones(3), state, params)
    expect(len(traces) == 1, f"jit traced {len(traces)} times")
    expect(bool(jnp.any(updates != 0)), "the 4th call (k=2) should have returned a non-zero update")
