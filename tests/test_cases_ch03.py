"""Chapter 03's exercise cases: right answers score full marks, planted wrong ones lose points."""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stacklib.optim as optax
from stacklib.grading import grade


def scale_by_adam(b1=0.9, b2=0.999, eps=1e-8):
    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros, nu=zeros)

    def update(updates, state, params=None):
        mu = jax.tree.map(lambda g, m: (1 - b1) * g + b1 * m, updates, state.mu)
        nu = jax.tree.map(lambda g, v: (1 - b2) * g**2 + b2 * v, updates, state.nu)
        count = state.count + 1
        updates = jax.tree.map(
            lambda m, v: (m / (1 - b1**count)) / (jnp.sqrt(v / (1 - b2**count)) + eps), mu, nu
        )
        return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


def warmup_cosine(init_value, peak_value, warmup_steps, decay_steps, end_value=0.0):
    def schedule(step):
        warm = init_value + (peak_value - init_value) * jnp.clip(step, 0, warmup_steps) / warmup_steps
        t = jnp.clip(step - warmup_steps, 0, decay_steps - warmup_steps)
        alpha = end_value / peak_value
        cosine = 0.5 * (1 + jnp.cos(jnp.pi * t / (decay_steps - warmup_steps)))
        return jnp.where(step < warmup_steps, warm, peak_value * ((1 - alpha) * cosine + alpha))

    return schedule


def global_norm(tree):
    return jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(tree)))


def clip_by_global_norm(max_norm):
    def update(updates, state, params=None):
        norm = global_norm(updates)
        factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda g: g * factor, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


class AccumulateState(NamedTuple):
    mini_step: jax.Array
    mean: optax.Updates
    inner_state: optax.OptState


def _select(condition, new, old):
    return jax.tree.map(lambda n, o: jnp.where(condition, n, o), new, old)


def accumulate_gradients(inner, k):
    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return AccumulateState(jnp.zeros([], jnp.int32), zeros, inner.init(params))

    def update(updates, state, params=None):
        mean = jax.tree.map(lambda m, g: m + (g - m) / (state.mini_step + 1), state.mean, updates)
        inner_updates, inner_state = inner.update(mean, state.inner_state, params)
        emit = state.mini_step == k - 1
        new_state = AccumulateState(
            mini_step=jnp.where(emit, 0, state.mini_step + 1),
            mean=jax.tree.map(lambda m: jnp.where(emit, jnp.zeros_like(m), m), mean),
            inner_state=_select(emit, inner_state, state.inner_state),
        )
        return jax.tree.map(lambda u: jnp.where(emit, u, jnp.zeros_like(u)), inner_updates), new_state

    return optax.GradientTransformation(init, update)


RIGHT = {
    "03.scale_by_adam": scale_by_adam,
    "03.warmup_cosine": warmup_cosine,
    "03.clip_by_global_norm": clip_by_global_norm,
    "03.accumulate": accumulate_gradients,
}


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_a_right_answer_scores_full_marks(exercise_id):
    result = grade(exercise_id, RIGHT[exercise_id])
    assert result.points == result.max_points, [(c.name, c.message) for c in result.cases]


def adam_without_bias_correction(b1=0.9, b2=0.999, eps=1e-8):
    def update(updates, state, params=None):
        mu = jax.tree.map(lambda g, m: (1 - b1) * g + b1 * m, updates, state.mu)
        nu = jax.tree.map(lambda g, v: (1 - b2) * g**2 + b2 * v, updates, state.nu)
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
        return updates, optax.ScaleByAdamState(count=state.count + 1, mu=mu, nu=nu)

    return optax.GradientTransformation(scale_by_adam().init, update)


def adam_eps_inside_the_root(b1=0.9, b2=0.999, eps=1e-8):
    def update(updates, state, params=None):
        mu = jax.tree.map(lambda g, m: (1 - b1) * g + b1 * m, updates, state.mu)
        nu = jax.tree.map(lambda g, v: (1 - b2) * g**2 + b2 * v, updates, state.nu)
        count = state.count + 1
        updates = jax.tree.map(
            lambda m, v: (m / (1 - b1**count)) / jnp.sqrt(v / (1 - b2**count) + eps), mu, nu
        )
        return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(scale_by_adam().init, update)


def adam_count_not_stored(b1=0.9, b2=0.999, eps=1e-8):
    right = scale_by_adam(b1, b2, eps)

    def update(updates, state, params=None):
        updates, new_state = right.update(updates, state, params)
        return updates, new_state._replace(count=state.count)  # forgets to keep the new count

    return optax.GradientTransformation(right.init, update)


def warmup_cosine_too_long(init_value, peak_value, warmup_steps, decay_steps, end_value=0.0):
    return warmup_cosine(init_value, peak_value, warmup_steps, decay_steps + warmup_steps, end_value)


def warmup_cosine_python_if(init_value, peak_value, warmup_steps, decay_steps, end_value=0.0):
    def schedule(step):
        if step < warmup_steps:
            return init_value + (peak_value - init_value) * step / warmup_steps
        return warmup_cosine(init_value, peak_value, warmup_steps, decay_steps, end_value)(step)

    return schedule


def clip_each_leaf(max_norm):
    def update(updates, state, params=None):
        def clip(g):
            norm = jnp.sqrt(jnp.sum(g**2))
            return g * jnp.where(norm < max_norm, 1.0, max_norm / norm)

        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def always_rescale(max_norm):
    def update(updates, state, params=None):
        return jax.tree.map(lambda g: g * max_norm / global_norm(updates), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def accumulate_sum(inner, k):
    def update(updates, state, params=None):
        total = jax.tree.map(lambda m, g: m + g, state.mean, updates)
        inner_updates, inner_state = inner.update(total, state.inner_state, params)
        emit = state.mini_step == k - 1
        new_state = AccumulateState(
            mini_step=jnp.where(emit, 0, state.mini_step + 1),
            mean=jax.tree.map(lambda m: jnp.where(emit, jnp.zeros_like(m), m), total),
            inner_state=_select(emit, inner_state, state.inner_state),
        )
        return jax.tree.map(lambda u: jnp.where(emit, u, jnp.zeros_like(u)), inner_updates), new_state

    return optax.GradientTransformation(accumulate_gradients(inner, k).init, update)


def accumulate_python_if(inner, k):
    def update(updates, state, params=None):
        mean = jax.tree.map(lambda m, g: m + (g - m) / (state.mini_step + 1), state.mean, updates)
        if state.mini_step == k - 1:
            inner_updates, inner_state = inner.update(mean, state.inner_state, params)
            zeros = jax.tree.map(jnp.zeros_like, mean)
            return inner_updates, AccumulateState(jnp.zeros([], jnp.int32), zeros, inner_state)
        zeros = jax.tree.map(jnp.zeros_like, updates)
        return zeros, AccumulateState(state.mini_step + 1, mean, state.inner_state)

    return optax.GradientTransformation(accumulate_gradients(inner, k).init, update)


def accumulate_without_reset(inner, k):
    def update(updates, state, params=None):
        mean = jax.tree.map(lambda m, g: m + (g - m) / (state.mini_step + 1), state.mean, updates)
        inner_updates, inner_state = inner.update(mean, state.inner_state, params)
        emit = state.mini_step % k == k - 1
        new_state = AccumulateState(
            mini_step=state.mini_step + 1,  # never reset: the mean keeps averaging over all calls
            mean=mean,
            inner_state=_select(emit, inner_state, state.inner_state),
        )
        return jax.tree.map(lambda u: jnp.where(emit, u, jnp.zeros_like(u)), inner_updates), new_state

    return optax.GradientTransformation(accumulate_gradients(inner, k).init, update)


def adam_with_scalar_zero_moments(b1=0.9, b2=0.999, eps=1e-8):
    def init(params):  # jnp.zeros(()) where zeros_like was meant: broadcasting hides it in update
        zeros = jax.tree.map(lambda p: jnp.zeros(()), params)
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros, nu=zeros)

    return optax.GradientTransformation(init, scale_by_adam(b1, b2, eps).update)


def adam_storing_corrected_moments(b1=0.9, b2=0.999, eps=1e-8):
    def update(updates, state, params=None):
        count = state.count + 1
        mu = jax.tree.map(lambda g, m: ((1 - b1) * g + b1 * m) / (1 - b1**count), updates, state.mu)
        nu = jax.tree.map(lambda g, v: ((1 - b2) * g**2 + b2 * v) / (1 - b2**count), updates, state.nu)
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
        return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)  # the corrected moments

    return optax.GradientTransformation(scale_by_adam().init, update)


def adam_with_a_python_count(b1=0.9, b2=0.999, eps=1e-8):
    right = scale_by_adam(b1, b2, eps)

    def update(updates, state, params=None):
        count = int(state.count) + 1  # a value a traced count does not have
        return right.update(updates, state._replace(count=jnp.asarray(count - 1, jnp.int32)), params)

    return optax.GradientTransformation(right.init, update)


def warmup_from_zero(init_value, peak_value, warmup_steps, decay_steps, end_value=0.0):
    return warmup_cosine(0.0, peak_value, warmup_steps, decay_steps, end_value)  # ignores init_value


def warmup_cosine_without_the_floor(init_value, peak_value, warmup_steps, decay_steps, end_value=0.0):
    def schedule(step):
        warm = init_value + (peak_value - init_value) * step / warmup_steps
        t = step - warmup_steps  # not clipped: past decay_steps the cosine comes back up
        alpha = end_value / peak_value
        cosine = 0.5 * (1 + jnp.cos(jnp.pi * t / (decay_steps - warmup_steps)))
        return jnp.where(step < warmup_steps, warm, peak_value * ((1 - alpha) * cosine + alpha))

    return schedule


def clip_by_the_squared_norm(max_norm):
    def update(updates, state, params=None):
        squared = sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(updates))  # no square root
        factor = jnp.where(squared < max_norm, 1.0, max_norm / squared)
        return jax.tree.map(lambda g: g * factor, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def clip_into_the_callers_dict(max_norm):
    def update(updates, state, params=None):
        norm = global_norm(updates)
        factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        for key in updates:  # right numbers, written into the caller's gradients
            updates[key] = updates[key] * factor
        return updates, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def accumulate_stepping_inner_every_call(inner, k):
    def update(updates, state, params=None):
        mean = jax.tree.map(lambda m, g: m + (g - m) / (state.mini_step + 1), state.mean, updates)
        inner_updates, inner_state = inner.update(mean, state.inner_state, params)
        emit = state.mini_step == k - 1
        new_state = AccumulateState(
            mini_step=jnp.where(emit, 0, state.mini_step + 1),
            mean=jax.tree.map(lambda m: jnp.where(emit, jnp.zeros_like(m), m), mean),
            inner_state=inner_state,  # momentum advances on every mini-batch
        )
        return jax.tree.map(lambda u: jnp.where(emit, u, jnp.zeros_like(u)), inner_updates), new_state

    return optax.GradientTransformation(accumulate_gradients(inner, k).init, update)


def adam_with_a_python_zero_count(b1=0.9, b2=0.999, eps=1e-8):
    right = scale_by_adam(b1, b2, eps)

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return optax.ScaleByAdamState(count=0, mu=zeros, nu=zeros)  # a Python int, not an int32 array

    return optax.GradientTransformation(init, right.update)


def adam_with_a_float_count(b1=0.9, b2=0.999, eps=1e-8):
    right = scale_by_adam(b1, b2, eps)

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return optax.ScaleByAdamState(count=jnp.zeros([]), mu=zeros, nu=zeros)  # float32

    return optax.GradientTransformation(init, right.update)


def _adam_update_with(step):
    """An Adam whose update computes the new moments as written, then the update with `step`."""

    def make(b1=0.9, b2=0.999, eps=1e-8):
        def update(updates, state, params=None):
            mu = jax.tree.map(lambda g, m: (1 - b1) * g + b1 * m, updates, state.mu)
            nu = jax.tree.map(lambda g, v: (1 - b2) * g**2 + b2 * v, updates, state.nu)
            new_updates = step(mu, nu, state, b1, b2, eps)
            return new_updates, optax.ScaleByAdamState(count=state.count + 1, mu=mu, nu=nu)

        return optax.GradientTransformation(scale_by_adam().init, update)

    return make


def _corrected(m, v, t, b1, b2, eps):
    return (m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps)


# t = the old count: 1 - b**0 = 0 on the first step, and a division by zero
adam_correcting_with_the_old_count = _adam_update_with(
    lambda mu, nu, state, b1, b2, eps: jax.tree.map(
        lambda m, v: _corrected(m, v, state.count, b1, b2, eps), mu, nu))
adam_updating_with_the_old_moments = _adam_update_with(
    lambda mu, nu, state, b1, b2, eps: jax.tree.map(
        lambda m, v: _corrected(m, v, state.count + 1, b1, b2, eps), state.mu, state.nu))
# the paper's "efficient" form: eps is added before the second moment is bias-corrected
adam_in_the_papers_efficient_form = _adam_update_with(
    lambda mu, nu, state, b1, b2, eps: jax.tree.map(
        lambda m, v: m / (jnp.sqrt(v) + eps) * jnp.sqrt(1 - b2 ** (state.count + 1))
        / (1 - b1 ** (state.count + 1)), mu, nu))


def adam_ignoring_its_arguments(b1=0.9, b2=0.999, eps=1e-8):
    return scale_by_adam()


def warmup_reaching_the_peak_a_step_early(init_value, peak_value, warmup_steps, decay_steps, end_value=0.0):
    right = warmup_cosine(init_value, peak_value, warmup_steps, decay_steps, end_value)

    def schedule(step):
        warm = init_value + (peak_value - init_value) * step / (warmup_steps - 1)
        return jnp.where(step < warmup_steps, warm, right(step))

    return schedule


def warmup_cosine_decaying_to_zero(init_value, peak_value, warmup_steps, decay_steps, end_value=0.0):
    return warmup_cosine(init_value, peak_value, warmup_steps, decay_steps, 0.0)  # ignores end_value


def warmup_cosine_over_a_full_period(init_value, peak_value, warmup_steps, decay_steps, end_value=0.0):
    def schedule(step):
        t = jnp.clip(step - warmup_steps, 0, decay_steps - warmup_steps)
        alpha = end_value / peak_value
        cosine = 0.5 * (1 + jnp.cos(2 * jnp.pi * t / (decay_steps - warmup_steps)))  # back up to the peak
        warm = init_value + (peak_value - init_value) * step / warmup_steps
        return jnp.where(step < warmup_steps, warm, peak_value * ((1 - alpha) * cosine + alpha))

    return schedule


def warmup_cosine_with_math(init_value, peak_value, warmup_steps, decay_steps, end_value=0.0):
    def schedule(step):
        if step < warmup_steps:  # a Python if and math.cos: right values, but not traceable
            return init_value + (peak_value - init_value) * step / warmup_steps
        t = min(step - warmup_steps, decay_steps - warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * t / (decay_steps - warmup_steps)))
        return end_value + (peak_value - end_value) * cosine

    return schedule


def _clip_with(norm_of, scale):
    def make(max_norm):
        def update(updates, state, params=None):
            norm = norm_of(updates)
            return jax.tree.map(lambda g: scale(g, norm, max_norm), updates), state

        return optax.GradientTransformation(lambda params: optax.EmptyState(), update)

    return make


def _shrink(g, norm, max_norm):
    return g * jnp.minimum(1.0, max_norm / norm)


clip_each_element = _clip_with(global_norm, lambda g, norm, max_norm: jnp.clip(g, -max_norm, max_norm))
clip_by_the_sum_of_leaf_norms = _clip_with(
    lambda tree: sum(jnp.sqrt(jnp.sum(leaf**2)) for leaf in jax.tree.leaves(tree)), _shrink)
clip_by_the_first_leafs_norm = _clip_with(
    lambda tree: jnp.sqrt(jnp.sum(jax.tree.leaves(tree)[0] ** 2)), _shrink)
clip_by_the_root_of_summed_means = _clip_with(
    lambda tree: jnp.sqrt(sum(jnp.mean(leaf**2) for leaf in jax.tree.leaves(tree))), _shrink)
# g / norm * min(norm, max_norm): right, except that an all-zero update becomes 0 / 0 = NaN
clip_normalising_first = _clip_with(
    global_norm, lambda g, norm, max_norm: g / norm * jnp.minimum(norm, max_norm))


def clip_with_a_python_if(max_norm):
    def update(updates, state, params=None):
        norm = global_norm(updates)
        if norm > max_norm:  # fine on concrete values, not on a traced norm
            return jax.tree.map(lambda g: g * max_norm / norm, updates), state
        return updates, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _accumulate_with(*, inner_gets=lambda mean, updates: mean, pass_params=True, emit=None,
                     zeros_in_between=True, mean_step=lambda m, g, n: m + (g - m) / (n + 1)):
    """accumulate_gradients with one step replaced."""

    def make(inner, k):
        def update(updates, state, params=None):
            mean = jax.tree.map(lambda m, g: mean_step(m, g, state.mini_step), state.mean, updates)
            extra = (params,) if pass_params else ()
            inner_updates, inner_state = inner.update(inner_gets(mean, updates), state.inner_state, *extra)
            if emit is not None:
                inner_updates = emit(inner_updates, mean)
            stepping = state.mini_step == k - 1
            new_state = AccumulateState(
                mini_step=jnp.where(stepping, 0, state.mini_step + 1),
                mean=jax.tree.map(lambda m: jnp.where(stepping, jnp.zeros_like(m), m), mean),
                inner_state=_select(stepping, inner_state, state.inner_state),
            )
            if zeros_in_between:
                inner_updates = jax.tree.map(lambda u: jnp.where(stepping, u, jnp.zeros_like(u)),
                                             inner_updates)
            return inner_updates, new_state

        return optax.GradientTransformation(accumulate_gradients(inner, k).init, update)

    return make


accumulate_without_passing_params = _accumulate_with(pass_params=False)
accumulate_returning_the_mean = _accumulate_with(emit=lambda inner_updates, mean: mean)
accumulate_passing_every_inner_update_through = _accumulate_with(zeros_in_between=False)
accumulate_dividing_by_the_old_count = _accumulate_with(mean_step=lambda m, g, n: m + (g - m) / n)
accumulate_stepping_on_the_last_gradient = _accumulate_with(inner_gets=lambda mean, updates: updates)


def accumulate_one_call_late(inner, k):
    right = accumulate_gradients(inner, k + 1)  # steps on call k + 1: off by one
    return optax.GradientTransformation(right.init, right.update)


# (exercise, planted wrong answer, points it should still get, why)
# Fresh wrong answers a learner writes (issue 38), the library class first: an answer that
# hands back the library's own transformation earns nothing.
import optax as real_optax  # noqa: E402


def adam_from_optax(b1=0.9, b2=0.999, eps=1e-8):
    return real_optax.scale_by_adam(b1=b1, b2=b2, eps=eps)


def adam_from_stacklib(b1=0.9, b2=0.999, eps=1e-8):
    return optax.scale_by_adam(b1=b1, b2=b2, eps=eps)


def adam_with_b1_and_b2_swapped(b1=0.9, b2=0.999, eps=1e-8):
    return scale_by_adam(b2, b1, eps)


def warmup_cosine_from_optax(init_value, peak_value, warmup_steps, decay_steps, end_value=0.0):
    return real_optax.warmup_cosine_decay_schedule(init_value, peak_value, warmup_steps, decay_steps,
                                                   end_value)


def warmup_then_linear_decay(init_value, peak_value, warmup_steps, decay_steps, end_value=0.0):
    def schedule(step):
        warm = init_value + (peak_value - init_value) * jnp.clip(step, 0, warmup_steps) / warmup_steps
        t = jnp.clip(step - warmup_steps, 0, decay_steps - warmup_steps) / (decay_steps - warmup_steps)
        return jnp.where(step < warmup_steps, warm, peak_value + (end_value - peak_value) * t)

    return schedule


def clip_from_optax(max_norm):
    return real_optax.clip_by_global_norm(max_norm)


def clip_by_the_largest_leaf_norm(max_norm):
    def update(updates, state, params=None):
        norm = jnp.max(jnp.stack([jnp.sqrt(jnp.sum(leaf**2)) for leaf in jax.tree.leaves(updates)]))
        factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda g: g * factor, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def accumulate_with_multisteps(inner, k):
    return real_optax.MultiSteps(inner, every_k_schedule=k).gradient_transformation()


def accumulate_stepping_on_the_first_call_of_each_group(inner, k):
    right = accumulate_gradients(inner, k)

    def update(updates, state, params=None):
        mean = jax.tree.map(lambda m, g: m + (g - m) / (state.mini_step + 1), state.mean, updates)
        inner_updates, inner_state = inner.update(mean, state.inner_state, params)
        emit = state.mini_step == 0  # the first call of a group, not the k-th
        new_state = AccumulateState(
            mini_step=(state.mini_step + 1) % k,
            mean=jax.tree.map(lambda m: jnp.where(emit, jnp.zeros_like(m), m), mean),
            inner_state=_select(emit, inner_state, state.inner_state),
        )
        return jax.tree.map(lambda u: jnp.where(emit, u, jnp.zeros_like(u)), inner_updates), new_state

    return optax.GradientTransformation(right.init, update)


def accumulate_counting_to_k_first(inner, k):
    right = accumulate_gradients(inner, k)

    def update(updates, state, params=None):
        mean = jax.tree.map(lambda m, g: m + (g - m) / (state.mini_step + 1), state.mean, updates)
        inner_updates, inner_state = inner.update(mean, state.inner_state, params)
        emit = (state.mini_step == k - 1) & (k > 1)  # written for k > 1: with k = 1 it never steps
        new_state = AccumulateState(
            mini_step=jnp.where(emit, 0, state.mini_step + 1),
            mean=jax.tree.map(lambda m: jnp.where(emit, jnp.zeros_like(m), m), mean),
            inner_state=_select(emit, inner_state, state.inner_state),
        )
        return jax.tree.map(lambda u: jnp.where(emit, u, jnp.zeros_like(u)), inner_updates), new_state

    return optax.GradientTransformation(right.init, update)


def adam_with_nu_of_the_absolute_gradient(b1=0.9, b2=0.999, eps=1e-8):
    def update(updates, state, params=None):
        mu = jax.tree.map(lambda g, m: (1 - b1) * g + b1 * m, updates, state.mu)
        nu = jax.tree.map(lambda g, v: (1 - b2) * jnp.abs(g) + b2 * v, updates, state.nu)  # |g|, not g**2
        count = state.count + 1
        updates = jax.tree.map(
            lambda m, v: (m / (1 - b1**count)) / (jnp.sqrt(v / (1 - b2**count)) + eps), mu, nu
        )
        return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(scale_by_adam(b1, b2, eps).init, update)


def warmup_cosine_with_t_the_step(init_value, peak_value, warmup_steps, decay_steps, end_value=0.0):
    def schedule(step):
        warm = init_value + (peak_value - init_value) * jnp.clip(step, 0, warmup_steps) / warmup_steps
        t = jnp.clip(step, 0, decay_steps - warmup_steps)  # the step itself, not step - warmup_steps
        alpha = end_value / peak_value
        cosine = 0.5 * (1 + jnp.cos(jnp.pi * t / (decay_steps - warmup_steps)))
        return jnp.where(step < warmup_steps, warm, peak_value * ((1 - alpha) * cosine + alpha))

    return schedule


def clip_with_numpys_norm(max_norm):
    def update(updates, state, params=None):
        norm = jnp.sqrt(sum(np.linalg.norm(leaf) ** 2 for leaf in jax.tree.leaves(updates)))  # untraceable
        factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda g: g * factor, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def accumulate_dividing_the_mean_by_k_again(inner, k):
    def inner_update_of_a_k_th(updates, state, params=None):  # loss / k, as in PyTorch, on top of the mean
        return inner.update(jax.tree.map(lambda g: g / k, updates), state, params)

    return accumulate_gradients(optax.GradientTransformation(inner.init, inner_update_of_a_k_th), k)


FRESH = [
    ("03.scale_by_adam", adam_from_optax, 0, "returns optax.scale_by_adam"),
    ("03.scale_by_adam", adam_from_stacklib, 0, "returns stacklib.optim.scale_by_adam"),
    ("03.scale_by_adam", adam_with_b1_and_b2_swapped, 4, "b1 and b2 swapped"),
    ("03.scale_by_adam", adam_with_nu_of_the_absolute_gradient, 4, "nu averages |g|, not g squared"),
    ("03.warmup_cosine", warmup_cosine_from_optax, 0, "returns optax's schedule"),
    ("03.warmup_cosine", warmup_then_linear_decay, 1, "a linear decay, not a cosine"),
    ("03.warmup_cosine", warmup_cosine_with_t_the_step, 0, "the cosine's t is the step, not step - warmup"),
    ("03.clip_by_global_norm", clip_from_optax, 0, "returns optax.clip_by_global_norm"),
    ("03.clip_by_global_norm", clip_by_the_largest_leaf_norm, 2, "the largest leaf's norm"),
    ("03.clip_by_global_norm", clip_with_numpys_norm, 4, "np.linalg.norm: fails under jit"),
    ("03.accumulate", accumulate_with_multisteps, 0, "returns optax.MultiSteps"),
    ("03.accumulate", accumulate_stepping_on_the_first_call_of_each_group, 0,
     "steps on a group's first call"),
    ("03.accumulate", accumulate_counting_to_k_first, 6, "never steps when k = 1"),
    ("03.accumulate", accumulate_dividing_the_mean_by_k_again, 2, "divides the mean by k again"),
]


WRONG = [
    ("03.scale_by_adam", adam_without_bias_correction, 4, "no bias correction"),
    ("03.scale_by_adam", adam_eps_inside_the_root, 5, "eps inside the square root"),
    ("03.scale_by_adam", adam_count_not_stored, 3, "keeps the old count in the state"),
    ("03.scale_by_adam", adam_with_scalar_zero_moments, 5, "zeros of shape () instead of zeros like params"),
    ("03.scale_by_adam", adam_storing_corrected_moments, 5, "stores the bias-corrected moments"),
    ("03.scale_by_adam", adam_with_a_python_count, 5, "int() of the traced count"),
    ("03.scale_by_adam", adam_with_a_python_zero_count, 5, "count = 0, a Python int"),
    ("03.scale_by_adam", adam_with_a_float_count, 5, "a float32 count"),
    ("03.scale_by_adam", adam_correcting_with_the_old_count, 4, "bias correction with the old count"),
    ("03.scale_by_adam", adam_updating_with_the_old_moments, 4, "the update from the old moments"),
    ("03.scale_by_adam", adam_in_the_papers_efficient_form, 5, "eps before the bias correction"),
    ("03.scale_by_adam", adam_ignoring_its_arguments, 5, "ignores b1, b2 and eps"),
    ("03.warmup_cosine", warmup_cosine_too_long, 0, "cosine over decay_steps instead of decay - warmup"),
    ("03.warmup_cosine", warmup_cosine_python_if, 3, "a Python if on the step"),
    ("03.warmup_cosine", warmup_from_zero, 3, "warms up from 0, not init_value"),
    ("03.warmup_cosine", warmup_cosine_without_the_floor, 0, "does not stay at end_value"),
    ("03.warmup_cosine", warmup_reaching_the_peak_a_step_early, 0, "reaches the peak at warmup_steps - 1"),
    ("03.warmup_cosine", warmup_cosine_decaying_to_zero, 0, "ignores end_value"),
    ("03.warmup_cosine", warmup_cosine_over_a_full_period, 0, "a whole cosine period, back up to the peak"),
    ("03.warmup_cosine", warmup_cosine_with_math, 3, "math.cos and a Python if"),
    ("03.clip_by_global_norm", clip_each_leaf, 2, "clips each leaf separately"),
    ("03.clip_by_global_norm", always_rescale, 2, "rescales short updates too"),
    ("03.clip_by_global_norm", clip_by_the_squared_norm, 2, "the squared norm, not the norm"),
    ("03.clip_by_global_norm", clip_into_the_callers_dict, 4, "writes into the caller's gradients"),
    ("03.clip_by_global_norm", clip_each_element, 2, "clips each element to [-max_norm, max_norm]"),
    ("03.clip_by_global_norm", clip_by_the_sum_of_leaf_norms, 2, "the sum of the leaves' norms"),
    ("03.clip_by_global_norm", clip_by_the_first_leafs_norm, 2, "the first leaf's norm only"),
    ("03.clip_by_global_norm", clip_by_the_root_of_summed_means, 2, "means of squares, not sums"),
    ("03.clip_by_global_norm", clip_normalising_first, 4, "g / norm * min(norm, max): NaN for a zero update"),
    ("03.clip_by_global_norm", clip_with_a_python_if, 4, "a Python if on the norm"),
    ("03.accumulate", accumulate_sum, 2, "sums instead of averaging"),
    ("03.accumulate", accumulate_python_if, 5, "a Python if on the traced counter"),
    ("03.accumulate", accumulate_without_reset, 4, "never resets the running mean"),
    ("03.accumulate", accumulate_stepping_inner_every_call, 5, "advances the inner state on every call"),
    ("03.accumulate", accumulate_one_call_late, 0, "steps one call late"),
    ("03.accumulate", accumulate_without_passing_params, 5, "does not pass params to the inner update"),
    ("03.accumulate", accumulate_returning_the_mean, 2, "returns the mean, not the inner update"),
    ("03.accumulate", accumulate_passing_every_inner_update_through, 4, "no zeros between steps"),
    ("03.accumulate", accumulate_dividing_by_the_old_count, 2, "divides by the old count, 0 at first"),
    ("03.accumulate", accumulate_stepping_on_the_last_gradient, 2, "steps on the last gradient only"),
    *FRESH,
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points


def test_an_update_that_writes_into_the_callers_gradients_is_told_so():
    result = grade("03.clip_by_global_norm", clip_into_the_callers_dict)
    failures = [c.message for c in result.cases if c.points < c.max_points]
    assert failures and all("changed its input in place" in message for message in failures), failures

