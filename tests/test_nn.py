"""stacklib.nn's behaviour: Rngs, split/merge/update, layers, shape errors, dtypes, training."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stacklib.nn as nnx
import stacklib.optim as optax
from stacklib.grading import numerical_gradient


class MLP(nnx.Module):
    def __init__(self, din, dhidden, dout, *, rngs):
        self.hidden = nnx.Linear(din, dhidden, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(dhidden, dout, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(nnx.relu(self.hidden(x))))


def _keys(stream_calls):
    return [tuple(np.asarray(jax.random.key_data(k))) for k in stream_calls]


# -- Rngs ----------------------------------------------------------------------------------

def test_a_stream_is_reproducible_and_never_repeats_a_key():
    a, b = nnx.Rngs(params=0), nnx.Rngs(params=0)
    first = _keys([a.params() for _ in range(5)])
    assert first == _keys([b.params() for _ in range(5)])
    assert len(set(first)) == 5
    assert int(a.params.count[...]) == 5


def test_the_nth_key_is_fold_in_of_the_base_key_and_n():
    rngs = nnx.Rngs(7)
    rngs()
    expected = jax.random.fold_in(jax.random.key(7), 1)
    np.testing.assert_array_equal(jax.random.key_data(rngs()), jax.random.key_data(expected))


def test_unknown_streams_fall_back_to_default_or_fail_with_the_fix():
    assert "default" in nnx.Rngs(0) and nnx.Rngs(0).dropout.tag == "default"
    with pytest.raises(AttributeError, match=r"nnx.Rngs\(dropout=0\)"):
        nnx.Rngs(params=0).dropout()


# -- split / merge / state / update --------------------------------------------------------

def test_split_then_merge_rebuilds_an_equal_model():
    model = MLP(3, 8, 2, rngs=nnx.Rngs(0))
    model.eval()
    graphdef, state = nnx.split(model)
    rebuilt = nnx.merge(graphdef, state)
    assert type(rebuilt) is MLP and rebuilt is not model
    x = jnp.ones((4, 3))
    np.testing.assert_array_equal(rebuilt(x), model(x))


def test_split_by_filters_partitions_the_variables():
    model = MLP(3, 8, 2, rngs=nnx.Rngs(0))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    assert {type(v) for _, v in params.flat_state()} == {nnx.Param}
    assert [path for path, _ in rest.flat_state()] == [
        ("dropout", "rngs", "count"), ("dropout", "rngs", "key")
    ]
    assert sum(v.size for _, v in params.flat_state()) == 3 * 8 + 8 + 8 * 2 + 2


def test_split_with_filters_that_miss_a_variable_names_it():
    with pytest.raises(ValueError, match=r"dropout/rngs/count.*Add `...`"):
        nnx.split(MLP(3, 8, 2, rngs=nnx.Rngs(0)), nnx.Param)


def test_the_state_is_a_pytree_whose_paths_are_attribute_paths():
    state = nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    assert paths == ["['bias'].value", "['kernel'].value"]
    doubled = jax.tree.map(lambda x: 2 * x, state)
    assert isinstance(doubled["kernel"], nnx.Param)
    np.testing.assert_array_equal(doubled["kernel"][...], 2 * state["kernel"][...])


def test_update_writes_a_state_back_into_the_model():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    zeros = jax.tree.map(jnp.zeros_like, nnx.state(model))
    nnx.update(model, zeros)
    assert float(jnp.abs(model.kernel[...]).sum()) == 0.0


def test_merge_and_update_name_missing_or_unknown_paths():
    model = MLP(3, 8, 2, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    with pytest.raises(ValueError, match=r"no value for dropout/rngs/count.*merge\(graphdef, params, rest\)"):
        nnx.merge(graphdef, params)
    with pytest.raises(ValueError, match="Linear has nothing at hidden to add hidden/"):
        nnx.update(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), params)


def test_shared_submodules_stay_shared_after_a_round_trip():
    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(10, 4, rngs=rngs)
            self.also_embed = self.embed

    graphdef, state = nnx.split(Tied(nnx.Rngs(0)))
    assert [path for path, _ in state.flat_state()] == [("also_embed", "embedding")]
    rebuilt = nnx.merge(graphdef, state)
    assert rebuilt.embed is rebuilt.also_embed


def test_a_jitted_step_compiles_once_because_the_graphdef_is_static():
    model = MLP(3, 8, 2, rngs=nnx.Rngs(0))
    traces = []

    @jax.jit
    def forward(graphdef, state, x):
        traces.append(1)
        model = nnx.merge(graphdef, state)
        y = model(x)
        return y, nnx.state(model)  # the dropout counter advanced

    state = nnx.state(model)
    for _ in range(3):
        y, state = forward(nnx.graphdef(model), state, jnp.ones((2, 3)))
    assert len(traces) == 1
    assert int(state["dropout"]["rngs"]["count"][...]) == 3


def test_train_and_eval_switch_dropout():
    model = MLP(3, 8, 2, rngs=nnx.Rngs(0))
    x = jnp.ones((64, 3))
    model.eval()
    np.testing.assert_array_equal(model(x), model(x))
    model.train()
    assert not np.array_equal(model(x), model(x))


def test_bare_arrays_on_a_module_are_rejected_with_the_fix():
    class Bad(nnx.Module):
        def __init__(self):
            self.w = jnp.ones(3)

    with pytest.raises(TypeError, match=r"nnx.Param\(array\)"):
        Bad()


def test_clone_copies_the_variables():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    copy = nnx.clone(model)
    copy.kernel[...] = jnp.zeros((2, 3))
    assert float(jnp.abs(model.kernel[...]).sum()) > 0


def test_merge_without_a_state_is_a_type_error_that_shows_the_call():
    expected = r"missing 1 required positional argument: 'state'.*merge\(graphdef, state\)"
    with pytest.raises(TypeError, match=expected):
        nnx.merge(nnx.graphdef(nnx.Linear(2, 3, rngs=nnx.Rngs(0))))


def test_split_merge_update_and_clone_take_a_dict_of_modules():
    models = {"encoder": nnx.Linear(2, 3, rngs=nnx.Rngs(0)), "decoder": nnx.Linear(3, 2, rngs=nnx.Rngs(1))}
    graphdef, params = nnx.split(models)
    assert [path for path, _ in params.flat_state()][:2] == [("decoder", "bias"), ("decoder", "kernel")]
    rebuilt = nnx.merge(graphdef, params)
    assert type(rebuilt) is dict and rebuilt["encoder"].kernel is models["encoder"].kernel
    nnx.update(models, jax.tree.map(jnp.zeros_like, params))
    assert float(jnp.abs(models["decoder"].kernel[...]).sum()) == 0.0
    copy = nnx.clone(models)
    assert copy["encoder"].kernel is not models["encoder"].kernel


def test_a_variable_or_a_leaf_is_its_own_state():
    param = nnx.Param(jnp.ones(2))
    graphdef, state = nnx.split(param)
    assert state is param and nnx.merge(graphdef, state) is param
    _, params, rest = nnx.split(nnx.BatchStat(jnp.ones(2)), nnx.Param, ...)
    assert params == nnx.State({}) and isinstance(rest, nnx.BatchStat)
    assert nnx.split(3)[1] == 3 and nnx.clone(param) is not param
    nnx.update(param, nnx.Param(jnp.zeros(2)))
    assert param[...].tolist() == [0.0, 0.0]
    with pytest.raises(TypeError, match="cannot change a int in place"):
        nnx.update(3, 4)


def test_update_refuses_a_new_bare_array_on_a_module_and_a_path_without_a_parent():
    model = MLP(3, 8, 2, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="'raw' holds an array .* Wrap it"):
        nnx.update(model, nnx.State({"hidden": {"raw": jnp.ones(2)}}))
    with pytest.raises(ValueError, match="nothing at missing/deeper to add missing/deeper/w"):
        nnx.update(model, nnx.State({"missing": {"deeper": {"w": nnx.Param(jnp.ones(1))}}}))


def test_state_entries_can_be_added_by_attribute_and_deleted():
    state = nnx.state(MLP(3, 8, 2, rngs=nnx.Rngs(0)))
    state.hidden.scale = nnx.Param(jnp.ones(8))
    del state["hidden"]["bias"]
    assert sorted(state["hidden"]) == ["kernel", "scale"]
    assert ("hidden", "scale") in dict(state.flat_state())


# -- a module is a pytree; iter_graph --------------------------------------------------------

def test_a_module_is_a_pytree_of_its_variables_arrays():
    model = MLP(3, 8, 2, rngs=nnx.Rngs(0))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(model)[0]]
    assert paths == [
        ".dropout.rngs.count.value", ".dropout.rngs.key.value", ".hidden.bias.value",
        ".hidden.kernel.value", ".out.bias.value", ".out.kernel.value",
    ]
    doubled = jax.tree.map(lambda a: a * 2 if a.dtype == jnp.float32 else a, model)
    assert type(doubled) is MLP and doubled.dropout.rate == 0.1 and doubled.hidden is not model.hidden
    np.testing.assert_array_equal(doubled.out.kernel[...], 2 * model.out.kernel[...])


def test_jax_jit_takes_a_module_compiles_once_and_its_mutations_stay_inside():
    model = MLP(3, 8, 2, rngs=nnx.Rngs(0))
    traces = []

    @jax.jit
    def forward(model, x):
        traces.append(1)
        return model(x)

    x = jnp.ones((4, 3))
    first, second = forward(model, x), forward(model, x)
    assert len(traces) == 1
    # jit called a rebuilt copy: the dropout counter of `model` did not advance, so the mask repeats.
    assert int(model.dropout.rngs.count[...]) == 0
    np.testing.assert_array_equal(first, second)
    model.eval()  # a static attribute changed: a different tree structure, so jit traces again
    forward(model, x)
    assert len(traces) == 2


def test_a_static_item_in_a_list_of_modules_is_not_a_leaf():
    model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.relu)
    assert len(jax.tree.leaves(model)) == 2  # the kernel and the bias; relu is structure
    rebuilt = jax.tree.map(lambda a: a, model)
    assert rebuilt.layers[1] is nnx.relu
    x = jnp.ones((1, 2))
    np.testing.assert_array_equal(jax.jit(lambda m, x: m(x))(model, x), model(x))


def test_a_module_class_can_opt_out_of_being_a_pytree():
    class Opaque(nnx.Module, pytree=False):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))

    assert jax.tree.leaves(Opaque()) != [] and isinstance(jax.tree.leaves(Opaque())[0], Opaque)
    assert [path for path, _ in nnx.state(Opaque()).flat_state()] == [("w",)]  # still splits


def test_iter_graph_yields_attributes_and_variables_children_before_parents():
    class Tied(nnx.Module):
        def __init__(self):
            self.first = nnx.Linear(1, 2, use_bias=False, rngs=nnx.Rngs(0))
            self.second = self.first
            self.size = 2

    entries = [(path, type(value).__name__) for path, value in nnx.iter_graph(Tied())]
    assert entries[-1] == ((), "Tied")
    assert (("first", "kernel"), "Param") in entries and (("size",), "int") in entries
    assert entries.index((("first", "kernel"), "Param")) < entries.index((("first",), "Linear"))
    assert not any(path[:1] == ("second",) for path, _ in entries)  # shared: yielded once
    assert [path for path, _ in Tied().iter_modules()] == [("first",), ()]


def test_dropout_broadcasts_the_mask_along_negative_axes():
    y = nnx.Dropout(0.5, broadcast_dims=(-1,), rngs=nnx.Rngs(0))(jnp.ones((64, 8)))
    dropped = np.asarray(y == 0)
    assert (dropped.all(axis=-1) | ~dropped.any(axis=-1)).all()  # whole rows kept or dropped
    assert 0 < dropped[:, 0].sum() < 64


# -- layers ----------------------------------------------------------------------------------

def test_linear_is_x_at_kernel_plus_bias_with_kernel_in_by_out():
    layer = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    assert layer.kernel.shape == (3, 4) and layer.bias.shape == (4,)
    x = jax.random.normal(jax.random.key(1), (5, 3))
    np.testing.assert_allclose(layer(x), x @ layer.kernel[...] + layer.bias[...], rtol=1e-6)


@pytest.mark.parametrize(
    "layer, bad_input, expected",
    [
        (lambda r: nnx.Linear(3, 4, rngs=r), jnp.ones((2, 5)),
         r"expects inputs of shape \(\.\.\., 3\), got shape \(2, 5\)"),
        (lambda r: nnx.LayerNorm(8, rngs=r), jnp.ones((2, 4)),
         r"expects inputs of shape \(\.\.\., 8\), got shape \(2, 4\)"),
        (lambda r: nnx.RMSNorm(8, rngs=r), jnp.ones(3),
         r"expects inputs of shape \(\.\.\., 8\), got shape \(3,\)"),
        (lambda r: nnx.MultiHeadAttention(2, 8, rngs=r), jnp.ones((1, 3, 4)),
         r"\(\.\.\., length, 8\), got shape \(1, 3, 4\)"),
        (lambda r: nnx.Embed(10, 4, rngs=r), jnp.ones(3), "integer ids, got dtype float32"),
    ],
    ids=["linear", "layer_norm", "rms_norm", "attention", "embed"],
)
def test_a_wrong_input_shape_names_expected_and_got(layer, bad_input, expected):
    with pytest.raises(ValueError, match=expected):
        layer(nnx.Rngs(0))(bad_input)


def test_linear_gradient_matches_central_differences():
    with jax.enable_x64(True):
        layer = nnx.Linear(3, 2, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        x = jax.random.normal(jax.random.key(1), (4, 3), jnp.float64)
        graphdef, params = nnx.split(layer)

        def loss_of_kernel(kernel):
            state = nnx.State({"kernel": nnx.Param(kernel), "bias": params["bias"]})
            return jnp.sum(jnp.tanh(nnx.merge(graphdef, state, copy=True)(x)))

        kernel = np.asarray(params["kernel"][...])
        expected = numerical_gradient(loss_of_kernel, kernel)  # float64 central differences: ~1e-9
        np.testing.assert_allclose(jax.grad(loss_of_kernel)(jnp.asarray(kernel)), expected, rtol=1e-6)


@pytest.mark.parametrize("make", [
    lambda r: nnx.Linear(4, 4, param_dtype=jnp.bfloat16, rngs=r),
    lambda r: nnx.LayerNorm(4, param_dtype=jnp.bfloat16, rngs=r),
    lambda r: nnx.RMSNorm(4, param_dtype=jnp.bfloat16, rngs=r),
], ids=["linear", "layer_norm", "rms_norm"])
def test_bfloat16_in_bfloat16_out(make):
    assert make(nnx.Rngs(0))(jnp.ones((2, 4), jnp.bfloat16)).dtype == jnp.bfloat16


def test_layer_norm_output_has_zero_mean_and_unit_variance():
    y = nnx.LayerNorm(16, rngs=nnx.Rngs(0))(jax.random.normal(jax.random.key(0), (4, 16)) * 5 + 3)
    np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(y.var(-1), 1.0, rtol=1e-3)


def test_dropout_keeps_the_mean_and_drops_about_rate():
    dropout = nnx.Dropout(0.25, rngs=nnx.Rngs(0))
    y = dropout(jnp.ones(20_000))
    assert abs(float((y == 0).mean()) - 0.25) < 0.02
    np.testing.assert_allclose(y.mean(), 1.0, atol=0.03)
    assert dropout(jnp.ones(3), deterministic=True).tolist() == [1.0, 1.0, 1.0]


def test_causal_attention_does_not_look_ahead():
    attention = nnx.MultiHeadAttention(2, 8, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (1, 6, 8))
    changed_future = x.at[:, 4:].set(0.0)
    before, after = attention(x, is_causal=True), attention(changed_future, is_causal=True)
    np.testing.assert_allclose(before[:, :4], after[:, :4], rtol=1e-6)
    assert not np.allclose(before[:, 4:], after[:, 4:])


def test_summary_counts_every_parameter():
    text = nnx.summary(MLP(3, 8, 2, rngs=nnx.Rngs(0)))
    assert "hidden/kernel" in text and "total: Param 50 (" in text


# -- sharding metadata -----------------------------------------------------------------------

def _named_linear(din=3, dout=4, seed=0):
    return nnx.Linear(
        din, dout, rngs=nnx.Rngs(seed),
        kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("features", "hidden")),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("hidden",)),
    )


def test_with_partitioning_records_the_names_as_out_sharding_and_keeps_the_values():
    named, plain = _named_linear(), nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    assert named.kernel.out_sharding == ("features", "hidden")
    assert named.kernel.get_metadata() == {"out_sharding": ("features", "hidden"), "mesh": None}
    assert named.bias.get_metadata("out_sharding") == ("hidden",)
    assert plain.kernel.get_metadata("out_sharding", None) is None
    np.testing.assert_array_equal(named.kernel[...], plain.kernel[...])  # same keys, same weights


def test_sharding_names_survive_split_merge_jit_and_grad():
    graphdef, state = nnx.split(_named_linear())
    x = jnp.ones((2, 3))
    grads = jax.jit(jax.grad(lambda s: jnp.sum(nnx.merge(graphdef, s)(x))))(state)
    for tree in [state, grads, jax.tree.map(jnp.zeros_like, state)]:
        assert tree["kernel"].out_sharding == ("features", "hidden")
        assert tree["bias"].out_sharding == ("hidden",)
    assert nnx.merge(graphdef, grads).kernel.out_sharding == ("features", "hidden")


def test_linear_general_names_describe_the_reshaped_kernel():
    layer = nnx.LinearGeneral(
        8, (2, 3), rngs=nnx.Rngs(0),
        kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "heads", "head_dim")))
    assert layer.kernel.shape == (8, 2, 3)
    assert layer.kernel.out_sharding == ("embed", "heads", "head_dim")
    plain = nnx.LinearGeneral(8, (2, 3), rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(layer.kernel[...], plain.kernel[...])


def test_metadata_from_the_initializer_wins_over_keyword_arguments():
    wrapped = nnx.with_metadata(nnx.initializers.zeros, out_sharding=("a",))(jax.random.key(0), (2,))
    assert isinstance(wrapped, nnx.VariableMetadata)
    param = nnx.Param(wrapped, out_sharding=("b",), tag="w")
    assert param.get_metadata() == {"out_sharding": ("a",), "tag": "w"}
    with pytest.raises(KeyError, match="mesh"):
        param.get_metadata("mesh")


# -- training through the functional path ---------------------------------------------------

def test_a_small_mlp_learns_xor_with_the_functional_path():
    x = jnp.array([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    y = jnp.array([0, 1, 1, 0])
    model = MLP(2, 16, 2, rngs=nnx.Rngs(0))
    model.eval()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adam(0.05)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, rest, opt_state):
        def loss_fn(params):
            logits = nnx.merge(graphdef, params, rest, copy=True)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    for _ in range(200):
        params, opt_state, loss = step(params, rest, opt_state)
    assert float(loss) < 0.05
    nnx.update(model, params)
    assert model(x).argmax(-1).tolist() == [0, 1, 1, 0]
