"""The autotuner and its cache: deterministic picks with a fake clock, hits that cost no timing, the
miss policies, a corrupt cache that is reported and ignored, and a tuned config that reaches both
the forward and the backward pass."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stacklib.kernels import api, autotuning, record_calls
from stacklib.kernels.autotuning import Autotuner, AutotuningCache, AutotuningCacheMiss
from stacklib.kernels.registry import Implementation, bind
from stacklib.kernels.xla_chunked import AttentionConfig


class ScriptedClock:
    """A fake clock: the i-th timed run takes durations[i] seconds (reads come in start/end pairs)."""

    def __init__(self, durations=()):
        self.durations, self.reads, self.now = list(durations), 0, 0.0

    def __call__(self):
        if self.reads % 2:
            self.now += self.durations[self.reads // 2]
        self.reads += 1
        return self.now


def _scaled(x, *, factor, config):  # a toy op whose "kernel" has one knob
    return x * factor * config.block_q / config.block_q


TOY = Implementation("toy", _scaled, backends=("cpu", "gpu", "tpu"), dtypes=("float32",),
                     heuristic_config=lambda call: AttentionConfig(8, 8),
                     candidate_configs=lambda call: [AttentionConfig(8, 8), AttentionConfig(16, 8),
                                                     AttentionConfig(32, 8)])
REPEATS = 3


def _toy_call(shape=(4, 4), dtype=jnp.float32):
    return bind("toy", {"x": jnp.zeros(shape, dtype)}, {"factor": 2.0})


@pytest.fixture
def tuned(tmp_path):
    """Tune the toy op once with a clock that makes (16, 8) the fastest (by median, despite an outlier)."""
    clock = ScriptedClock([3.0] * REPEATS + [1.0, 9.0, 1.0] + [2.0] * REPEATS)
    cache = AutotuningCache(tmp_path / "cache.json")
    with autotuning.using(cache, Autotuner(clock=clock, repeats=REPEATS)), \
            autotuning.autotuning_cache_miss_fallback("autotune"):
        config = autotuning.get_config(TOY, _toy_call())
    return config, clock, cache


def test_the_fastest_median_wins_and_is_stored(tuned):
    config, clock, cache = tuned
    assert config == AttentionConfig(16, 8)  # median 1.0 beats 2.0 and 3.0; its mean (3.7) would not
    assert clock.reads == 2 * REPEATS * 3  # warm-up runs are not timed
    (entry,) = json.loads(cache.path.read_text()).values()
    assert entry["config"] == {"block_q": 16, "block_k": 8}
    assert entry["times_ms"]['{"block_q": 16, "block_k": 8}'] == pytest.approx(1000.0)


def test_a_cache_hit_reads_the_clock_zero_times_also_from_a_fresh_process_view_of_the_file(tuned):
    config, _, cache = tuned
    for reopened in (cache, AutotuningCache(cache.path)):
        clock = ScriptedClock()
        with autotuning.using(reopened, Autotuner(clock=clock)), \
                autotuning.autotuning_cache_miss_fallback("autotune"):
            assert autotuning.get_config(TOY, _toy_call()) == config
        assert clock.reads == 0


def test_the_key_holds_device_kind_shapes_dtypes_options_and_versions():
    key = json.loads(autotuning.cache_key("toy", _toy_call()))
    assert key["device_kind"] == jax.devices()[0].device_kind
    assert key["arrays"] == {"x": [[4, 4], "float32"]} and key["static"] == {"factor": 2.0}
    assert set(key["versions"]) == {"stacklib", "jax"}
    keys = {autotuning.cache_key("toy", call) for call in
            (_toy_call(), _toy_call((4, 5)), _toy_call(dtype=jnp.bfloat16),
             bind("toy", {"x": jnp.zeros((4, 4))}, {"factor": 3.0}))}
    assert len(keys) == 4


def test_a_miss_uses_heuristics_by_default_without_timing_or_writing(tmp_path):
    clock, cache = ScriptedClock(), AutotuningCache(tmp_path / "cache.json")
    with autotuning.using(cache, Autotuner(clock=clock)):
        assert autotuning.get_config(TOY, _toy_call()) == AttentionConfig(8, 8)
    assert clock.reads == 0 and not cache.path.exists()


def test_a_miss_under_the_error_policy_raises_but_a_hit_does_not(tuned, tmp_path):
    config, _, cache = tuned
    with autotuning.autotuning_cache_miss_fallback("error"):
        with autotuning.using(AutotuningCache(tmp_path / "empty.json")):
            with pytest.raises(AutotuningCacheMiss, match=r"no tuned config for 'toy' in .*empty.json"):
                autotuning.get_config(TOY, _toy_call())
        with autotuning.using(cache):
            assert autotuning.get_config(TOY, _toy_call()) == config
    with pytest.raises(ValueError, match="one of"):
        autotuning.autotuning_cache_miss_fallback("sometimes").__enter__()


@pytest.mark.parametrize("content", ["{not json", '["a", "list"]', '{"key": {"no config": 1}}'])
def test_a_corrupt_cache_is_reported_ignored_and_replaced(tmp_path, content):
    path = tmp_path / "cache.json"
    path.write_text(content)
    clock = ScriptedClock([1.0] * 3 * REPEATS)
    with autotuning.using(AutotuningCache(path), Autotuner(clock=clock, repeats=REPEATS)), \
            autotuning.autotuning_cache_miss_fallback("autotune"):
        with pytest.warns(RuntimeWarning, match=r"cache.json cannot be read .* ignoring it"):
            config = autotuning.get_config(TOY, _toy_call())
    assert config == AttentionConfig(8, 8)  # all equal: the first candidate
    assert len(json.loads(path.read_text())) == 1  # the next save replaced the corrupt file


def test_a_candidate_that_fails_is_left_out_and_all_failing_is_an_error():
    def picky(x, *, factor, config):
        if config.block_q != 32:
            raise ValueError(f"block_q={config.block_q} does not fit")
        return x * factor

    impl = Implementation("picky", picky, ("cpu",), ("float32",), heuristic_config=TOY.heuristic_config,
                          candidate_configs=TOY.candidate_configs)
    times = Autotuner(clock=ScriptedClock([1.0] * REPEATS), repeats=REPEATS).time_configs(impl, _toy_call())
    assert list(times) == [AttentionConfig(32, 8)]
    with pytest.raises(RuntimeError, match="every candidate failed.*does not fit"):
        Autotuner().time_configs(impl, _toy_call(), configs=[AttentionConfig(8, 8)])


def _scan_lengths(jaxpr):
    """The trip counts of every scan in a jaxpr, nested ones included."""
    lengths = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            lengths.add(eqn.params["length"])
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else [param]:
                if hasattr(sub, "jaxpr"):
                    lengths |= _scan_lengths(sub.jaxpr if hasattr(sub.jaxpr, "eqns") else sub.jaxpr.jaxpr)
                elif hasattr(sub, "eqns"):
                    lengths |= _scan_lengths(sub)
    return lengths


def test_the_tuned_chunks_reach_the_forward_and_the_backward_pass_of_xla_chunked(tmp_path):
    q = jax.random.normal(jax.random.key(0), (1, 600, 2, 8))
    kv = jax.random.normal(jax.random.key(1), (1, 300, 2, 8))
    candidates = api.ATTENTION.implementations["xla_chunked"].candidate_configs(
        bind("dot_product_attention", dict(query=q, key=kv, value=kv), {}))
    assert candidates == [AttentionConfig(256, 300), AttentionConfig(512, 300), AttentionConfig(600, 300)]
    clock = ScriptedClock([1.0] * REPEATS + [2.0] * REPEATS + [3.0] * REPEATS)  # (256, 300) wins

    def loss(q):
        return api.dot_product_attention(q, kv, kv, is_causal=True, implementation="xla_chunked").sum()

    with autotuning.using(AutotuningCache(tmp_path / "c.json"), Autotuner(clock=clock, repeats=REPEATS)):
        with autotuning.autotuning_cache_miss_fallback("autotune"):
            grad_jaxpr = jax.make_jaxpr(jax.grad(loss))(q)
        with autotuning.autotuning_cache_miss_fallback("error"):  # a hit now
            forward_jaxpr = jax.make_jaxpr(loss)(q)
    assert clock.reads == 2 * REPEATS * 3
    # 600 rows in blocks of 256 -> 3 query blocks; 300 keys in one block. The heuristic (512, 300)
    # would give 2 query blocks. The backward loops are the transposes of the forward ones.
    assert _scan_lengths(grad_jaxpr.jaxpr) == _scan_lengths(forward_jaxpr.jaxpr) == {3, 1}
    assert _scan_lengths(jax.make_jaxpr(jax.grad(loss))(q).jaxpr) == {2, 1}  # untuned: the heuristic


def test_the_tuned_blocks_reach_every_pallas_kernel_forward_and_backward(tmp_path):
    q = jax.random.normal(jax.random.key(0), (1, 72, 2, 16))
    kv = jax.random.normal(jax.random.key(1), (1, 40, 1, 16))
    clock = ScriptedClock([1.0] * REPEATS + [2.0] * REPEATS)  # (64, 40) beats (72, 40) and the default
    with autotuning.using(AutotuningCache(tmp_path / "c.json"), Autotuner(clock=clock, repeats=REPEATS)), \
            autotuning.autotuning_cache_miss_fallback("autotune"), record_calls() as calls:
        loss = lambda q: api.dot_product_attention(q, kv, kv, implementation="pallas").sum()  # noqa: E731
        jax.make_jaxpr(jax.grad(loss))(q)
    traced = calls[-3:]  # before them: the forward kernels compiled while tuning
    assert [c.name for c in traced] == ["flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"]
    for call in traced:
        assert call.in_blocks[1][2] == 64 and call.in_blocks[2][2] == 40, call  # query block, key block


def test_autotune_tunes_every_op_a_function_calls(tmp_path):
    q = jax.random.normal(jax.random.key(0), (1, 64, 2, 8))
    clock = ScriptedClock([1.0] * 100)

    def model(q):
        return api.dot_product_attention(q, q, q, implementation="xla_chunked")

    cache = AutotuningCache(tmp_path / "c.json")
    with autotuning.using(cache, Autotuner(clock=clock, repeats=1)):
        autotuning.autotune(model, q)
        assert len(cache) == 1 and clock.reads == 2
        with autotuning.autotuning_cache_miss_fallback("error"):
            out = jax.jit(model)(q)
    np.testing.assert_allclose(out, api.dot_product_attention(q, q, q), atol=2e-6)

