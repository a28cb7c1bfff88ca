"""Chapter 10's exercise cases: right answers score full marks, planted wrong ones lose points."""

import hashlib
import json
import statistics

import jax.numpy as jnp
import numpy as np
import pytest

from stacklib.grading import grade


def attention_mask(T, S, *, is_causal=False, local_window_size=None, key_value_length=None, strict=False,
                   exclusive_window=False, ignore_length=False, symmetric_window=False, bottom_right=False,
                   zero_length_ignored=False, zero_side_ignored=False):
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]
    ok = np.ones((T, S), bool)
    if is_causal:
        last_key = t + (S - T) if bottom_right else t  # bottom-right: the last query faces the last key
        ok &= (s < last_key) if strict else (s <= last_key)
    if local_window_size is not None:
        before, after = local_window_size
        after = before if symmetric_window else after
        if exclusive_window:
            ok &= (s > t - before) & (s < t + after)
        else:
            ok &= (s >= t - before) if before or not zero_side_ignored else True
            ok &= (s <= t + after) if after or not zero_side_ignored else True
    if key_value_length is not None and not ignore_length and (key_value_length or not zero_length_ignored):
        ok &= s < key_value_length
    return ok


def mask_of_the_first_option(T, S, *, is_causal=False, local_window_size=None, key_value_length=None):
    """An if/elif chain: only the first option given applies."""
    if is_causal:
        return attention_mask(T, S, is_causal=True)
    if local_window_size is not None:
        return attention_mask(T, S, local_window_size=local_window_size)
    return attention_mask(T, S, key_value_length=key_value_length)


def first_supported(implementations, call, *, check_options=True, last=False, keep_reasons=True,
                    options_backwards=False, any_option=False, check_dtype=True, sort_by_name=False,
                    try_all=False):
    reasons, found = {}, []
    if sort_by_name:
        implementations = sorted(implementations, key=lambda impl: impl["name"])
    for impl in implementations:
        if options_backwards:
            missing = [o for o in impl["options"] if o not in call["options"]]
        elif any_option and any(o in impl["options"] for o in call["options"]):
            missing = []
        else:
            missing = [o for o in call["options"] if o not in impl["options"]] if check_options else []
        if call["backend"] not in impl["backends"]:
            reasons[impl["name"]] = f"runs on {impl['backends']}, not on {call['backend']}"
        elif check_dtype and call["dtype"] not in impl["dtypes"]:
            reasons[impl["name"]] = f"no {call['dtype']}"
        elif missing:
            reasons[impl["name"]] = f"no {missing}"
        elif last or try_all:
            found.append(impl["name"])
        else:
            return impl["name"], reasons if keep_reasons else {}
    if found:
        return found[-1 if last else 0], reasons
    return None, reasons if keep_reasons else {}


def cache_key(device_kind, op, shapes, dtypes, options, version):
    return json.dumps(dict(device_kind=device_kind, op=op, shapes=shapes, dtypes=dtypes, options=options,
                           version=version), sort_keys=True)


def tune(candidates, run, clock, *, warmup=1, repeats=5, summary=statistics.median, time_warmup=False,
         pick=min, fixed_warmup=None):
    times = {}
    warmup = warmup if fixed_warmup is None else fixed_warmup
    for config in candidates:
        samples = []
        for i in range(warmup + repeats):
            start = clock()
            run(config)
            if time_warmup or i >= warmup:
                samples.append(clock() - start)
        times[config] = summary(samples)
    return pick(times, key=times.get), times


def cache_key_hashed(device_kind, op, shapes, dtypes, options, version):  # a digest: short, and stable
    text = cache_key(device_kind, op, shapes, dtypes, options, version)
    return hashlib.sha256(text.encode()).hexdigest()


RIGHT = {
    "10.attention_mask": attention_mask,
    "10.first_supported": first_supported,
    "10.cache_key": cache_key,
    "10.timing_loop": tune,
}


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_a_right_answer_scores_full_marks(exercise_id):
    result = grade(exercise_id, RIGHT[exercise_id])
    assert result.points == result.max_points, [c.message for c in result.cases]


def test_a_hashed_key_from_a_stable_digest_scores_full_marks():
    result = grade("10.cache_key", cache_key_hashed)
    assert result.points == result.max_points, [c.message for c in result.cases]


# Planted wrong answers, one per class of mistake (issue 38) and the ones a learner writes.

def mask_in_jax(T, S, **options):  # the statement asks for NumPy
    return jnp.asarray(attention_mask(T, S, **options))


def length_inclusive(T, S, *, is_causal=False, local_window_size=None, key_value_length=None):  # s <= L
    length = None if key_value_length is None else key_value_length + 1
    return attention_mask(T, S, is_causal=is_causal, local_window_size=local_window_size,
                          key_value_length=length)


def window_sides_swapped(T, S, *, is_causal=False, local_window_size=None, key_value_length=None):
    window = None if local_window_size is None else local_window_size[::-1]
    return attention_mask(T, S, is_causal=is_causal, local_window_size=window,
                          key_value_length=key_value_length)


def causal_transposed(T, S, *, is_causal=False, local_window_size=None, key_value_length=None):  # s >= t
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]
    ok = attention_mask(T, S, local_window_size=local_window_size, key_value_length=key_value_length)
    return ok & (s >= t) if is_causal else ok


def float_mask(T, S, **options):  # 1.0 / 0.0
    return attention_mask(T, S, **options).astype(np.float32)


def rows_are_keys(T, S, **options):  # [S, T]: the transpose
    return attention_mask(S, T, **options)


def window_before_only(T, S, *, is_causal=False, local_window_size=None, key_value_length=None):
    window = None if local_window_size is None else (local_window_size[0], S)
    return attention_mask(T, S, is_causal=is_causal, local_window_size=window,
                          key_value_length=key_value_length)


def generic_reasons(implementations, call):  # free text that names nothing
    name, reasons = first_supported(implementations, call)
    return name, dict.fromkeys(reasons, "not supported")


def reasons_name_the_implementations_backends(implementations, call):  # every reason about backends
    name, reasons = first_supported(implementations, call)
    by_name = {impl["name"]: impl for impl in implementations}
    return name, {n: f"supports {by_name[n]['backends']}" for n in reasons}


def reasons_as_a_list(implementations, call):
    name, reasons = first_supported(implementations, call)
    return name, list(reasons.values())


def reasons_by_index(implementations, call):
    name, reasons = first_supported(implementations, call)
    names = [impl["name"] for impl in implementations]
    return name, {names.index(n): r for n, r in reasons.items()}


def stops_at_the_first_refusal(implementations, call):
    name, reasons = first_supported(implementations, call)
    if reasons:
        first = next(iter(reasons))
        return None, {first: reasons[first]}
    return name, reasons


def reason_for_the_winner_too(implementations, call):
    name, reasons = first_supported(implementations, call)
    return name, {**reasons, name: "chosen"} if name else reasons


def hash_of_the_text(device_kind, op, shapes, dtypes, options, version):  # salted per process
    return str(hash(cache_key(device_kind, op, shapes, dtypes, options, version)))


def shapes_without_names(device_kind, op, shapes, dtypes, options, version):  # sorted values: names lost
    return cache_key(device_kind, op, sorted(shapes.values()), sorted(dtypes.values()), options, version)


def shapes_without_the_head_dim(device_kind, op, shapes, dtypes, options, version):
    return cache_key(device_kind, op, {k: v[:-1] for k, v in shapes.items()}, dtypes, options, version)


def sequence_length_only(device_kind, op, shapes, dtypes, options, version):  # "the length decides"
    return cache_key(device_kind, op, {k: v[1] for k, v in shapes.items()}, dtypes, options, version)


def options_in_given_order(device_kind, op, shapes, dtypes, options, version):
    return f"{device_kind}|{op}|{sorted(shapes.items())}|{sorted(dtypes.items())}|{options}|{version}"


def dtypes_as_a_set(device_kind, op, shapes, dtypes, options, version):
    return cache_key(device_kind, op, shapes, sorted(set(dtypes.values())), options, version)


def element_counts(device_kind, op, shapes, dtypes, options, version):  # sizes, not shapes
    return cache_key(device_kind, op, {k: int(np.prod(v)) for k, v in shapes.items()}, dtypes, options,
                     version)


def python_hash_of_a_tuple(device_kind, op, shapes, dtypes, options, version):  # hash() of strings inside
    return str(hash((device_kind, op, json.dumps(shapes, sort_keys=True), json.dumps(dtypes, sort_keys=True),
                     json.dumps(options, sort_keys=True), version)))


def first_timed_run(candidates, run, clock, *, warmup=1, repeats=5):
    return tune(candidates, run, clock, warmup=warmup, repeats=repeats, summary=lambda samples: samples[0])


def trimmed_mean(candidates, run, clock, *, warmup=1, repeats=5):  # drop the fastest and slowest
    return tune(candidates, run, clock, warmup=warmup, repeats=repeats,
                summary=lambda samples: statistics.mean(sorted(samples)[1:-1]))


def times_as_a_list(candidates, run, clock, *, warmup=1, repeats=5):
    best, times = tune(candidates, run, clock, warmup=warmup, repeats=repeats)
    return best, list(times.values())


def middle_by_index(candidates, run, clock, *, warmup=1, repeats=5):  # sorted(x)[n // 2]
    return tune(candidates, run, clock, warmup=warmup, repeats=repeats,
                summary=lambda samples: sorted(samples)[len(samples) // 2])


def key_without(field):
    def wrong(**arguments):
        return cache_key(**{**arguments, field: "any"})
    return wrong


def no_warmup(candidates, run, clock, *, warmup=1, repeats=5):
    return tune(candidates, run, clock, warmup=0, repeats=repeats)


def timed_as_a_batch(candidates, run, clock, *, warmup=1, repeats=5):  # one clock pair around all repeats
    times = {}
    for config in candidates:
        for _ in range(warmup):
            run(config)
        start = clock()
        for _ in range(repeats):
            run(config)
        times[config] = (clock() - start) / repeats
    return min(times, key=times.get), times


def first_supported_or_raise(implementations, call):
    name, reasons = first_supported(implementations, call)
    if name is None:
        raise LookupError(f"no implementation can serve {call}: {reasons}")
    return name, reasons


# (exercise, planted wrong answer, points it should still get, why)
WRONG = [
    ("10.attention_mask", lambda *a, **k: attention_mask(*a, **k, strict=True), 4,
     "causal without the diagonal"),
    ("10.attention_mask", lambda *a, **k: attention_mask(*a, **k, bottom_right=True), 7,
     "causal aligned to the last key when T != S"),
    ("10.attention_mask", lambda *a, **k: attention_mask(*a, **k, exclusive_window=True), 5,
     "a window that excludes its ends"),
    ("10.attention_mask", lambda *a, **k: attention_mask(*a, **k, zero_side_ignored=True), 7,
     "a window side of 0 is treated as no limit"),
    ("10.attention_mask", lambda *a, **k: attention_mask(*a, **k, ignore_length=True), 5,
     "ignores the key length"),
    ("10.attention_mask", lambda *a, **k: attention_mask(*a, **k, zero_length_ignored=True), 7,
     "key_value_length=0 is treated as not given"),
    ("10.attention_mask", lambda *a, **k: attention_mask(*a, **k, symmetric_window=True), 7,
     "uses `before` on both sides of the window"),
    ("10.attention_mask", mask_of_the_first_option, 7, "only the first option given applies"),
    ("10.attention_mask", lambda T, S, **k: attention_mask(T, S, **k).astype(int), 0, "returns 0/1 integers"),
    ("10.first_supported", lambda i, c: first_supported(i, c, check_options=False), 5, "ignores the options"),
    ("10.first_supported", lambda i, c: first_supported(i, c, any_option=True), 5,
     "one of the call's options is enough"),
    ("10.first_supported", lambda i, c: first_supported(i, c, check_dtype=False), 5, "ignores the dtype"),
    ("10.first_supported", lambda i, c: first_supported(i, c, last=True), 3, "the last that can serve it"),
    ("10.first_supported", lambda i, c: first_supported(i, c, sort_by_name=True), 2,
     "tries the implementations in name order"),
    ("10.first_supported", lambda i, c: first_supported(i, c, try_all=True), 6,
     "tries (and gives reasons for) the implementations after the winner"),
    ("10.first_supported", lambda i, c: first_supported(i, c, keep_reasons=False), 1, "gives no reasons"),
    ("10.first_supported", lambda i, c: first_supported(i, c, options_backwards=True), 4,
     "requires the call to use every option the implementation has"),
    ("10.first_supported", first_supported_or_raise, 6, "raises when none can serve the call"),
    ("10.cache_key", lambda **arguments: str(tuple(arguments.values())), 9, "dict order leaks into the key"),
    ("10.cache_key", key_without("device_kind"), 10, "no device kind"),
    ("10.cache_key", key_without("op"), 10, "no op name"),
    ("10.cache_key", key_without("version"), 10, "no version"),
    ("10.cache_key", key_without("options"), 10, "no options"),
    ("10.cache_key", lambda **arguments: cache_key(**{**arguments, "shapes": None, "dtypes": None}), 8,
     "no shapes or dtypes"),
    ("10.cache_key", lambda **a: cache_key(**{**a, "shapes": a["shapes"]["query"]}), 10,
     "only the query's shape"),
    ("10.cache_key", lambda **a: cache_key(**{**a, "options": sorted(a["options"])}), 10,
     "the option names without their values"),
    ("10.timing_loop", lambda *a, **k: tune(*a, **k, summary=statistics.mean), 4, "the mean, not the median"),
    ("10.timing_loop", lambda *a, **k: tune(*a, **k, summary=statistics.median_high), 6,
     "the upper of the two middle runs"),
    ("10.timing_loop", lambda *a, **k: tune(*a, **k, summary=min), 4, "the fastest run, not the median"),
    ("10.timing_loop", lambda *a, **k: tune(*a, **k, time_warmup=True), 6, "times the warm-up runs too"),
    ("10.timing_loop", lambda *a, **k: tune(*a, **k, fixed_warmup=1), 7,
     "one warm-up run, whatever `warmup` is"),
    ("10.timing_loop", no_warmup, 5, "no warm-up"),
    ("10.timing_loop", timed_as_a_batch, 4, "times all repeats together: their mean"),
    ("10.timing_loop", lambda *a, **k: tune(*a, **k, pick=max), 3, "keeps the slowest"),
    ("10.attention_mask", mask_in_jax, 0, "a jax.Array where NumPy is asked for"),
    ("10.attention_mask", length_inclusive, 5, "keys s <= L"),
    ("10.attention_mask", window_sides_swapped, 5, "the window's sides swapped"),
    ("10.attention_mask", causal_transposed, 4, "causal as s >= t"),
    ("10.attention_mask", float_mask, 0, "a float mask"),
    ("10.attention_mask", rows_are_keys, 3, "the mask transposed"),
    ("10.attention_mask", window_before_only, 5, "the window's after side ignored"),
    ("10.first_supported", generic_reasons, 1, "reasons that name nothing"),
    ("10.first_supported", reasons_name_the_implementations_backends, 1, "every reason about backends"),
    ("10.first_supported", reasons_as_a_list, 0, "reasons as a list"),
    ("10.first_supported", reasons_by_index, 1, "reasons keyed by position"),
    ("10.first_supported", stops_at_the_first_refusal, 1, "gives up at the first refusal"),
    ("10.first_supported", reason_for_the_winner_too, 1, "a reason for the winner too"),
    ("10.cache_key", hash_of_the_text, 9, "hash() of the key's text"),
    ("10.cache_key", shapes_without_names, 9, "shapes and dtypes without their names"),
    ("10.cache_key", shapes_without_the_head_dim, 9, "the last dimension left out"),
    ("10.cache_key", sequence_length_only, 8, "the sequence length only"),
    ("10.cache_key", options_in_given_order, 9, "options in the order given"),
    ("10.cache_key", dtypes_as_a_set, 9, "the set of dtypes"),
    ("10.cache_key", element_counts, 9, "element counts, not shapes"),
    ("10.cache_key", python_hash_of_a_tuple, 9, "hash() of a tuple of strings"),
    ("10.timing_loop", first_timed_run, 4, "the first timed run"),
    ("10.timing_loop", trimmed_mean, 8, "a trimmed mean"),
    ("10.timing_loop", times_as_a_list, 5, "times as a list"),
    ("10.timing_loop", middle_by_index, 6, "sorted(x)[n // 2]"),
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points
