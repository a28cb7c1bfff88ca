"""Chapter 10's exercise cases: right answers score full marks, planted wrong ones lose points."""

import json
import statistics

import numpy as np
import pytest

from stacklib.grading import grade


def attention_mask(T, S, *, is_causal=False, local_window_size=None, key_value_length=None, strict=False,
                   exclusive_window=False, ignore_length=False, symmetric_window=False):
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]
    ok = np.ones((T, S), bool)
    if is_causal:
        ok &= (s < t) if strict else (s <= t)
    if local_window_size is not None:
        before, after = local_window_size
        after = before if symmetric_window else after
        if exclusive_window:
            ok &= (s > t - before) & (s < t + after)
        else:
            ok &= (s >= t - before) & (s <= t + after)
    if key_value_length is not None and not ignore_length:
        ok &= s < key_value_length
    return ok


def first_supported(implementations, call, *, check_options=True, last=False, keep_reasons=True,
                    options_backwards=False):
    reasons, found = {}, []
    for impl in implementations:
        if options_backwards:
            missing = [o for o in impl["options"] if o not in call["options"]]
        else:
            missing = [o for o in call["options"] if o not in impl["options"]] if check_options else []
        if call["backend"] not in impl["backends"]:
            reasons[impl["name"]] = f"runs on {impl['backends']}"
        elif call["dtype"] not in impl["dtypes"]:
            reasons[impl["name"]] = f"no {call['dtype']}"
        elif missing:
            reasons[impl["name"]] = f"no {missing}"
        elif last:
            found.append(impl["name"])
        else:
            return impl["name"], reasons if keep_reasons else {}
    if found:
        return found[-1], reasons
    return None, reasons if keep_reasons else {}


def cache_key(device_kind, op, shapes, dtypes, options, version):
    return json.dumps(dict(device_kind=device_kind, op=op, shapes=shapes, dtypes=dtypes, options=options,
                           version=version), sort_keys=True)


def tune(candidates, run, clock, *, warmup=1, repeats=5, summary=statistics.median, time_warmup=False,
         pick=min):
    times = {}
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


# (exercise, planted wrong answer, points it should still get, why)
WRONG = [
    ("10.attention_mask", lambda *a, **k: attention_mask(*a, **k, strict=True), 3,
     "causal without the diagonal"),
    ("10.attention_mask", lambda *a, **k: attention_mask(*a, **k, exclusive_window=True), 2,
     "a window that excludes its ends"),
    ("10.attention_mask", lambda *a, **k: attention_mask(*a, **k, ignore_length=True), 3,
     "ignores the key length"),
    ("10.attention_mask", lambda *a, **k: attention_mask(*a, **k, symmetric_window=True), 3,
     "uses `before` on both sides of the window"),
    ("10.attention_mask", lambda T, S, **k: attention_mask(T, S, **k).astype(int), 0, "returns 0/1 integers"),
    ("10.first_supported", lambda i, c: first_supported(i, c, check_options=False), 5, "ignores the options"),
    ("10.first_supported", lambda i, c: first_supported(i, c, last=True), 3, "the last that can serve it"),
    ("10.first_supported", lambda i, c: first_supported(i, c, keep_reasons=False), 1, "gives no reasons"),
    ("10.first_supported", lambda i, c: first_supported(i, c, options_backwards=True), 5,
     "requires the call to use every option the implementation has"),
    ("10.cache_key", lambda **arguments: str(tuple(arguments.values())), 4, "dict order leaks into the key"),
    ("10.cache_key", key_without("device_kind"), 4, "no device kind"),
    ("10.cache_key", key_without("version"), 4, "no version"),
    ("10.cache_key", key_without("options"), 4, "no options"),
    ("10.cache_key", lambda **arguments: cache_key(**{**arguments, "shapes": None, "dtypes": None}), 4,
     "no shapes or dtypes"),
    ("10.timing_loop", lambda *a, **k: tune(*a, **k, summary=statistics.mean), 2, "the mean, not the median"),
    ("10.timing_loop", lambda *a, **k: tune(*a, **k, time_warmup=True), 4, "times the warm-up runs too"),
    ("10.timing_loop", no_warmup, 3, "no warm-up"),
    ("10.timing_loop", lambda *a, **k: tune(*a, **k, pick=max), 3, "keeps the slowest"),
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points
