"""Chapter 10's exercise cases: right answers score full marks, planted wrong ones lose points."""

import json
import statistics

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
            reasons[impl["name"]] = f"runs on {impl['backends']}"
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
    ("10.first_supported", lambda i, c: first_supported(i, c, options_backwards=True), 5,
     "requires the call to use every option the implementation has"),
    ("10.first_supported", first_supported_or_raise, 6, "raises when none can serve the call"),
    ("10.cache_key", lambda **arguments: str(tuple(arguments.values())), 5, "dict order leaks into the key"),
    ("10.cache_key", key_without("device_kind"), 6, "no device kind"),
    ("10.cache_key", key_without("op"), 6, "no op name"),
    ("10.cache_key", key_without("version"), 6, "no version"),
    ("10.cache_key", key_without("options"), 6, "no options"),
    ("10.cache_key", lambda **arguments: cache_key(**{**arguments, "shapes": None, "dtypes": None}), 6,
     "no shapes or dtypes"),
    ("10.cache_key", lambda **a: cache_key(**{**a, "shapes": a["shapes"]["query"]}), 6,
     "only the query's shape"),
    ("10.cache_key", lambda **a: cache_key(**{**a, "options": sorted(a["options"])}), 6,
     "the option names without their values"),
    ("10.timing_loop", lambda *a, **k: tune(*a, **k, summary=statistics.mean), 2, "the mean, not the median"),
    ("10.timing_loop", lambda *a, **k: tune(*a, **k, summary=statistics.median_high), 4,
     "the upper of the two middle runs"),
    ("10.timing_loop", lambda *a, **k: tune(*a, **k, summary=min), 4, "the fastest run, not the median"),
    ("10.timing_loop", lambda *a, **k: tune(*a, **k, time_warmup=True), 4, "times the warm-up runs too"),
    ("10.timing_loop", lambda *a, **k: tune(*a, **k, fixed_warmup=1), 5,
     "one warm-up run, whatever `warmup` is"),
    ("10.timing_loop", no_warmup, 3, "no warm-up"),
    ("10.timing_loop", timed_as_a_batch, 2, "times all repeats together: their mean"),
    ("10.timing_loop", lambda *a, **k: tune(*a, **k, pick=max), 3, "keeps the slowest"),
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points
