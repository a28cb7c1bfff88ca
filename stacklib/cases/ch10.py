"""Chapter 10 exercises: an attention mask from tokamax's options, the first implementation
that can serve a call, an autotuning cache key, and an autotuner's timing loop."""

import numpy as np

from stacklib.grading import Exercise, call_on_copies, expect, expect_equal
from stacklib.grading.expect import expect_instance, expect_mentions, expect_same_across_processes
from stacklib.kernels.xla_attention import allowed

# ---------------------------------------------------------------- 10.attention_mask

attention_mask = Exercise("10.attention_mask", "The attention mask from tokamax's options")


def _expected_mask(T, S, *, is_causal=False, local_window_size=None, key_value_length=None):
    lengths = None if key_value_length is None else np.array([key_value_length])
    ok = allowed(np.arange(T), np.arange(S), None, is_causal=is_causal, query_seq_lengths=None,
                 key_value_seq_lengths=lengths, local_window_size=local_window_size)
    return np.broadcast_to(np.asarray(ok), (1, 1, 1, T, S))[0, 0, 0]


def _check_mask(mask_fn, T, S, **options):
    expected = _expected_mask(T, S, **options)
    got = mask_fn(T, S, **options)
    expect_instance(got, np.ndarray, what="the mask",
                    why="the statement asks for NumPy (the mask is built on the host, before the kernel)")
    expect(got.shape == (T, S), f"expected a boolean array of shape ({T}, {S}), got shape {got.shape}")
    expect(got.dtype == bool, f"expected booleans (True = may attend), got dtype {got.dtype}")
    if not np.array_equal(got, expected):
        # The first pair that differs, not the whole mask: the learner finds the rule, not the array.
        t, s = np.argwhere(got != expected)[0]
        wrong = int((got != expected).sum())
        should = "" if expected[t, s] else "not "
        expect(False, f"with {options or 'no options'}, T={T}, S={S}: {wrong} of {T * S} pairs are wrong; "
                      f"the first is query {t} and key {s}, which should {should}attend")


@attention_mask.case(hint="Causal: query t may attend key s when s <= t. The diagonal is allowed: a "
                          "token sees itself.")
def causal_includes_the_diagonal(mask_fn):
    _check_mask(mask_fn, 6, 6, is_causal=True)


@attention_mask.case(points=2, hint="Queries and keys are both numbered from 0, the first query facing the "
                                    "first key, whatever T and S are: query t sees keys 0 .. t, not keys "
                                    "counted from the end of the sequence.")
def causal_counts_from_the_first_key_when_t_and_s_differ(mask_fn):
    _check_mask(mask_fn, 4, 7, is_causal=True)
    _check_mask(mask_fn, 7, 4, is_causal=True)


@attention_mask.case(points=2, hint="A window (before, after) lets query t attend keys t - before .. "
                                    "t + after, both ends included; a side of 0 still limits that side.")
def a_window_includes_both_ends(mask_fn):
    _check_mask(mask_fn, 8, 8, local_window_size=(3, 1))
    _check_mask(mask_fn, 6, 6, local_window_size=(0, 2))


@attention_mask.case(points=2, hint="key_value_length L masks every key s >= L, for every query; L = 0 "
                                    "masks every key (an option that is given applies, even when it is 0).")
def keys_beyond_the_length_are_masked(mask_fn):
    _check_mask(mask_fn, 4, 6, key_value_length=3)
    _check_mask(mask_fn, 3, 4, key_value_length=0)


@attention_mask.case(points=2, hint="Every option that is given applies at once: a pair may attend only if "
                                    "each one allows it.")
def options_apply_together(mask_fn):
    _check_mask(mask_fn, 5, 7, is_causal=True, local_window_size=(2, 0), key_value_length=4)
    _check_mask(mask_fn, 6, 6, is_causal=True, key_value_length=4)
    _check_mask(mask_fn, 6, 8, local_window_size=(1, 1), key_value_length=5)


# ---------------------------------------------------------------- 10.first_supported

first_supported = Exercise("10.first_supported", "The first implementation that can serve a call")


def _impl(name, backends=("cpu", "gpu", "tpu"), dtypes=("float32", "bfloat16"), options=()):
    return {"name": name, "backends": list(backends), "dtypes": list(dtypes), "options": list(options)}


def _call(backend="cpu", dtype="float32", options=()):
    return {"backend": backend, "dtype": dtype, "options": list(options)}


def _check_choice(choose_fn, implementations, call, expected_name, expected_skipped):
    got = call_on_copies(choose_fn, implementations, call, what="first_supported")
    expect(isinstance(got, tuple) and len(got) == 2,
           f"expected a pair (name or None, reasons), got {got!r:.100}")
    name, reasons = got
    expect(name == expected_name, f"expected {expected_name!r} for the call {call}, got {name!r}")
    expect(isinstance(reasons, dict) and list(reasons) == expected_skipped,
           f"expected reasons for {expected_skipped} (the implementations tried before it, in order), "
           f"got {reasons!r:.200}")
    for impl in implementations:
        if impl["name"] in reasons:
            expect_mentions(reasons[impl["name"]], [_what_it_lacks(impl, call)],
                            what=f"the reason for {impl['name']!r}",
                            hint="Each reason names what the implementation lacks: the call's backend, its "
                                 "dtype, or the option it does not support (by their names).")


def _what_it_lacks(impl, call):
    """The words a reason must contain: one of the things the implementation lacks, by name."""
    lacks = []
    if call["backend"] not in impl["backends"]:
        lacks.append(call["backend"])
    if call["dtype"] not in impl["dtypes"]:
        lacks.append(call["dtype"])
    lacks += [option for option in call["options"] if option not in impl["options"]]
    return tuple(lacks)


@first_supported.case(hint="Try the implementations in the order given (not sorted) and return the first "
                           "that supports the call, with no reasons if it is the first.")
def the_first_that_can_serve_wins(choose_fn):
    _check_choice(choose_fn, [_impl("xla_chunked"), _impl("xla")], _call(), "xla_chunked", [])


@first_supported.case(points=2, hint="An implementation whose backends do not include the call's "
                                     "backend cannot serve it: give a reason and try the next one.")
def a_wrong_backend_is_skipped_with_a_reason(choose_fn):
    implementations = [_impl("mosaic", backends=("tpu",)), _impl("cudnn", backends=("gpu",)),
                       _impl("xla"), _impl("xla_chunked")]
    _check_choice(choose_fn, implementations, _call(), "xla", ["mosaic", "cudnn"])


@first_supported.case(hint="Every option the call uses must be among the implementation's options "
                           "(an implementation may support more than the call uses).")
def every_option_the_call_uses_must_be_supported(choose_fn):
    implementations = [_impl("pallas", options=("is_causal",)),
                       _impl("xla", options=("bias", "is_causal", "mask"))]
    _check_choice(choose_fn, implementations, _call(options=("bias", "is_causal")), "xla", ["pallas"])


@first_supported.case(hint="The call's dtype must be among the implementation's dtypes.")
def a_dtype_it_lacks_is_skipped(choose_fn):
    implementations = [_impl("pallas", dtypes=("float32", "bfloat16")),
                       _impl("xla", dtypes=("float32", "bfloat16", "float16"))]
    _check_choice(choose_fn, implementations, _call(dtype="float16"), "xla", ["pallas"])


@first_supported.case(hint="Reasons are for the implementations tried before the one chosen: once one "
                           "can serve the call, the rest are not tried.")
def nothing_after_the_winner_is_tried(choose_fn):
    implementations = [_impl("mosaic", backends=("tpu",)), _impl("xla", options=("is_causal", "mask")),
                       _impl("cudnn", backends=("gpu",)), _impl("pallas", dtypes=("bfloat16",))]
    _check_choice(choose_fn, implementations, _call(options=("is_causal",)), "xla", ["mosaic"])


@first_supported.case(hint="When none can serve the call, return (None, reasons) with a reason for "
                           "every implementation, so that the error can list them all. Here each lacks "
                           "something different: the backend, the dtype or one of the options.")
def none_gives_every_reason(choose_fn):
    implementations = [_impl("pallas", dtypes=("bfloat16",), options=("bias", "is_causal")),
                       _impl("xla_chunked", options=("is_causal", "mask")),
                       _impl("mosaic", backends=("tpu",))]
    _check_choice(choose_fn, implementations, _call(options=("bias", "is_causal")), None,
                  ["pallas", "xla_chunked", "mosaic"])


# ---------------------------------------------------------------- 10.cache_key

cache_key = Exercise("10.cache_key", "A cache key that changes when, and only when, the call does")

_BASE = dict(device_kind="TPU v5 lite", op="dot_product_attention",
             shapes={"query": (2, 1024, 8, 128), "key": (2, 1024, 2, 128)},
             dtypes={"query": "bfloat16", "key": "bfloat16"},
             options={"is_causal": True, "logits_soft_cap": None}, version="0.1.0")


def _key(key_fn, **changes):
    arguments = {**_BASE, **changes}
    got = call_on_copies(key_fn, **arguments, what="cache_key")
    expect(isinstance(got, str), f"expected a string key, got {type(got).__name__}")
    return got


@cache_key.case(points=2, hint="The same call must give the same key, whatever order its dict arguments "
                               "(options, shapes, dtypes) were built in: a dict's printed order is its "
                               "insertion order.")
def the_same_call_gives_the_same_key(key_fn):
    first = _key(key_fn)
    reordered = _key(key_fn, options={"logits_soft_cap": None, "is_causal": True},
                     shapes={"key": (2, 1024, 2, 128), "query": (2, 1024, 8, 128)},
                     dtypes={"key": "bfloat16", "query": "bfloat16"})
    expect(first == reordered, f"the same call built in another order gave two keys:\n{first}\n{reordered}")


@cache_key.case(hint="A config tuned on one chip is not the best on another: the device kind is part "
                     "of the key.")
def another_chip_gets_another_key(key_fn):
    expect(_key(key_fn) != _key(key_fn, device_kind="TPU v6 lite"), "two device kinds gave the same key")


@cache_key.case(hint="Two ops (attention, a matmul) called with the same arrays have different best "
                     "configs: the op's name is part of the key.")
def another_op_gets_another_key(key_fn):
    expect(_key(key_fn) != _key(key_fn, op="gated_linear_unit"), "two ops gave the same key")


@cache_key.case(hint="The shapes and dtypes of every array decide the best blocks: all of them are part "
                     "of the key.")
def other_shapes_or_dtypes_get_other_keys(key_fn):
    base = _key(key_fn)
    longer = _key(key_fn, shapes={"query": (2, 2048, 8, 128), "key": (2, 2048, 2, 128)})
    fewer_key_heads = _key(key_fn, shapes={"query": (2, 1024, 8, 128), "key": (2, 1024, 1, 128)})
    wider = _key(key_fn, dtypes={"query": "float32", "key": "float32"})
    expect(len({base, longer, fewer_key_heads, wider}) == 4,
           "a longer sequence, another shape of the keys alone, or another dtype gave the same key")


@cache_key.case(hint="Options such as is_causal change the work (and so the best blocks).")
def other_options_get_other_keys(key_fn):
    expect(_key(key_fn) != _key(key_fn, options={"is_causal": False, "logits_soft_cap": None}),
           "is_causal=True and is_causal=False gave the same key")


@cache_key.case(hint="A new release may change the kernels: put the library version in the key so "
                     "that old results are not reused.")
def another_version_gets_another_key(key_fn):
    expect(_key(key_fn) != _key(key_fn, version="0.2.0"), "two library versions gave the same key")


@cache_key.case(points=2, hint="Every dimension of every shape counts, and so does which array has which "
                               "shape: keep the argument names with their shapes.")
def each_dimension_and_each_name_counts(key_fn):
    base = _key(key_fn)
    for changed, what in [({"query": (4, 1024, 8, 128), "key": (4, 1024, 2, 128)}, "the batch size"),
                          ({"query": (2, 1024, 8, 64), "key": (2, 1024, 2, 64)}, "the head dimension"),
                          ({"query": (2, 2048, 4, 128), "key": (2, 2048, 1, 128)}, "the length and "
                                                                                  "the heads, traded"),
                          ({"query": (2, 1024, 2, 128), "key": (2, 1024, 8, 128)}, "which array has 8 "
                                                                                   "heads")]:
        expect(_key(key_fn, shapes=changed) != base, f"changing only {what} gave the same key")
    expect(_key(key_fn, dtypes={"query": "bfloat16", "key": "float32"})
           != _key(key_fn, dtypes={"query": "float32", "key": "bfloat16"}),
           "swapping the dtypes of query and key gave the same key")


@cache_key.case(points=2, hint="The cache is a file that later processes read: a key made with hash() of a "
                               "string (salted per process) or id() never matches there.")
def the_key_is_the_same_in_another_process(key_fn):
    expect_same_across_processes(lambda: _key(key_fn), what="the cache key")


# ---------------------------------------------------------------- 10.timing_loop

timing_loop = Exercise("10.timing_loop", "An autotuner's timing loop: warm up, repeat, keep the median")


class _SimulatedMachine:
    """A clock and a `run(config)` whose n-th run of a config takes costs[config][n] seconds."""

    def __init__(self, costs):
        self.costs, self.now, self.runs = costs, 0.0, {config: 0 for config in costs}

    def clock(self):
        return self.now

    def run(self, config):
        self.now += self.costs[config][self.runs[config]]
        self.runs[config] += 1


def _tune(tune_fn, costs, **kwargs):
    machine = _SimulatedMachine(costs)
    got = tune_fn(list(costs), machine.run, machine.clock, **kwargs)
    expect(isinstance(got, tuple) and len(got) == 2, f"expected a pair (best, times), got {got!r:.100}")
    return machine, got


# The first run of each config pays a one-off cost (compilation, caches) of 100 s.
_OUTLIER = {(128, 128): [100.0, 5.0, 5.0, 5.0, 5.0, 5.0], (256, 256): [100.0, 4.0, 4.0, 50.0, 4.0, 4.0],
            (512, 512): [100.0, 6.0, 6.0, 6.0, 6.0, 6.0]}


@timing_loop.case(points=2, hint="Keep the config with the lowest *median* time: one slow run (another "
                                 "process, a page fault) must not decide.")
def the_lowest_median_wins(tune_fn):
    _, (best, _) = _tune(tune_fn, _OUTLIER, warmup=1, repeats=5)
    expect(best == (256, 256), f"expected (256, 256) (median 4 s; its mean, 13.2 s, would lose), "
                               f"got {best!r}")


@timing_loop.case(hint="Run each config `warmup` times without timing it, then `repeats` times, timed.")
def each_config_runs_warmup_plus_repeats_times(tune_fn):
    machine, _ = _tune(tune_fn, _OUTLIER, warmup=1, repeats=5)
    expect(machine.runs == dict.fromkeys(_OUTLIER, 6), f"expected 6 runs of each config, got {machine.runs}")


@timing_loop.case(hint="Time each run on its own: read the clock just before and just after it. Warm-up "
                       "runs are not timed, and the median of two runs is their mean.")
def the_warm_up_is_not_timed(tune_fn):
    costs = {(128, 128): [100.0, 3.0, 5.0], (256, 256): [90.0, 4.0, 4.0]}
    _, (best, times) = _tune(tune_fn, costs, warmup=1, repeats=2)
    expect(isinstance(times, dict) and set(times) == set(costs),
           f"expected times for {sorted(costs)}, got {times!r:.100}")
    expect_equal(np.float64(times[(128, 128)]), np.float64(4.0), what="the median of (3 s, 5 s)")
    expect_equal(np.float64(times[(256, 256)]), np.float64(4.0), what="the median of (4 s, 4 s)")


@timing_loop.case(points=2, hint="`warmup` and `repeats` are arguments: run each config `warmup` times "
                                 "untimed, then time `repeats` runs, and with an even number of runs the "
                                 "median is the mean of the middle two.")
def warmup_and_repeats_are_the_callers(tune_fn):
    costs = {"slow to compile": [100.0, 100.0, 100.0, 2.0, 9.0, 3.0, 2.0],
             "quick to compile": [1.0, 1.0, 1.0, 5.0, 5.0, 5.0, 5.0]}
    machine, (best, times) = _tune(tune_fn, costs, warmup=3, repeats=4)
    expect(machine.runs == dict.fromkeys(costs, 7), f"expected 3 + 4 runs of each config, got {machine.runs}")
    expect(isinstance(times, dict) and set(times) == set(costs),
           f"expected times for {sorted(costs)}, got {times!r:.100}")
    expect_equal(np.float64(times["slow to compile"]), np.float64(2.5), what="the median of (2, 9, 3, 2) s")
    expect(best == "slow to compile",
           f"expected 'slow to compile' (median 2.5 s after its warm-up), got {best!r}")


@timing_loop.case(points=2, hint="Not the fastest run: a config whose best run is lucky but whose typical "
                                 "run is slow must lose to one that is steadily fast.")
def a_lucky_fastest_run_does_not_win(tune_fn):
    costs = {"lucky": [50.0, 1.0, 9.0, 9.0, 9.0, 9.0], "steady": [50.0, 3.0, 3.0, 3.0, 3.0, 3.0],
             "noisy": [50.0, 2.0, 8.0, 2.5, 8.0, 8.0]}
    _, (best, _) = _tune(tune_fn, costs, warmup=1, repeats=5)
    expect(best == "steady", f"expected 'steady' (median 3 s), got {best!r}")


@timing_loop.case(hint="Return times[config] = the median of that config's timed runs, for every config.")
def times_holds_every_median(tune_fn):
    _, (_, times) = _tune(tune_fn, _OUTLIER, warmup=1, repeats=5)
    expect(isinstance(times, dict), f"expected a dict of times, got {type(times).__name__}")
    medians = {(128, 128): 5.0, (256, 256): 4.0, (512, 512): 6.0}
    expect_equal({str(k): np.float64(v) for k, v in times.items()},
                 {str(k): np.float64(v) for k, v in medians.items()}, what="times")
