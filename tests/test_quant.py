"""Behaviour of stacklib.quant: formats and bounds, rules, bad input, and what the quantized
models do (stay separate from the original, jit, split/merge, train)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stacklib.nn as nnx
import stacklib.quant as sq


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(64, 32, rngs=rngs)
        self.out = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


@pytest.fixture
def model_and_input():
    return MLP(nnx.Rngs(0)), jax.random.normal(jax.random.key(1), (8, 64))


def rule(**kwargs):
    return sq.QuantizationRule(**{"module_path": ".*", "weight_qtype": jnp.int8, **kwargs})


def test_int8_absmax_maps_the_largest_magnitude_to_the_edge_of_the_range():
    q = sq.quantize(jnp.array([-127.5, -1.5, 0.0, 0.5, 2.5, 127.5]), jnp.int8)
    assert float(q.scale[0]) == 1.0  # 127.5 / 127.5: every x / scale below is exact
    # Ties round half to even (-1.5 -> -2, 0.5 -> 0, 2.5 -> 2); 127.5 rounds to 128, which the
    # saturating cast turns into 127, while -127.5 -> -128 fits: so -128 occurs, 128 cannot.
    np.testing.assert_array_equal(q.qvalue, [-128, -2, 0, 0, 2, 127])
    assert q.qvalue.dtype == jnp.int8


def test_int4_values_stay_in_range_and_error_is_at_most_half_a_step():
    x = jax.random.normal(jax.random.key(0), (256, 64))
    q = sq.quantize(x, jnp.int4, channelwise_axes=(1,))
    assert q.qvalue.dtype == jnp.int4 and q.scale.shape == (1, 64)
    values = q.qvalue.astype(jnp.int32)
    assert int(values.min()) >= -8 and int(values.max()) <= 7
    assert float(jnp.max(jnp.abs(sq.dequantize(q) - x) / q.scale)) <= 0.5 + 1e-5


def test_minmax_represents_zero_exactly_and_uses_a_zero_point():
    x = jnp.array([[0.0, 1.0, 3.0, 7.0]])
    q = sq.quantize(x, jnp.int8, calibration_method="minmax")
    assert q.zero_point is not None and q.zero_point.dtype == jnp.int8
    assert float(sq.dequantize(q)[0, 0]) == 0.0
    np.testing.assert_allclose(sq.dequantize(q), x, atol=float(q.scale.max()) / 2 + 1e-6)


def test_tiled_scales_have_one_entry_per_tile_and_beat_per_tensor():
    x = jax.random.normal(jax.random.key(0), (128, 16)) * jnp.linspace(0.01, 10, 128)[:, None]
    tiled = sq.quantize(x, jnp.int4, channelwise_axes=(1,), tiled_axes={0: 16})
    per_channel = sq.quantize(x, jnp.int4, channelwise_axes=(1,))
    assert tiled.scale.shape == (8, 16) and per_channel.scale.shape == (1, 16)
    error = [float(jnp.mean((sq.dequantize(q) - x) ** 2)) for q in (tiled, per_channel)]
    assert error[0] < error[1] / 2


def test_bytes_shrink_4x_for_int8_and_8x_for_int4():
    w = jnp.ones((1024, 1024))
    assert w.nbytes / sq.quantize(w, jnp.int8).nbytes > 3.99
    assert w.nbytes / sq.quantize(w, jnp.int4).nbytes > 7.99


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: sq.quantize(jnp.ones(4), jnp.bfloat16), "qtype=.*bfloat16.*Use one of"),
        (lambda: sq.quantize(jnp.ones(4), "int3"), "qtype='int3'"),
        (lambda: sq.quantize(jnp.ones((6, 4)), jnp.int8, tiled_axes={0: 4}),
         "tile_size=4 does not divide axis 0"),
        (lambda: sq.quantize(jnp.ones(4), jnp.int8, calibration_method="rms"), "calibration_method='rms'"),
        (lambda: sq.QuantizationRule(weight_qtype="float16"), "weight_qtype="),
        (lambda: sq.QuantizationRule(weight_qtype=jnp.int8, tile_size=0), "tile_size=0 must be positive"),
        (lambda: sq.QuantizationRule(act_static_scale=True), "act_static_scale=True needs act_qtype"),
        (lambda: sq.LoraRule(module_path=".*", rank=0, alpha=1.0), r"rank=0.*positive integer"),
        (lambda: sq.LoraProvider(module_path=".*", rank=-2, alpha=1.0), r"rank=-2"),
    ],
)
def test_bad_input_names_the_argument_and_the_fix(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_quantize_model_without_sample_inputs_says_to_pass_them(model_and_input):
    model, _ = model_and_input
    with pytest.raises(ValueError, match=r"needs sample inputs.*quantize_model\(model, provider, x\)"):
        sq.quantize_model(model, sq.PtqProvider([rule()]))


def test_a_tile_size_that_does_not_divide_the_layer_fails_at_quantize_model(model_and_input):
    model, x = model_and_input
    with pytest.raises(ValueError, match="tile_size=12 does not divide axis 0"):
        sq.quantize_model(model, sq.PtqProvider([rule(tile_size=12)]), x)


def test_rule_that_matches_nothing_is_listed_and_warned_about(model_and_input):
    model, x = model_and_input
    typo = rule(module_path="hiden")
    provider = sq.PtqProvider([typo, rule(module_path="out")])
    with pytest.raises(ValueError, match="call quantize_model"):
        provider.get_unused_rules()
    listed = r"module_path='hiden'.*Paths that ran a contraction: \['hidden', 'out'\]"
    with pytest.warns(UserWarning, match=listed):
        sq.quantize_model(model, provider, x)
    assert provider.get_unused_rules() == [typo]


def test_first_matching_rule_wins_and_module_path_is_a_full_match(model_and_input):
    model, x = model_and_input
    provider = sq.PtqProvider([
        rule(module_path="hid", weight_qtype=jnp.int4),  # not a full match of 'hidden': unused
        rule(module_path="hidden", weight_qtype=jnp.int4),
        rule(module_path=".*", weight_qtype=jnp.int8),
    ])
    with pytest.warns(UserWarning):
        quantized = sq.quantize_model(model, provider, x)
    assert quantized.hidden.kernel[...].qvalue.dtype == jnp.int4
    assert quantized.out.kernel[...].qvalue.dtype == jnp.int8
    assert isinstance(quantized.hidden.bias[...], jax.Array)  # biases stay float, as in qwix


def test_original_model_is_untouched_and_the_copy_jits_splits_and_merges(model_and_input):
    model, x = model_and_input
    before = {p: v[...] for p, v in nnx.to_flat_state(nnx.state(model))}
    quantized = sq.quantize_model(model, sq.PtqProvider([rule()]), x)
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        assert variable[...] is before[path]
    assert type(model) is MLP and isinstance(quantized, MLP)
    eager = quantized(x)
    graphdef, state = nnx.split(quantized)
    traces = []

    @jax.jit
    def forward(state, x):
        traces.append(1)
        return nnx.merge(graphdef, state)(x)

    np.testing.assert_allclose(forward(state, x), eager, atol=1e-6)
    forward(state, x + 1)
    assert len(traces) == 1  # no retrace on the second call
    leaves = jax.tree.leaves(state)
    assert {leaf.dtype for leaf in leaves} >= {jnp.dtype(jnp.int8)}


def test_quantize_params_turns_a_float_checkpoint_into_the_ptq_models_params(model_and_input):
    model, x = model_and_input
    quantized = sq.quantize_model(model, sq.PtqProvider([rule(weight_qtype=jnp.int4, tile_size=16)]), x)
    trained = MLP(nnx.Rngs(7))  # "a float checkpoint" with other values
    params = sq.quantize_params(nnx.to_pure_dict(nnx.state(trained)), quantized)
    kernel = params["hidden"]["kernel"]
    assert isinstance(kernel, sq.QArray) and kernel.scale.shape == (4, 32)
    nnx.update(quantized, params)
    expected = sq.quantize_model(trained, sq.PtqProvider([rule(weight_qtype=jnp.int4, tile_size=16)]), x)
    np.testing.assert_array_equal(quantized(x), expected(x))
    with pytest.raises(ValueError, match="has no parameter at hidden/weights"):
        sq.quantize_params({"hidden": {"weights": jnp.ones(3)}}, quantized)


def test_qat_gradients_are_straight_through():
    layer = nnx.Linear(64, 10, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (8, 64))
    qat = sq.quantize_model(layer, sq.QtProvider([rule(weight_qtype=jnp.int4, act_qtype=jnp.int4)]), x)
    assert float(jnp.abs(qat(x) - layer(x)).max()) > 1e-2  # the forward pass is quantized ...
    graphdef, params = nnx.split(qat, nnx.Param)
    grads = jax.grad(lambda p, x: jnp.sum(nnx.merge(graphdef, p)(x) ** 2), argnums=(0, 1))
    (d_params, d_x) = grads(params, x)
    # ... the backward pass is the float product's, at the float operands, with g = 2 y.
    g = 2 * qat(x)
    np.testing.assert_allclose(d_params["kernel"][...], x.T @ g, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_x, g @ layer.kernel[...].T, rtol=1e-5, atol=1e-5)


def test_qlora_trains_the_adapters_and_leaves_the_quantized_base_bit_identical(model_and_input):
    model, x = model_and_input
    y = jnp.arange(8) % 10
    provider = sq.LoraProvider([sq.LoraRule(module_path=".*", rank=4, alpha=8.0, weight_qtype=jnp.int4)])
    lora = sq.apply_lora_to_model(model, provider, x, rngs=nnx.Rngs(0))
    graphdef, adapters, frozen = nnx.split(lora, sq.LoRAParam, ...)
    assert sorted(p for p, _ in nnx.to_flat_state(adapters)) == [
        ("hidden", "kernel_lora_a"), ("hidden", "kernel_lora_b"),
        ("out", "kernel_lora_a"), ("out", "kernel_lora_b")]
    base_before = list(jax.tree.leaves(frozen))

    def loss(adapters):
        logits = nnx.merge(graphdef, adapters, frozen)(x)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(8), y])

    losses = []
    for _ in range(20):
        value, grads = jax.value_and_grad(loss)(adapters)
        adapters = jax.tree.map(lambda a, g: a - 0.1 * g, adapters, grads)
        losses.append(float(value))
    assert losses[-1] < 0.5 * losses[0]
    for before, after in zip(base_before, jax.tree.leaves(frozen), strict=True):
        assert before.dtype == after.dtype
        np.testing.assert_array_equal(before, after)


def test_apply_lora_without_rngs_says_to_pass_them(model_and_input):
    model, x = model_and_input
    with pytest.raises(ValueError, match=r"rngs=nnx.Rngs\(0\)"):
        sq.apply_lora_to_model(model, sq.LoraProvider(module_path=".*", rank=2, alpha=2.0), x)
