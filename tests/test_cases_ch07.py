"""Chapter 07's exercise cases: right answers score full marks, planted wrong ones lose points."""

import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from stacklib import parallel
from stacklib.grading import grade


def all_reduce_time(num_bytes, num_devices, bandwidth, latency):
    return 2 * (num_devices - 1) * (latency + num_bytes / num_devices / bandwidth)


def ring_all_gather(x, axis_name):
    return parallel.ring_all_gather(x, axis_name)


def linear_loss(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def sgd(params, grads, learning_rate):
    return jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)


def dp_sgd_step(params, x, y, learning_rate):
    loss, grads = jax.value_and_grad(lambda p: jax.lax.pmean(linear_loss(p, x, y), "data"))(params)
    return sgd(params, grads, learning_rate), loss


TP_SPECS = (P(), P(None, "model"), P("model"), P("model", None), P())


def tp_mlp(x, w1, b1, w2, b2, mesh):
    def local(x, w1, b1, w2, b2):
        return jax.lax.psum(jax.nn.relu(x @ w1 + b1) @ w2, "model") + b2

    return jax.shard_map(local, mesh=mesh, in_specs=TP_SPECS, out_specs=P())(x, w1, b1, w2, b2)


def gpipe_schedule(num_stages, num_microbatches):
    ticks = 2 * (num_microbatches + num_stages - 1)
    schedule = [[None] * num_stages for _ in range(ticks)]
    for stage in range(num_stages):
        for i in range(num_microbatches):
            schedule[stage + i][stage] = ("F", i)
            schedule[ticks - 1 - stage - i][stage] = ("B", i)
    return schedule


def bubble_fraction(schedule):
    slots = [action for row in schedule for action in row]
    return sum(action is None for action in slots) / len(slots)


RIGHT = {
    "07.all_reduce_time": all_reduce_time,
    "07.bubble_fraction": bubble_fraction,
    "07.gpipe_schedule": gpipe_schedule,
    "07.ring_all_gather": ring_all_gather,
    "07.dp_step": dp_sgd_step,
    "07.tp_mlp": tp_mlp,
}


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_a_right_answer_scores_full_marks(exercise_id):
    result = grade(exercise_id, RIGHT[exercise_id])
    assert result.points == result.max_points, [c.message for c in result.cases]


# ---- planted wrong answers
def gather_with_lax(x, axis_name):
    return jax.lax.all_gather(x, axis_name)


def gather_placed_backwards(x, axis_name):
    n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    blocks = jnp.zeros((n, *x.shape), x.dtype).at[me].set(x)
    for step in range(1, n):
        x = jax.lax.ppermute(x, axis_name, [(i, (i + 1) % n) for i in range(n)])
        blocks = blocks.at[(me + step) % n].set(x)  # should be me - step
    return blocks


def gather_for_four_devices(x, axis_name):
    me = jax.lax.axis_index(axis_name)
    blocks = jnp.zeros((4, *x.shape), x.dtype).at[me].set(x)
    for step in range(1, 4):
        x = jax.lax.ppermute(x, axis_name, [(i, (i + 1) % 4) for i in range(4)])
        blocks = blocks.at[(me - step) % 4].set(x)
    return blocks


def gather_tiled(x, axis_name):
    n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    blocks = jnp.zeros((n, *x.shape), x.dtype).at[me].set(x)
    for step in range(1, n):
        x = jax.lax.ppermute(x, axis_name, [(i, (i + 1) % n) for i in range(n)])
        blocks = blocks.at[(me - step) % n].set(x)
    return blocks.reshape(n * x.shape[0], *x.shape[1:])  # concatenated, not stacked


def dp_average_local_gradients(params, x, y, learning_rate):
    loss, grads = jax.value_and_grad(linear_loss)(params, x, y)
    return sgd(params, jax.lax.pmean(grads, "data"), learning_rate), jax.lax.pmean(loss, "data")


def dp_psum_over_eight(params, x, y, learning_rate):
    loss, grads = jax.value_and_grad(lambda p: jax.lax.psum(linear_loss(p, x, y), "data") / 8)(params)
    return sgd(params, grads, learning_rate), loss


def dp_psum_loss(params, x, y, learning_rate):
    loss, grads = jax.value_and_grad(lambda p: jax.lax.psum(linear_loss(p, x, y), "data"))(params)
    return sgd(params, grads, learning_rate), loss


def dp_wrong_sign(params, x, y, learning_rate):
    loss, grads = jax.value_and_grad(lambda p: jax.lax.pmean(linear_loss(p, x, y), "data"))(params)
    return sgd(params, grads, -learning_rate), loss  # climbs the loss


def dp_no_communication(params, x, y, learning_rate):
    loss, grads = jax.value_and_grad(linear_loss)(params, x, y)
    return sgd(params, grads, learning_rate), loss


def tp_bias_before_psum(x, w1, b1, w2, b2, mesh):
    def local(x, w1, b1, w2, b2):
        return jax.lax.psum(jax.nn.relu(x @ w1 + b1) @ w2 + b2, "model")  # b2 added N times

    return jax.shard_map(local, mesh=mesh, in_specs=TP_SPECS, out_specs=P())(x, w1, b1, w2, b2)


def tp_replicated(x, w1, b1, w2, b2, mesh):
    def local(x, w1, b1, w2, b2):
        return jax.nn.relu(x @ w1 + b1) @ w2 + b2

    return jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=P())(x, w1, b1, w2, b2)


def tp_gather_hidden(x, w1, b1, w2, b2, mesh):
    def local(x, w1, b1, w2, b2):
        h = jax.lax.all_gather(jax.nn.relu(x @ w1 + b1), "model", axis=1, tiled=True)
        return h @ w2 + b2

    specs = (P(), P(None, "model"), P("model"), P(), P())
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)(x, w1, b1, w2, b2)


def tp_row_parallel_first(x, w1, b1, w2, b2, mesh):
    def local(x, w1, b1, w2, b2):  # relu of partial sums: wrong
        return jax.lax.psum(jax.nn.relu(x @ w1 + b1 / 2) @ w2, "model") / 2 + b2

    specs = (P(None, "model"), P("model", None), P(), P(), P())
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P())(x, w1, b1, w2, b2)


def gather_into_a_float32_buffer(x, axis_name):
    n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    blocks = jnp.zeros((n, *x.shape)).at[me].set(x)  # float32, whatever x's dtype
    for step in range(1, n):
        x = jax.lax.ppermute(x, axis_name, [(i, (i + 1) % n) for i in range(n)])
        blocks = blocks.at[(me - step) % n].set(x)
    return blocks


def gather_with_psum(x, axis_name):
    n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    return jax.lax.psum(jnp.zeros((n, *x.shape), x.dtype).at[me].set(x), axis_name)


def gather_forwarding_its_own_block(x, axis_name):
    n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    blocks = jnp.zeros((n, *x.shape), x.dtype).at[me].set(x)
    for step in range(1, n):
        received = jax.lax.ppermute(x, axis_name, [(i, (i + 1) % n) for i in range(n)])  # x, every time
        blocks = blocks.at[(me - step) % n].set(received)
    return blocks


def dp_fixed_learning_rate(params, x, y, learning_rate):
    loss, grads = jax.value_and_grad(lambda p: jax.lax.pmean(linear_loss(p, x, y), "data"))(params)
    return sgd(params, grads, 0.05), loss


def dp_updates_only_w(params, x, y, learning_rate):
    loss, grads = jax.value_and_grad(lambda p: jax.lax.pmean(linear_loss(p, x, y), "data"))(params)
    return {"w": params["w"] - learning_rate * grads["w"], "b": params["b"]}, loss


def dp_loss_after_the_step(params, x, y, learning_rate):
    def global_loss(p):
        return jax.lax.pmean(linear_loss(p, x, y), "data")

    new_params = sgd(params, jax.grad(global_loss)(params), learning_rate)
    return new_params, global_loss(new_params)


def tp_pmean(x, w1, b1, w2, b2, mesh):
    def local(x, w1, b1, w2, b2):
        return jax.lax.pmean(jax.nn.relu(x @ w1 + b1) @ w2, "model") + b2  # a mean of partial sums

    return jax.shard_map(local, mesh=mesh, in_specs=TP_SPECS, out_specs=P())(x, w1, b1, w2, b2)


def tp_gather_the_weights(x, w1, b1, w2, b2, mesh):
    def local(x, w1, b1, w2, b2):
        w1 = jax.lax.all_gather(w1, "model", axis=1, tiled=True)
        b1 = jax.lax.all_gather(b1, "model", tiled=True)
        w2 = jax.lax.all_gather(w2, "model", axis=0, tiled=True)
        return jax.nn.relu(x @ w1 + b1) @ w2 + b2

    gathered = jax.shard_map(local, mesh=mesh, in_specs=TP_SPECS, out_specs=P(), check_vma=False)
    return gathered(x, w1, b1, w2, b2)


def tp_without_shard_map(x, w1, b1, w2, b2, mesh):
    def place(array, spec):
        return jax.lax.with_sharding_constraint(array, NamedSharding(mesh, spec))

    w1, b1, w2 = place(w1, P(None, "model")), place(b1, P("model")), place(w2, P("model", None))
    return jax.nn.relu(x @ w1 + b1) @ w2 + b2  # the compiler partitions it: right, but not the exercise


def gpipe_placed_by(forward_tick, backward_tick, num_ticks):
    """A GPipe-like table with forward i of stage s at forward_tick(s, i, p, m), and so on."""

    def schedule_fn(p, m):
        schedule = [[None] * p for _ in range(num_ticks(p, m))]
        for s in range(p):
            for i in range(m):
                schedule[forward_tick(s, i, p, m)][s] = ("F", i)
                if backward_tick is not None:
                    schedule[backward_tick(s, i, p, m)][s] = ("B", i)
        return schedule

    return schedule_fn


mirror = lambda s, i, p, m: 2 * (m + p - 1) - 1 - s - i  # noqa: E731
gpipe_backwards_in_forward_order = gpipe_placed_by(
    lambda s, i, p, m: s + i, lambda s, i, p, m: m + p - 1 + (p - 1 - s) + i, lambda p, m: 2 * (m + p - 1))
gpipe_without_the_staircase = gpipe_placed_by(lambda s, i, p, m: i, mirror, lambda p, m: 2 * (m + p - 1))
gpipe_backwards_a_tick_late = gpipe_placed_by(
    lambda s, i, p, m: s + i, lambda s, i, p, m: mirror(s, i, p, m) + 1, lambda p, m: 2 * (m + p - 1) + 1)
gpipe_forwards_only = gpipe_placed_by(lambda s, i, p, m: s + i, None, lambda p, m: m + p - 1)
gpipe_first_stage_starts_the_backward = gpipe_placed_by(
    lambda s, i, p, m: s + i, lambda s, i, p, m: m + p - 1 + s + (m - 1 - i), lambda p, m: 2 * (m + p - 1))
gpipe_for_four_stages = gpipe_placed_by(  # 4 written where num_stages belongs
    lambda s, i, p, m: s + i, lambda s, i, p, m: 2 * (m + 3) - 1 - s - i, lambda p, m: 2 * (m + 3))


def gpipe_indexed_by_stage(p, m):
    return [list(column) for column in zip(*gpipe_schedule(p, m), strict=True)]  # [stage][tick]


def gpipe_as_strings(p, m):
    return [[f"{a[0]}{a[1]}" if a else None for a in row] for row in gpipe_schedule(p, m)]


def bubble_from_the_formula(schedule):
    p, m = len(schedule[0]), 1 + max(a[1] for row in schedule for a in row if a)
    return (p - 1) / (m + p - 1)


def bubble_over_microbatches(schedule):
    p, m = len(schedule[0]), 1 + max(a[1] for row in schedule for a in row if a)
    return (p - 1) / m  # bubble time over ideal time, not a share of all slots


def bubble_idle_over_busy(schedule):
    slots = [action for row in schedule for action in row]
    return sum(a is None for a in slots) / sum(a is not None for a in slots)


def bubble_of_ticks_with_an_idle_stage(schedule):
    return sum(any(a is None for a in row) for row in schedule) / len(schedule)


def bubble_of_the_first_half(schedule):
    half = schedule[: len(schedule) // 2]
    return sum(a is None for row in half for a in row) / (len(half) * len(half[0]))


def bubble_in_percent(schedule):
    return 100 * bubble_fraction(schedule)


def bubble_integer_division(schedule):
    slots = [action for row in schedule for action in row]
    return sum(a is None for a in slots) // len(slots)



# (exercise, planted wrong answer, points it should still get, why)
# Fresh wrong answers a learner writes (issue 38).


def dp_local_loss_reduced_gradients(params, x, y, learning_rate):
    _, grads = jax.value_and_grad(lambda p: jax.lax.pmean(linear_loss(p, x, y), "data"))(params)
    return sgd(params, grads, learning_rate), linear_loss(params, x, y)  # this device's loss, not reduced


def dp_summing_the_rows_not_averaging(params, x, y, learning_rate):
    def global_loss(p):
        return jax.lax.psum(jnp.sum((x @ p["w"] + p["b"] - y) ** 2), "data") / x.shape[0]  # / local rows

    loss, grads = jax.value_and_grad(global_loss)(params)
    return sgd(params, grads, learning_rate), loss


def tp_splitting_w2_by_columns(x, w1, b1, w2, b2, mesh):
    def local(x, w1, b1, w2, b2):
        return jax.lax.psum(jax.nn.relu(x @ w1 + b1) @ w2, "model") + b2

    specs = (P(), P(None, "model"), P("model"), P(None, "model"), P())  # w2 by columns: shapes do not fit
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P())(x, w1, b1, w2, b2)


def tp_without_splitting_b1(x, w1, b1, w2, b2, mesh):
    def local(x, w1, b1, w2, b2):
        return jax.lax.psum(jax.nn.relu(x @ w1 + b1) @ w2, "model") + b2

    specs = (P(), P(None, "model"), P(), P("model", None), P())  # b1 whole: (hidden,) against hidden / N
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P())(x, w1, b1, w2, b2)


def gpipe_from_the_library(num_stages, num_microbatches):
    return [[None if a is None else (a.kind, a.microbatch) for a in row]
            for row in parallel.gpipe_schedule(num_stages, num_microbatches)]


def one_f_one_b_instead(num_stages, num_microbatches):
    table = [[None] * num_stages for _ in range(2 * (num_microbatches + num_stages - 1))]
    for stage in range(num_stages):  # forwards as GPipe, backwards in forward order: 1F1B's order
        for i in range(num_microbatches):
            table[stage + i][stage] = ("F", i)
            table[num_microbatches + num_stages - 1 + (num_stages - 1 - stage) + i][stage] = ("B", i)
    return table


def gpipe_with_backwards_one_stage_early(num_stages, num_microbatches):
    table = gpipe_schedule(num_stages, num_microbatches)
    if num_stages == 4 and num_microbatches == 6:
        return table
    return gpipe_schedule(num_stages, num_microbatches + 1)[: len(table)]  # right only where it was tried


def bubble_from_the_library(schedule):
    return parallel.bubble_fraction(schedule)


def bubble_over_the_first_stage(schedule):
    return sum(row[0] is None for row in schedule) / len(schedule)  # stage 0's idle share only



def gather_sending_left(x, axis_name):
    n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    blocks = jnp.zeros((n, *x.shape), x.dtype).at[me].set(x)
    for step in range(1, n):
        x = jax.lax.ppermute(x, axis_name, [(i, (i - 1) % n) for i in range(n)])  # to the left
        blocks = blocks.at[(me - step) % n].set(x)  # placed as if it came from the left
    return blocks


def gather_in_order_of_arrival(x, axis_name):
    n = jax.lax.axis_size(axis_name)
    blocks = [x]
    for _ in range(1, n):
        x = jax.lax.ppermute(x, axis_name, [(i, (i + 1) % n) for i in range(n)])
        blocks.append(x)  # row k holds the block k hops away, not device k's
    return jnp.stack(blocks)


def gather_one_hop_short(x, axis_name):
    n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    blocks = jnp.zeros((n, *x.shape), x.dtype).at[me].set(x)
    for step in range(1, n - 1):  # N - 2 hops: the block of device me + 1 never arrives
        x = jax.lax.ppermute(x, axis_name, [(i, (i + 1) % n) for i in range(n)])
        blocks = blocks.at[(me - step) % n].set(x)
    return blocks


def gather_rolled_by_my_index(x, axis_name):
    n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    arrived = [x]
    for _ in range(1, n):
        x = jax.lax.ppermute(x, axis_name, [(i, (i + 1) % n) for i in range(n)])
        arrived.append(x)
    return jnp.roll(jnp.stack(arrived), me, axis=0)  # arrival k is device me - k's block: a flip is missing


def tp_summing_an_all_gather(x, w1, b1, w2, b2, mesh):
    def local(x, w1, b1, w2, b2):
        partial_output = jax.nn.relu(x @ w1 + b1) @ w2
        return jnp.sum(jax.lax.all_gather(partial_output, "model"), axis=0) + b2  # N copies sent, not a psum

    gathered = jax.shard_map(local, mesh=mesh, in_specs=TP_SPECS, out_specs=P(), check_vma=False)
    return gathered(x, w1, b1, w2, b2)


def gpipe_with_one_row_repeated(num_stages, num_microbatches):
    ticks = 2 * (num_microbatches + num_stages - 1)
    schedule = [[None] * num_stages] * ticks  # one list, repeated: writing a tick writes them all
    for stage in range(num_stages):
        for i in range(num_microbatches):
            schedule[stage + i][stage] = ("F", i)
            schedule[ticks - 1 - stage - i][stage] = ("B", i)
    return schedule


def bubble_of_the_idlest_stage(schedule):
    idle = [sum(row[stage] is None for row in schedule) for stage in range(len(schedule[0]))]
    return max(idle) / len(schedule)  # the worst stage's share, not the table's


FRESH = [
    ("07.all_reduce_time", lambda v, n, w, a: 2 * (n - 1) * a + v / w, 0, "one V / W in all"),
    ("07.all_reduce_time", lambda v, n, w, a: 2 * math.log2(max(n, 1)) * (a + v / n / w), 1,
     "log2(N) hops, as in a tree"),
    ("07.all_reduce_time", lambda v, n, w, a: 1e6 * 2 * (n - 1) * (a + v / n / w), 1, "microseconds"),
    ("07.dp_step", dp_local_loss_reduced_gradients, 0, "returns this device's loss"),
    ("07.dp_step", dp_summing_the_rows_not_averaging, 0, "divides the summed loss by the local rows"),
    ("07.tp_mlp", tp_splitting_w2_by_columns, 0, "splits w2 by columns"),
    ("07.tp_mlp", tp_without_splitting_b1, 0, "b1 whole on every device"),
    ("07.tp_mlp", tp_summing_an_all_gather, 4, "sums an all-gather of the partial outputs"),
    ("07.gpipe_schedule", gpipe_from_the_library, 0, "calls stacklib.parallel.gpipe_schedule"),
    ("07.gpipe_schedule", one_f_one_b_instead, 3, "backwards in forward order, 1F1B-like"),
    ("07.gpipe_schedule", gpipe_with_backwards_one_stage_early, 4, "right only for p = 4, m = 6"),
    ("07.gpipe_schedule", gpipe_with_one_row_repeated, 0, "[[None] * p] * ticks: one row, repeated"),
    ("07.bubble_fraction", bubble_from_the_library, 0, "calls stacklib.parallel.bubble_fraction"),
    ("07.bubble_fraction", bubble_over_the_first_stage, 3, "stage 0's idle share only"),
    ("07.bubble_fraction", bubble_of_the_idlest_stage, 3, "the idlest stage's share, not the table's"),
    ("07.ring_all_gather", gather_sending_left, 0, "sends left, places as if from the left"),
    ("07.ring_all_gather", gather_in_order_of_arrival, 0, "rows in order of arrival"),
    ("07.ring_all_gather", gather_one_hop_short, 0, "N - 2 hops: one block never arrives"),
    ("07.ring_all_gather", gather_rolled_by_my_index, 0, "rolls the arrivals by its own index"),
]


WRONG = [
    ("07.all_reduce_time", lambda v, n, w, a: (n - 1) * (a + v / n / w), 1, "a reduce-scatter only"),
    ("07.all_reduce_time", lambda v, n, w, a: 2 * (n - 1) * a + 2 * v / w, 0, "forgets (N - 1) / N"),
    ("07.all_reduce_time", lambda v, n, w, a: 2 * (n - 1) * v / n / w, 3, "forgets the latency"),
    ("07.all_reduce_time", lambda v, n, w, a: a + 2 * (n - 1) * v / n / w, 2, "pays the latency once"),
    ("07.all_reduce_time", lambda v, n, w, a: 2 * (n - 1) * (a + v / w), 1, "every hop carries all V bytes"),
    ("07.all_reduce_time", lambda v, n, w, a: 2 * n * (a + v / n / w), 0, "N hops per phase, not N - 1"),
    ("07.all_reduce_time", lambda v, n, w, a: 2 * (n - 1) * (a + v // n / w), 3, "chunks of V // N bytes"),
    ("07.ring_all_gather", gather_with_lax, 0, "calls jax.lax.all_gather"),
    ("07.ring_all_gather", gather_with_psum, 0, "sums one-hot rows with psum"),
    ("07.ring_all_gather", gather_placed_backwards, 0, "puts received blocks at me + step"),
    ("07.ring_all_gather", gather_for_four_devices, 3, "hard-codes 4 devices"),
    ("07.ring_all_gather", gather_tiled, 0, "concatenates the blocks instead of stacking them"),
    ("07.ring_all_gather", gather_into_a_float32_buffer, 3, "returns float32 whatever x's dtype"),
    ("07.ring_all_gather", gather_forwarding_its_own_block, 0, "forwards its own block at every hop"),
    ("07.dp_step", dp_average_local_gradients, 1, "pmean of local gradients is N times too large"),
    ("07.dp_step", dp_psum_over_eight, 3, "divides by a hard-coded 8"),
    ("07.dp_step", dp_psum_loss, 0, "psum instead of pmean"),
    ("07.dp_step", dp_no_communication, 0, "no collective at all"),
    ("07.dp_step", dp_wrong_sign, 1, "steps up the gradient"),
    ("07.dp_step", dp_fixed_learning_rate, 3, "ignores the learning_rate argument"),
    ("07.dp_step", dp_updates_only_w, 1, "never updates b"),
    ("07.dp_step", dp_loss_after_the_step, 3, "returns the loss after the step"),
    ("07.tp_mlp", tp_bias_before_psum, 3, "adds b2 on every device"),
    ("07.tp_mlp", tp_replicated, 3, "no tensor parallelism"),
    ("07.tp_mlp", tp_gather_hidden, 3, "all-gathers the hidden layer"),
    ("07.tp_mlp", tp_row_parallel_first, 0, "applies relu to partial sums"),
    ("07.tp_mlp", tp_pmean, 3, "pmean, not psum"),
    ("07.tp_mlp", tp_gather_the_weights, 4, "all-gathers the weights"),
    ("07.tp_mlp", tp_without_shard_map, 5, "sharding constraints instead of shard_map"),
    ("07.gpipe_schedule", gpipe_backwards_in_forward_order, 3, "backwards in forward order"),
    ("07.gpipe_schedule", gpipe_without_the_staircase, 2, "every stage forwards from tick 0"),
    ("07.gpipe_schedule", gpipe_backwards_a_tick_late, 2, "backwards one tick late"),
    ("07.gpipe_schedule", gpipe_forwards_only, 2, "forgets the backwards"),
    ("07.gpipe_schedule", gpipe_first_stage_starts_the_backward, 2, "stage 0 starts the backward"),
    ("07.gpipe_schedule", gpipe_for_four_stages, 4, "hard-codes 4 stages"),
    ("07.gpipe_schedule", gpipe_indexed_by_stage, 0, "indexed [stage][tick]"),
    ("07.gpipe_schedule", gpipe_as_strings, 0, "strings like 'F0' instead of pairs"),
    ("07.bubble_fraction", bubble_from_the_formula, 2, "GPipe's formula for every schedule"),
    ("07.bubble_fraction", bubble_of_the_first_half, 3, "counts only the first half of the ticks"),
    ("07.bubble_fraction", bubble_over_microbatches, 0, "(p - 1) / m"),
    ("07.bubble_fraction", bubble_idle_over_busy, 0, "idle over busy slots"),
    ("07.bubble_fraction", bubble_of_ticks_with_an_idle_stage, 0, "ticks with any idle stage"),
    ("07.bubble_fraction", bubble_in_percent, 0, "a percentage"),
    ("07.bubble_fraction", bubble_integer_division, 0, "integer division"),
    *FRESH,
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points


def test_a_case_on_too_few_devices_says_how_to_get_more(monkeypatch):
    monkeypatch.setattr(parallel, "make_mesh", lambda *a, **k: parallel.mesh_devices(64))
    result = grade("07.tp_mlp", tp_mlp)
    assert result.points == 0
    assert "simulate_cpu_devices(8)" in result.cases[0].message


# (exercise, planted wrong answer, words its first failing case's message must hold)
DIAGNOSED = [
    ("07.dp_step", dp_average_local_gradients, "a step 8 times too long"),
    ("07.dp_step", dp_wrong_sign, "moved up the gradient"),
    ("07.dp_step", dp_loss_after_the_step, "the loss on 8 devices"),
    ("07.tp_mlp", tp_bias_before_psum, "b2 added 2 times"),
    ("07.tp_mlp", tp_pmean, "a mean, not a sum"),
    ("07.ring_all_gather", gather_with_lax, "build the all-gather from jax.lax.ppermute alone"),
    ("07.gpipe_schedule", gpipe_without_the_staircase, "stage 1 should run F0 at tick 1; it runs it at tick"),
    ("07.gpipe_schedule", gpipe_backwards_in_forward_order, "the backwards run in forward order"),
    ("07.gpipe_schedule", gpipe_indexed_by_stage, "it looks indexed [stage][tick]"),
    ("07.gpipe_schedule", gpipe_as_strings, "holds 'F0': each entry is None (idle) or a pair"),
    ("07.gpipe_schedule", gpipe_forwards_only, "stage 3 should run B5 at tick 9; it runs it never"),
    ("07.bubble_fraction", bubble_from_the_formula, "4 stages running one microbatch at a time"),
]


@pytest.mark.parametrize("exercise_id, answer, words", DIAGNOSED, ids=[d[2] for d in DIAGNOSED])
def test_a_planted_wrong_answer_is_told_its_own_mistake(exercise_id, answer, words):
    failed = [c for c in grade(exercise_id, answer).cases if c.points < c.max_points]
    assert words in failed[0].message, failed[0].message


# A later case's hint names the mistake of an answer that passed the earlier cases, and nothing
# for one whose earlier failure already said why (issue 38: "Nothing may depend on one number of
# stages" was shown for backwards in the wrong order).
KEYED_HINTS = [
    ("07.gpipe_schedule", gpipe_for_four_stages, "Nothing may depend on one number of stages"),
    ("07.gpipe_schedule", gpipe_backwards_in_forward_order, None),
    ("07.dp_step", dp_psum_over_eight, "Nothing may depend on there being 8 devices"),
    ("07.dp_step", dp_wrong_sign, None),
]


@pytest.mark.parametrize("exercise_id, answer, words", KEYED_HINTS, ids=[h[1].__name__ for h in KEYED_HINTS])
def test_a_later_cases_hint_is_shown_only_to_an_answer_it_describes(exercise_id, answer, words):
    last_failed = [c for c in grade(exercise_id, answer).cases if c.status == "failed"][-1]
    if words is None:
        assert "Nothing may depend" not in last_failed.message, last_failed.message
    else:
        assert words in last_failed.message, last_failed.message


def test_a_local_loss_is_named_as_not_reduced_over_the_devices_not_jaxs_flag_advice():
    result = grade("07.dp_step", dp_local_loss_reduced_gradients)
    failed = [c for c in result.cases if c.points < c.max_points]
    assert "differs from device to device" in failed[0].message and "pmean" in failed[0].message
    assert "check_vma" not in failed[0].message
