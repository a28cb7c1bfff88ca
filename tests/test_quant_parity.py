"""stacklib.quant against qwix 0.1.8 on the same model: a flax.nnx MLP beside a stacklib.nn
one, with the same weights (the same seed gives bit-identical weights in both libraries,
which the first test checks), the same rules and the same inputs.

Tolerances, and why:
- quantized values and scales: exact. Both compute `round(x / scale)` with the same
  division (no reciprocal), the same half-to-even rounding and the same saturating cast, so
  there is no rounding-tie exception on these inputs: a tie (x / scale exactly k + 0.5)
  rounds the same way in both.
- PTQ outputs: exact (atol 0) for weight-only per-channel, tiled and w8a8 with dynamic and
  static scales: both dequantize-then-multiply (weight-only, small tiles) or both take the
  int32 product and rescale in the same order (w8a8).
- QAT forward: exact; gradients: atol 1e-6 (the same VJP, though qwix writes its backward
  products by hand and XLA may order the sums differently).
- LoRA/QLoRA initial outputs: exact, and equal to the base (float or PTQ) output, since B = 0.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx as flax_nnx

import stacklib.nn as nnx
import stacklib.quant as sq

# qwix 0.1.8 reads `.value`, deprecated in flax 0.12: its warnings are not ours.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# qwix 0.1.8 reads `.value`, deprecated in flax 0.12: its warnings are not ours.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def make_mlp(lib, seed=0):
    class MLP(lib.Module):
        def __init__(self, rngs):
            self.hidden = lib.Linear(64, 32, rngs=rngs)
            self.out = lib.Linear(32, 10, rngs=rngs)

        def __call__(self, x):
            return self.out(lib.relu(self.hidden(x)))

    return MLP(lib.Rngs(seed))


@pytest.fixture(scope="module")
def models():
    ours, theirs = make_mlp(nnx), make_mlp(flax_nnx)
    x = jax.random.normal(jax.random.key(1), (16, 64))
    np.testing.assert_array_equal(ours(x), theirs(x))  # same weights, bit for bit
    return ours, theirs, x


def qwix_qarray(param):
    """qwix keeps a PTQ weight as Param(WithAux(QArray(Param(qvalue), Param(scale))))."""
    array = param.array
    return np.asarray(array.qvalue[...].astype(jnp.int32)), np.asarray(array.scale[...])


# (weight_qtype, tile_size, act_qtype, act_static_scale, calibration)
PTQ_CASES = {
    "int8 per-channel": (jnp.int8, None, None, False, "absmax"),
    "int4 per-channel": (jnp.int4, None, None, False, "absmax"),
    "int4 tiled 16": (jnp.int4, 16, None, False, "absmax"),
    "int8 minmax": (jnp.int8, None, None, False, "minmax"),
    "w8a8 dynamic": (jnp.int8, None, jnp.int8, False, "absmax"),
    "w8a8 static": (jnp.int8, None, jnp.int8, True, "absmax"),
}


@pytest.mark.parametrize("case", PTQ_CASES)
def test_ptq_values_scales_and_outputs_equal_qwix(models, case):
    ours, theirs, x = models
    weight_qtype, tile_size, act_qtype, static, method = PTQ_CASES[case]
    common = dict(module_path=".*", weight_qtype=weight_qtype, tile_size=tile_size, act_qtype=act_qtype,
                  weight_calibration_method=method)
    extra = dict(act_static_scale=True) if static else {}  # qwix rejects an explicit False without act_qtype
    mine = sq.quantize_model(ours, sq.PtqProvider([sq.QuantizationRule(**common, **extra)]), x)
    reference = qwix.quantize_model(theirs, qwix.PtqProvider([qwix.QuantizationRule(**common, **extra)]), x)
    for layer in ("hidden", "out"):
        got = getattr(mine, layer).kernel[...]
        qvalue, scale = qwix_qarray(getattr(reference, layer).kernel)
        assert got.qvalue.dtype == jnp.dtype(weight_qtype)
        np.testing.assert_array_equal(np.asarray(got.qvalue.astype(jnp.int32)), qvalue)
        np.testing.assert_array_equal(got.scale, scale)
        if method == "minmax":
            reference_zero_point = getattr(reference, layer).kernel.array.zero_point[...]
            np.testing.assert_array_equal(got.zero_point, reference_zero_point)
    if static:
        np.testing.assert_array_equal(mine.hidden.dot_general0_lhs_scale[...],
                                      reference.hidden.dot_general0_lhs_scale.array[...])
    x2 = jax.random.normal(jax.random.key(2), (8, 64))  # a new batch: static scales are reused
    np.testing.assert_array_equal(mine(x2), reference(x2))


def test_quantize_value_and_scale_equal_qwix_for_every_granularity():
    array = jax.random.normal(jax.random.key(3), (64, 48)) * 3
    for qtype in (jnp.int8, jnp.int4, jnp.float8_e4m3fn):
        for kwargs in ({}, {"channelwise_axes": (1,)}, {"channelwise_axes": (1,), "tiled_axes": {0: 16}},
                       {"tiled_axes": {0: 0.25, 1: 8}}):
            mine, reference = sq.quantize(array, qtype, **kwargs), qwix.quantize(array, qtype, **kwargs)
            as_float = [q.qvalue.astype(jnp.float32) for q in (mine, reference)]
            np.testing.assert_array_equal(*as_float)
            np.testing.assert_array_equal(mine.scale, reference.scale)
            np.testing.assert_array_equal(sq.dequantize(mine), qwix.dequantize(reference))
    mine = sq.quantize(array, jnp.int8, channelwise_axes=(1,), calibration_method="minmax")
    reference = qwix.quantize(array, jnp.int8, channelwise_axes=(1,), calibration_method="minmax")
    np.testing.assert_array_equal(mine.zero_point, reference.zero_point)
    np.testing.assert_array_equal(mine.qvalue, reference.qvalue)


def loss_and_grads(lib, model, x):
    graphdef, params, rest = lib.split(model, lib.Param, ...)

    def loss(params):
        return jnp.sum(lib.merge(graphdef, params, rest)(x) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return value, {path: g[...] for path, g in lib.to_flat_state(grads)}


@pytest.mark.parametrize("act_qtype", [None, jnp.int8])
def test_qat_forward_and_straight_through_gradients_equal_qwix(models, act_qtype):
    ours, theirs, x = models
    rule = dict(module_path=".*", weight_qtype=jnp.int4, act_qtype=act_qtype)
    mine = sq.quantize_model(ours, sq.QtProvider([sq.QuantizationRule(**rule)]), x)
    reference = qwix.quantize_model(theirs, qwix.QtProvider([qwix.QtRule(**rule)]), x)
    np.testing.assert_array_equal(mine(x), reference(x))
    my_loss, my_grads = loss_and_grads(nnx, mine, x)
    ref_loss, ref_grads = loss_and_grads(flax_nnx, reference, x)
    np.testing.assert_allclose(my_loss, ref_loss, rtol=1e-6)
    assert set(my_grads) == set(ref_grads)
    for path in my_grads:
        np.testing.assert_allclose(my_grads[path], ref_grads[path], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("weight_qtype", [None, jnp.int8, jnp.int4])
def test_lora_initial_output_is_the_base_output_in_both(models, weight_qtype):
    ours, theirs, x = models
    rule = dict(module_path=".*", rank=4, alpha=8.0, weight_qtype=weight_qtype)
    mine = sq.apply_lora_to_model(ours, sq.LoraProvider([sq.LoraRule(**rule)]), x, rngs=nnx.Rngs(0))
    reference = qwix.apply_lora_to_model(theirs, qwix.LoraProvider([qwix.LoraRule(**rule)]), x,
                                         rngs=flax_nnx.Rngs(0))
    assert mine.hidden.kernel_lora_a.shape == reference.hidden.kernel_lora_a.shape == (64, 4)
    assert mine.hidden.kernel_lora_b.shape == reference.hidden.kernel_lora_b.shape == (4, 32)
    np.testing.assert_array_equal(mine(x), reference(x))
    if weight_qtype is None:
        np.testing.assert_array_equal(mine(x), ours(x))
    else:
        ptq = sq.quantize_model(ours, sq.PtqProvider([sq.QuantizationRule(module_path=".*",
                                                                          weight_qtype=weight_qtype)]), x)
        np.testing.assert_array_equal(mine(x), ptq(x))


def make_matmul_mlp(lib):
    class MatmulMLP(lib.Module):
        """The same layers, but `hidden` computes with `@` instead of calling the layer."""

        def __init__(self, rngs):
            self.hidden = lib.Linear(64, 32, rngs=rngs)
            self.out = lib.Linear(32, 10, rngs=rngs)

        def __call__(self, x):
            return self.out(lib.relu(x @ self.hidden.kernel[...] + self.hidden.bias[...]))

    return MatmulMLP(lib.Rngs(0))


def test_matmul_operator_is_not_intercepted_in_qwix_nor_ours_and_ours_says_so():
    x = jax.random.normal(jax.random.key(1), (16, 64))
    rules = dict(module_path="hidden", weight_qtype=jnp.int8)
    reference_provider = qwix.PtqProvider([qwix.QuantizationRule(**rules)])
    reference = qwix.quantize_model(make_matmul_mlp(flax_nnx), reference_provider, x)
    # qwix: the kernel stays float, silently (only get_unused_rules tells).
    assert isinstance(reference.hidden.kernel[...], jax.Array)
    assert len(reference_provider.get_unused_rules()) == 1
    provider = sq.PtqProvider([sq.QuantizationRule(**rules)])
    with pytest.warns(UserWarning, match=r"matched no contraction.*module_path='hidden'"):
        mine = sq.quantize_model(make_matmul_mlp(nnx), provider, x)
    assert isinstance(mine.hidden.kernel[...], jax.Array)  # float, as in qwix
    assert provider.get_unused_rules() == [sq.QuantizationRule(**rules)]
    np.testing.assert_array_equal(mine(x), reference(x))
