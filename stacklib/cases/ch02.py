"""Chapter 02's exercises: a Linear layer, dropout with Rngs, a functional call, RMSNorm.

The answers are checked against flax.nnx and stacklib.nn on the same seeds, so "right"
means bit-identical weights and masks where the real library is deterministic.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx as flax_nnx

import stacklib.nn as nnx
from stacklib.grading import Exercise, expect, expect_close, expect_equal

# -- 02.linear --------------------------------------------------------------------------------

linear = Exercise("02.linear", "A Linear layer that is bit-identical to Flax's")


@linear.case(hint="kernel is a Param of shape (in_features, out_features); bias a Param of shape "
                  "(out_features,).")
def stores_kernel_in_by_out_and_bias_as_params(Linear):
    layer = Linear(3, 5, rngs=nnx.Rngs(0))
    shapes = {"/".join(map(str, path)): (type(v).__name__, tuple(v.shape))
              for path, v in nnx.to_flat_state(nnx.state(layer))}
    expect(shapes == {"bias": ("Param", (5,)), "kernel": ("Param", (3, 5))},
           f"expected state {{'bias': Param (5,), 'kernel': Param (3, 5)}}, got {shapes}")


@linear.case(points=2, hint="Initialise the kernel in float32 with jax.nn.initializers.lecun_normal() "
                            "and the key rngs.params(), drawn before the bias's; the bias starts at zero.")
def initial_weights_equal_flax_from_the_same_seed(Linear):
    # Rngs(0) has one stream that every name falls back to; Rngs(params=7) has only `params`,
    # as a model with its own dropout stream has: a layer that draws from rngs() fails there.
    for seeds, (din, dout) in [({"default": 0}, (3, 5)), ({"params": 7}, (16, 2))]:
        reference = flax_nnx.Linear(din, dout, rngs=flax_nnx.Rngs(**seeds))
        layer = Linear(din, dout, rngs=nnx.Rngs(**seeds))
        seed = next(iter(seeds.values()))
        expect_equal(layer.kernel[...], reference.kernel[...], what=f"kernel (seed {seed})")
        expect_equal(layer.bias[...], reference.bias[...], what=f"bias (seed {seed})")


@linear.case(hint="Flax draws a key for the bias too (rngs.params()), although zeros need no "
                  "randomness; draw it so that the next layer gets the same keys as in Flax.")
def draws_two_keys_like_flax(Linear):
    rngs = nnx.Rngs(0)
    Linear(3, 5, rngs=rngs)
    count = int(rngs.params.count[...])
    expect(count == 2, f"the params stream handed out {count} key(s); Flax's Linear draws 2")


@linear.case(points=2, hint="y = x @ kernel + bias over the last axis; read Variables with v[...].")
def computes_x_at_kernel_plus_bias_on_any_batch_shape(Linear):
    layer = Linear(4, 3, rngs=nnx.Rngs(1))
    expect(tuple(layer.kernel.shape) == (4, 3), f"kernel shape {tuple(layer.kernel.shape)}, expected (4, 3)")
    layer.bias[...] = jnp.arange(3.0)
    x = jax.random.normal(jax.random.key(2), (2, 5, 4))
    expected = np.asarray(x) @ np.asarray(layer.kernel[...]) + np.arange(3.0)
    expect_close(layer(x), expected, rtol=1e-5, atol=1e-5, what="layer(x) for x of shape (2, 5, 4)")


@linear.case(hint="Keep only Variables and static values on the module, so split/merge and jit work.")
def trains_through_split_merge_and_jit(Linear):
    layer = Linear(2, 1, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer)
    x, y = jnp.array([[1.0, 2.0], [3.0, -1.0]]), jnp.array([[1.0], [0.0]])

    @jax.jit
    def step(params):
        loss = lambda p: jnp.mean((nnx.merge(graphdef, p, copy=True)(x) - y) ** 2)  # noqa: E731
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.grad(loss)(params))

    for _ in range(200):
        params = step(params)
    expect_close(nnx.merge(graphdef, params)(x), y, atol=1e-3, what="the fitted outputs")


# -- 02.dropout -------------------------------------------------------------------------------

dropout = Exercise("02.dropout", "Dropout driven by an Rngs stream")


@dropout.case(hint="When deterministic is True, return x itself, before drawing any key.")
def deterministic_returns_the_input_and_draws_no_key(dropout_fn):
    x = jnp.arange(12.0).reshape(3, 4)
    rngs = nnx.Rngs(dropout=0)
    expect_equal(dropout_fn(x, 0.5, rngs, deterministic=True), x)
    count = int(rngs.dropout.count[...])
    expect(count == 0, f"a deterministic call drew {count} key(s) from the stream; nnx.Dropout draws "
                       "none, so the masks of later calls would differ from Flax's")


@dropout.case(points=2, hint="Keep each element with probability 1 - rate and divide the kept ones by "
                             "1 - rate, so that the mean is unchanged.")
def drops_about_rate_and_rescales_the_rest(dropout_fn):
    y = np.asarray(dropout_fn(jnp.ones(20_000), 0.3, nnx.Rngs(dropout=0)))
    dropped = float((y == 0).mean())
    expect(abs(dropped - 0.3) < 0.02, f"expected about 30% zeros, got {dropped:.1%}")
    kept = y[y != 0]
    expect(np.allclose(kept, 1 / 0.7, rtol=1e-6), f"kept values should all be 1 / (1 - rate) = "
           f"{1 / 0.7:.6f}; got values in [{kept.min():.6f}, {kept.max():.6f}]")


@dropout.case(hint="Draw one key with rngs.dropout() and build the mask with "
                   "jax.random.bernoulli(key, 1 - rate, x.shape), as nnx.Dropout does.")
def draws_the_same_mask_as_nnx_dropout(dropout_fn):
    x = jax.random.normal(jax.random.key(1), (8, 16))
    expected = nnx.Dropout(0.25)(x, rngs=nnx.Rngs(dropout=3))
    expect_close(dropout_fn(x, 0.25, nnx.Rngs(dropout=3)), expected, rtol=1e-6, atol=0)


@dropout.case(hint="At rate 0 nothing is dropped and at rate 1 everything is: return x, or zeros shaped "
                   "like x, without drawing a key, as nnx.Dropout does. At rate 1, x / (1 - rate) divides "
                   "by zero, and x * mask / 0 is NaN.")
def rates_0_and_1_return_x_or_zeros_and_draw_no_key(dropout_fn):
    x = jnp.arange(1.0, 7.0).reshape(2, 3)
    rngs = nnx.Rngs(dropout=0)
    expect_equal(dropout_fn(x, 0.0, rngs), x, what="dropout(x, rate=0.0)")
    dropped = dropout_fn(x, 1.0, rngs)
    nans = int(np.isnan(np.asarray(dropped)).sum())
    expect(nans == 0, f"dropout(x, rate=1.0) returned {nans} NaNs among its {np.size(dropped)} values")
    expect_equal(dropped, jnp.zeros_like(x), what="dropout(x, rate=1.0)")
    count = int(rngs.dropout.count[...])
    expect(count == 0, f"the calls with rate 0 and rate 1 drew {count} key(s) from the stream; nnx.Dropout "
                       "draws none, so the masks of later calls would differ from Flax's")


@dropout.case(hint="Each call must take a fresh key from the stream (rngs.dropout()), never a fixed one.")
def advances_the_stream_so_masks_differ(dropout_fn):
    rngs = nnx.Rngs(dropout=0)
    first, second = dropout_fn(jnp.ones(64), 0.5, rngs), dropout_fn(jnp.ones(64), 0.5, rngs)
    expect(not np.array_equal(first, second), "two calls with the same Rngs gave the same mask")
    expect(int(rngs.dropout.count[...]) == 2, f"expected 2 keys drawn, got {int(rngs.dropout.count[...])}")


# -- 02.functional_call -----------------------------------------------------------------------

functional_call = Exercise("02.functional_call", "A pure function from a split module")


class _Noisy(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.linear(x))


@functional_call.case(hint="merge(graphdef, state) rebuilds the model; call it on x.")
def returns_what_the_model_returns(call):
    model = _Noisy(nnx.Rngs(0))
    model.eval()
    graphdef, state = nnx.split(model)
    x = jnp.ones((2, 4))
    expected = model(x)  # before the learner's code runs
    got = call(graphdef, state, x)
    expect(isinstance(got, tuple | list) and len(got) == 2,
           f"expected a pair (y, new_state), got {type(got).__name__} {got!r:.60}")
    expect_close(got[0], expected, what="the output")


@functional_call.case(hint="Return the model's state after the call, whose dropout counter has "
                           "advanced, not the state you were given.")
def returns_the_new_state(call):
    graphdef, state = nnx.split(_Noisy(nnx.Rngs(0)))
    _, new_state = call(graphdef, state, jnp.ones((2, 4)))
    count = int(new_state["dropout"]["rngs"]["count"][...])
    expect(count == 1, f"the returned state's dropout counter is {count}, expected 1")


@functional_call.case(points=2, hint="merge puts the state's own Variables into the model, so calling the "
                                     "model changed the state you were given: see merge's copy argument "
                                     "(exercise text).")
def leaves_the_input_state_unchanged(call):
    graphdef, state = nnx.split(_Noisy(nnx.Rngs(0)))
    x = jnp.ones((2, 4))
    first, _ = call(graphdef, state, x)
    count = int(state["dropout"]["rngs"]["count"][...])
    expect(count == 0, f"the state passed in was changed: its dropout counter is now {count}")
    second, _ = call(graphdef, state, x)
    expect_close(second, first, what="a second call with the same state")


@functional_call.case(hint="Use only merge, the call and nnx.state, and return the state after the call: "
                           "then jax.jit compiles it once and the dropout counter advances from call to "
                           "call.")
def compiles_once_under_jit(call):
    traces = []

    def traced(graphdef, state, x):
        traces.append(1)
        return call(graphdef, state, x)

    jitted = jax.jit(traced)
    graphdef, state = nnx.split(_Noisy(nnx.Rngs(0)))
    for _ in range(3):
        _, state = jitted(graphdef, state, jnp.ones((2, 4)))
    expect(len(traces) == 1, f"jit traced {len(traces)} times, expected once")
    expect(int(state["dropout"]["rngs"]["count"][...]) == 3, "the counter did not advance through jit")


# -- 02.rms_norm ------------------------------------------------------------------------------

rms_norm = Exercise("02.rms_norm", "RMSNorm")


@rms_norm.case(points=2, hint="Each vector (the last axis) is divided by its root mean square, then "
                              "multiplied by scale; no mean is subtracted (the formula above the exercise). "
                              "Compute with jax.numpy, not NumPy: the layer runs under jax.jit.")
def matches_flax_rmsnorm(norm):
    x = jax.random.normal(jax.random.key(0), (3, 5, 8)) * 3 + 1
    reference = flax_nnx.RMSNorm(8, rngs=flax_nnx.Rngs(0))
    scale = jnp.linspace(0.5, 2.0, 8)
    reference.scale[...] = scale
    expected = reference(x)
    expect_close(norm(x, scale), expected, rtol=1e-5, atol=1e-6)
    # A norm layer runs inside a jitted model: NumPy (np.sqrt, np.mean) gives the right numbers
    # on concrete arrays, so only a traced call tells it from jax.numpy.
    expect_close(jax.jit(norm)(x, scale), expected, rtol=1e-5, atol=1e-6, what="jax.jit(rms_norm)(x, scale)")


@rms_norm.case(points=2, hint="epsilon goes inside the square root: sqrt(mean(x**2) + epsilon); its default "
                              "is 1e-6, as in Flax.")
def respects_epsilon_inside_the_root_and_its_default(norm):
    x = jnp.full((1, 4), 1e-3)  # mean(x**2) = 1e-6, the size of the default epsilon
    expect_close(norm(x, jnp.ones(4), epsilon=1e-2), np.full((1, 4), 1e-3 / np.sqrt(1e-6 + 1e-2)), rtol=1e-5,
                 what="rms_norm(x, scale, epsilon=1e-2)")
    expect_close(norm(x, jnp.ones(4)), np.full((1, 4), 1e-3 / np.sqrt(1e-6 + 1e-6)), rtol=1e-5,
                 what="rms_norm(x, scale) with the default epsilon")


# The scale is float32, as a parameter often is, while x is bfloat16: the result follows x's
# dtype, not the scale's, nor what their product promotes to.
@rms_norm.case(points=2, hint="The result has x's dtype, whatever scale's dtype is: cast the finished "
                              "product back to x.dtype, once, at the end.")
def returns_bfloat16_for_bfloat16_input_and_float32_scale(norm):
    x = (jax.random.normal(jax.random.key(1), (4, 64)) * 50).astype(jnp.bfloat16)
    scale = jnp.linspace(0.5, 2.0, 64, dtype=jnp.float32)
    x32 = np.asarray(x, np.float32)
    expected = x32 / np.sqrt((x32**2).mean(-1, keepdims=True) + 1e-6) * np.asarray(scale)
    y = norm(x, scale)
    expect(y.dtype == jnp.bfloat16, f"for bfloat16 x and a float32 scale, expected a bfloat16 result, "
                                    f"got {y.dtype}")
    expect_close(np.asarray(y, np.float32), expected, rtol=2e-2, atol=2e-2)


@rms_norm.case(hint="A row's scale is off by more than bfloat16's rounding: the mean of squares, the root "
                    "and the product must be computed in float32 (cast x first), and the result rounded to "
                    "x's dtype once, at the end.")
def computes_the_statistics_in_float32(norm):
    x = (jax.random.normal(jax.random.key(2), (8, 1024)) * 50).astype(jnp.bfloat16)
    x64 = np.asarray(x, np.float64)
    exact = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6)
    y = np.asarray(norm(x, jnp.ones(1024, jnp.bfloat16)), np.float64)
    # Rounding each output to bfloat16 once changes a row's overall gain by about 2e-4 (the
    # errors of 1024 elements average out); a normalising factor rounded to bfloat16, or
    # statistics summed in bfloat16, are off by up to 4e-3 for the whole row.
    gain = (y * exact).sum(-1) / (exact * exact).sum(-1)
    worst = int(np.abs(gain - 1).argmax())
    expect(abs(gain[worst] - 1) < 1e-3,
           f"row {worst} comes out scaled by {gain[worst]:.5f} instead of 1: its statistics were not "
           "computed in float32")
