"""stacklib.kernels' API: one function, several implementations, fallback with reasons, checked inputs,
and every implementation and every config the autotuner may pick equal to a float64 reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stacklib.kernels import api
from stacklib.kernels.registry import NoImplementationError

B, T, S, N, K, H = 2, 72, 40, 4, 2, 16
SCALE = H**-0.5


def _inputs(dtype=jnp.float32, T=T, S=S, h=H, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    shapes = [(B, T, N, H), (B, S, K, H), (B, S, K, h)]
    return tuple(jax.random.normal(key, shape).astype(dtype) for key, shape in zip(ks, shapes, strict=True))


def numpy_attention(q, k, v, bias=None, mask=None, *, scale, is_causal=False, query_seq_lengths=None,
                    key_value_seq_lengths=None, local_window_size=None, logits_soft_cap=None):
    """The rule of xla_attention.py written again in float64 NumPy, one option per line."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    Bq, Tq, Nq, _ = q.shape
    Sk, Kk = k.shape[1], k.shape[2]
    k, v = np.repeat(k, Nq // Kk, axis=2), np.repeat(v, Nq // Kk, axis=2)  # query head n uses kv head n // G
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    if logits_soft_cap is not None:
        logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
    t, s = np.arange(Tq)[:, None], np.arange(Sk)[None, :]
    ok = np.ones((Bq, Nq, Tq, Sk), bool)
    if mask is not None:
        ok &= np.asarray(mask)
    if is_causal:
        ok &= s <= t
    if local_window_size is not None:
        ok &= (s >= t - local_window_size[0]) & (s <= t + local_window_size[1])
    if query_seq_lengths is not None:
        ok &= t < np.asarray(query_seq_lengths)[:, None, None, None]
    if key_value_seq_lengths is not None:
        ok &= s < np.asarray(key_value_seq_lengths)[:, None, None, None]
    logits = np.where(ok, logits, np.finfo(np.float32).min)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", weights, v)


def _spy(monkeypatch, registry=api.ATTENTION):
    """Record which implementations run (replacing each registered one by a recording copy)."""
    ran = []
    for name, impl in list(registry.implementations.items()):
        def run(*args, _impl=impl, **kwargs):
            ran.append(_impl.name)
            return _impl.run(*args, **kwargs)
        monkeypatch.setitem(registry.implementations, name, dataclasses.replace(impl, run=run))
    return ran


# ---------------------------------------------------------------- choosing an implementation


def test_the_default_order_depends_on_the_backend():
    assert api.ATTENTION.default_order("cpu") == ("xla",)
    assert api.ATTENTION.default_order("gpu") == ("cudnn", "xla")
    assert api.ATTENTION.default_order("tpu") == ("pallas", "xla")


def test_none_runs_the_default_and_a_name_runs_that_implementation(monkeypatch):
    ran = _spy(monkeypatch)
    q, k, v = _inputs()
    api.dot_product_attention(q, k, v)
    api.dot_product_attention(q, k, v, implementation="xla_chunked")
    assert ran == ["xla", "xla_chunked"]


def test_a_sequence_runs_the_first_implementation_that_can_serve_the_call(monkeypatch):
    ran = _spy(monkeypatch)
    q, k, v = _inputs()
    bias = jnp.zeros((T, S))
    api.dot_product_attention(q, k, v, bias, implementation=("cudnn", "pallas", "xla_chunked", "xla"))
    assert ran == ["xla_chunked"]  # cudnn: not on cpu; pallas: no bias


def test_a_symbolic_sequence_length_leaves_the_call_to_xla(monkeypatch):
    # jax.export with a symbolic length: the blocked implementations cannot cut tiles at trace time.
    ran = _spy(monkeypatch)
    t = jax.export.symbolic_shape("t")[0]
    q, k = jax.ShapeDtypeStruct((2, t, N, H), jnp.float32), jax.ShapeDtypeStruct((2, t, K, H), jnp.float32)

    def export(implementation):
        attend = jax.jit(lambda q, k: api.dot_product_attention(q, k, k, is_causal=True,
                                                                implementation=implementation))
        return jax.export.export(attend)(q, k)

    export(("pallas", "xla_chunked", "xla"))
    assert ran == ["xla"]
    with pytest.raises(NoImplementationError, match="'xla_chunked' needs static shapes"):
        export("xla_chunked")


def test_when_no_implementation_can_serve_the_call_the_error_gives_each_reason():
    q, k, v = _inputs()
    with pytest.raises(NoImplementationError) as error:
        api.dot_product_attention(q, k, v, jnp.zeros((T, S)), implementation=["cudnn", "pallas"])
    assert error.value.reasons == {"cudnn": "runs on gpu, and this call is on cpu",
                                   "pallas": "does not support bias"}
    assert "'cudnn' runs on gpu" in str(error.value) and "'pallas' does not support bias" in str(error.value)


def test_a_dtype_an_implementation_does_not_support_names_the_argument_shape_and_fix():
    q, k, v = _inputs(jnp.float16)
    with pytest.raises(NoImplementationError, match=r"float16 \(query of shape \(2, 72, 4, 16\)\).*"
                                                    r"query.astype\(jnp.float32\)"):
        api.dot_product_attention(q, k, v, implementation="pallas")


def test_an_implementation_that_raises_not_implemented_while_tracing_is_skipped_with_its_reason(monkeypatch):
    def refuse(*args, **kwargs):
        raise NotImplementedError("not today")

    impl = api.ATTENTION.implementations["xla_chunked"]
    monkeypatch.setitem(api.ATTENTION.implementations, "xla_chunked", dataclasses.replace(impl, run=refuse))
    q, k, v = _inputs()
    out = api.dot_product_attention(q, k, v, implementation=("xla_chunked", "xla"))
    np.testing.assert_allclose(out, numpy_attention(q, k, v, scale=SCALE), atol=1e-6)
    with pytest.raises(NoImplementationError, match="'xla_chunked' not today"):
        api.dot_product_attention(q, k, v, implementation="xla_chunked")


def test_an_unknown_name_lists_the_known_ones_and_an_empty_sequence_is_refused():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="known: 'xla', 'xla_chunked', 'cudnn', 'pallas'"):
        api.dot_product_attention(q, k, v, implementation="mosaic")
    with pytest.raises(ValueError, match="empty sequence"):
        api.dot_product_attention(q, k, v, implementation=[])


# ---------------------------------------------------------------- bad input, before any kernel runs

Q, KV = jnp.zeros((B, T, N, H)), jnp.zeros((B, S, K, H))
BAD_ATTENTION = [
    (dict(query=jnp.zeros((T, N))), r"query must be \[\*B, T, N, H\].*query\[None\].*query \(72, 4\)"),
    (dict(key=jnp.zeros((S, K, H))), r"same rank"),
    (dict(key=jnp.zeros((B, S, 3, H)), value=jnp.zeros((B, S, 3, H))),
     r"N=4 must be a multiple of the key/value head count K=3.*K in \[1, 2, 4\].*key \(2, 40, 3, 16\)"),
    (dict(key=jnp.zeros((1, S, K, H)), value=jnp.zeros((1, S, K, H))), r"same batch dims"),
    (dict(key=jnp.zeros((B, S, K, 8))), r"key's head dim H must equal query's \(16\), got 8"),
    (dict(value=jnp.zeros((B, S + 1, K, H))), r"same sequence length S"),
    (dict(key=KV.astype(jnp.bfloat16)), r"share one floating dtype.*key.astype\(query.dtype\)"),
    (dict(bias=jnp.zeros((T, S + 1))),
     r"bias must broadcast to \[\*B, N, T, S\] = \[2, 4, 72, 40\].*bias \(72, 41\)"),
    (dict(mask=jnp.ones((T, S))), r"mask must be boolean.*mask.astype\(bool\)"),
    (dict(query_seq_lengths=jnp.array([3])), r"query_seq_lengths must be integers of shape \*B = \(2,\)"),
    (dict(key_value_seq_lengths=jnp.array([3.0, 4.0])), r"key_value_seq_lengths must be integers"),
    (dict(local_window_size=(2, -1)), r"local_window_size must be an int >= 0 or a pair"),
    (dict(logits_soft_cap=0.0), r"logits_soft_cap must be positive"),
]


@pytest.mark.parametrize("change, message", BAD_ATTENTION, ids=[m[:30] for _, m in BAD_ATTENTION])
def test_bad_attention_arguments_are_refused_before_any_implementation_runs(monkeypatch, change, message):
    monkeypatch.setattr(api, "_dispatch", lambda *a, **k: pytest.fail("dispatched a bad call"))
    arguments = dict(query=Q, key=KV, value=KV) | change
    with pytest.raises(ValueError, match=message):
        api.dot_product_attention(**arguments)


def test_bad_layer_norm_and_glu_arguments_name_the_shapes_and_fix():
    x = jnp.zeros((4, 8))
    with pytest.raises(ValueError, match=r"scale must have shape \(8,\) = \(x.shape\[-1\],\).*got \(4,\)"):
        api.layer_norm(x, jnp.ones(4), None)
    with pytest.raises(ValueError, match=r"axis=2 is out of range for x of shape \(4, 8\)"):
        api.layer_norm(x, None, None, axis=2)
    with pytest.raises(ValueError, match=r"fused weights must be \[K, 2, N\] with K = x.shape\[-1\] = 8"):
        api.gated_linear_unit(x, jnp.zeros((8, 3, 5)))
    with pytest.raises(ValueError, match=r"pair \(w_gate, w_up\) of \[K, N\].*\[\(8, 5\), \(7, 5\)\]"):
        api.gated_linear_unit(x, (jnp.zeros((8, 5)), jnp.zeros((7, 5))))


# ---------------------------------------------------------------- numerics regression
#
# Tolerances (absolute, on outputs of size ~1): float32 forward 2e-6 against float64 (the blocked
# implementations sum in another order than the plain one: a few float32 ulps); float32
# gradients 2e-5 against the plain implementation's float32 gradient; bfloat16 outputs 2e-2
# against float64 on the same bfloat16 inputs (bfloat16 has 8 bits of mantissa: an ulp at 2 is
# 1.6e-2), bfloat16 gradients 6e-2 (rounded inputs, outputs and cotangents).
TOLERANCE = {jnp.float32: dict(forward=2e-6, gradient=2e-5), jnp.bfloat16: dict(forward=2e-2, gradient=6e-2)}

OPTIONS = dict(is_causal=True, local_window_size=(30, 4), logits_soft_cap=4.0,
               query_seq_lengths=jnp.array([60, 72]), key_value_seq_lengths=jnp.array([40, 25]))


def _configs(name, q, k, v, bias=None, mask=None, **options):
    impl = api.ATTENTION.implementations[name]
    if not impl.tunable:
        return [None]
    arrays = dict(query=q, key=k, value=v, bias=bias, mask=mask,
                  query_seq_lengths=options.get("query_seq_lengths"),
                  key_value_seq_lengths=options.get("key_value_seq_lengths"))
    call = api.bind("dot_product_attention", arrays, {})
    return impl.candidate_configs(call)


def _run(name, config, q, k, v, bias=None, mask=None, **options):
    return api.ATTENTION.implementations[name].run(
        q, k, v, bias, mask, options.get("query_seq_lengths"), options.get("key_value_seq_lengths"),
        scale=SCALE, is_causal=options.get("is_causal", False),
        local_window_size=options.get("local_window_size"), logits_soft_cap=options.get("logits_soft_cap"),
        config=config)


CASES = [("xla", "all"), ("xla_chunked", "all"), ("pallas", "causal")]  # pallas: causal, key lengths only


def _options(which):
    if which == "all":
        return dict(OPTIONS, bias=jax.random.normal(jax.random.key(7), (N, T, S)),
                    mask=jax.random.bernoulli(jax.random.key(8), 0.8, (B, 1, T, S)))
    return dict(is_causal=True, key_value_seq_lengths=jnp.array([40, 25])) if which == "causal" else {}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name, which", CASES, ids=[f"{n}-{w}" for n, w in CASES])
def test_every_implementation_and_candidate_config_matches_the_reference(name, which, dtype):
    q, k, v = _inputs(dtype, T=300, S=260) if name == "xla_chunked" else _inputs(dtype)
    options = _options(which)
    if name == "xla_chunked" and which == "all":  # the (N, T, S) bias and mask above are for T=72, S=40
        options = dict(OPTIONS, query_seq_lengths=jnp.array([250, 300]),
                       key_value_seq_lengths=jnp.array([260, 99]))
    dout = jax.random.normal(jax.random.key(3), q.shape)
    expected = numpy_attention(q, k, v, **options, scale=SCALE)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    expected_grads = jax.jit(
        lambda *qkv: jax.vjp(lambda *a: _run("xla", None, *a, **options), *qkv)[1](dout))(*f32)
    configs = _configs(name, q, k, v, **options)
    assert 1 <= len(configs) <= 3
    tolerance = TOLERANCE[dtype]
    for config in configs:
        out, vjp = jax.jit(lambda *qkv, config=config: jax.vjp(
            lambda *a: _run(name, config, *a, **options), *qkv))(q, k, v)
        assert out.dtype == dtype
        np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=tolerance["forward"],
                                   err_msg=f"{name} {config}")
        for got, want, what in zip(vjp(dout.astype(dtype)), expected_grads, "qkv", strict=True):
            np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=tolerance["gradient"],
                                       err_msg=f"{name} {config} d{what}")


def test_odd_blocks_that_divide_nothing_still_give_the_reference():
    q, k, v = _inputs()
    options = _options("all")
    expected = numpy_attention(q, k, v, **options, scale=SCALE)
    for config in [api.AttentionConfig(48, 16), api.AttentionConfig(5, 7), api.AttentionConfig(1000, 1000)]:
        out = jax.jit(lambda q, k, v, config=config: _run("xla_chunked", config, q, k, v, **options))(q, k, v)
        np.testing.assert_allclose(out, expected, atol=2e-6, err_msg=str(config))


def test_extra_batch_dims_grouped_heads_and_a_different_value_head_dim():
    ks = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(ks[0], (2, 3, 16, 8, 8)), jax.random.normal(ks[1], (2, 3, 24, 2, 8)),
               jax.random.normal(ks[2], (2, 3, 24, 2, 5)))
    expected = numpy_attention(q.reshape(6, 16, 8, 8), k.reshape(6, 24, 2, 8), v.reshape(6, 24, 2, 5),
                               scale=8**-0.5, is_causal=True).reshape(2, 3, 16, 8, 5)
    for name in ("xla", "xla_chunked"):
        out = jax.jit(lambda q, k, v, name=name: api.dot_product_attention(
            q, k, v, is_causal=True, implementation=name))(q, k, v)
        np.testing.assert_allclose(out, expected, atol=2e-6, err_msg=name)


def test_a_row_that_sees_no_key_gets_the_mean_of_the_values_as_in_tokamax():
    q, k, v = _inputs()
    lengths = jnp.array([0, S])
    for name in ("xla", "xla_chunked"):
        out = jax.jit(lambda q, k, v, name=name: api.dot_product_attention(
            q, k, v, key_value_seq_lengths=lengths, implementation=name))(q, k, v)
        np.testing.assert_allclose(out[0], np.broadcast_to(np.repeat(v[0].mean(0), N // K, 0), (T, N, H)),
                                   atol=2e-6)


def _layer_norm_numpy(x, scale, offset, subtract_mean=True, epsilon=1e-6):
    x = np.asarray(x, np.float64)
    y = x - x.mean(-1, keepdims=True) if subtract_mean else x
    y = y / np.sqrt((y**2).mean(-1, keepdims=True) + epsilon)
    return y * np.asarray(scale, np.float64) + np.asarray(offset, np.float64)


@pytest.mark.parametrize("dtype, atol", [(jnp.float32, 2e-6), (jnp.bfloat16, 3e-2)], ids=["f32", "bf16"])
def test_layer_norm_and_gated_linear_unit_match_numpy(dtype, atol):
    ks = jax.random.split(jax.random.key(2), 4)
    x = jax.random.normal(ks[0], (3, 5, 32)).astype(dtype)
    scale, offset = jax.random.normal(ks[1], (32,)), jax.random.normal(ks[2], (32,))
    for subtract_mean in (True, False):
        out = api.layer_norm(x, scale, offset, subtract_mean=subtract_mean)
        assert out.dtype == dtype
        expected = _layer_norm_numpy(x, scale, offset, subtract_mean)
        np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=atol * 4, rtol=0)
    w = (jax.random.normal(ks[3], (32, 2, 8)) / 6).astype(dtype)
    gate, up = (np.einsum("...k,kn->...n", np.asarray(x, np.float64), np.asarray(w[:, i], np.float64))
                for i in (0, 1))
    expected = gate / (1 + np.exp(-gate)) * up  # swish(gate) * up
    for weights in (w, (w[:, 0], w[:, 1])):
        out = api.gated_linear_unit(x, weights, activation=jax.nn.swish)
        np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=atol, rtol=0)


# ---------------------------------------------------------------- memory (compile-time numbers, no timing)


def _temp_bytes(implementation, T, gradient=False):
    spec = jax.ShapeDtypeStruct((1, T, 4, 64), jnp.float32)

    def attend(q, k, v):
        return api.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)

    fn = jax.grad(lambda q, k, v: attend(q, k, v).sum()) if gradient else attend
    return jax.jit(fn).lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes


def test_chunked_temporary_memory_grows_linearly_where_plain_attention_grows_quadratically():
    plain = {T: _temp_bytes("xla", T) for T in (2048, 4096)}
    chunked = {T: _temp_bytes("xla_chunked", T) for T in (2048, 4096)}
    assert plain[4096] >= 3.9 * plain[2048]  # the [N, T, T] logits
    assert chunked[4096] <= 2.0 * chunked[2048]  # at most linear: no [T, T] array anywhere
    assert chunked[4096] * 10 < plain[4096]
    gradient = {T: _temp_bytes("xla_chunked", T, gradient=True) for T in (2048, 4096)}
    assert gradient[4096] <= 2.0 * gradient[2048]  # the backward pass recomputes tiles, stores none
