"""stacklib.nn agrees with flax.nnx: same seeds give the same weights, outputs and gradients,
and `with_partitioning` attaches the same sharding metadata.

Each case builds the same layer or model against both APIs from the same `Rngs` seed.
Because our layers draw their keys in flax's order and use JAX's initializers, the
initial states are bit-identical, so no weights need copying. The outputs then agree to
1e-6 (float32; measured 0.0 for most cases: the same XLA ops in the same order), and so
do the gradients with respect to every Param. The state trees correspond one to one:
the same paths, shapes, dtypes and Variable types.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx
from jax.sharding import PartitionSpec as P

import stacklib.nn as our_nnx

X = jax.random.normal(jax.random.key(42), (2, 5, 8))
IDS = (jnp.arange(10).reshape(2, 5) * 3) % 11


def _mlp(nnx, rngs):
    class MLP(nnx.Module):
        def __init__(self, *, rngs):
            self.hidden = nnx.Linear(8, 16, rngs=rngs)
            self.norm = nnx.LayerNorm(16, rngs=rngs)
            self.dropout = nnx.Dropout(0.25, rngs=rngs)
            self.out = nnx.Linear(16, 3, rngs=rngs)

        def __call__(self, x):
            return self.out(self.dropout(nnx.gelu(self.norm(self.hidden(x)))))

    return MLP(rngs=rngs)


def _decoder_block(nnx, rngs):
    class Block(nnx.Module):
        def __init__(self, *, rngs):
            self.embed = nnx.Embed(11, 8, rngs=rngs)
            self.norm = nnx.RMSNorm(8, rngs=rngs)
            self.attention = nnx.MultiHeadAttention(2, 8, decode=False, rngs=rngs)
            self.head = nnx.Linear(8, 11, use_bias=False, rngs=rngs)

        def __call__(self, ids):
            h = self.embed(ids)
            h = h + self.attention(self.norm(h), is_causal=True)
            return self.head(h)

    return Block(rngs=rngs)


# (name, build(nnx, rngs) -> module, call(module) -> output). Calls run in training mode,
# so the dropout cases compare random masks too.
CASES = [
    ("linear", lambda nnx, r: nnx.Linear(8, 4, rngs=r), lambda m: m(X)),
    ("linear_no_bias", lambda nnx, r: nnx.Linear(8, 4, use_bias=False, rngs=r), lambda m: m(X)),
    ("linear_general", lambda nnx, r: nnx.LinearGeneral(8, (2, 3), rngs=r), lambda m: m(X)),
    ("embed", lambda nnx, r: nnx.Embed(11, 4, rngs=r), lambda m: m(IDS)),
    ("embed_attend", lambda nnx, r: nnx.Embed(11, 8, rngs=r), lambda m: m.attend(X)),
    ("layer_norm", lambda nnx, r: nnx.LayerNorm(8, rngs=r), lambda m: m(X * 3 + 1)),
    ("layer_norm_no_scale", lambda nnx, r: nnx.LayerNorm(8, use_scale=False, epsilon=1e-3, rngs=r),
     lambda m: m(X)),
    ("rms_norm", lambda nnx, r: nnx.RMSNorm(8, rngs=r), lambda m: m(X * 3 + 1)),
    ("dropout", lambda nnx, r: nnx.Dropout(0.5, rngs=r), lambda m: (m(X), m(X))),
    ("dropout_broadcast", lambda nnx, r: nnx.Dropout(0.3, broadcast_dims=(1,), rngs=r), lambda m: m(X)),
    ("dropout_broadcast_last", lambda nnx, r: nnx.Dropout(0.3, broadcast_dims=(-1,), rngs=r), lambda m: m(X)),
    ("dropout_broadcast_negative_pair", lambda nnx, r: nnx.Dropout(0.3, broadcast_dims=(-2, 0), rngs=r),
     lambda m: m(X)),
    ("attention_causal", lambda nnx, r: nnx.MultiHeadAttention(2, 8, decode=False, rngs=r),
     lambda m: m(X, is_causal=True)),
    ("attention_mask", lambda nnx, r: nnx.MultiHeadAttention(4, 8, 16, 6, decode=False, rngs=r),
     lambda m: m(X, mask=jnp.tril(jnp.ones((5, 5), bool)))),
    ("attention_grouped_query",
     lambda nnx, r: nnx.MultiHeadAttention(4, 8, num_kv_heads=2, decode=False, rngs=r),
     lambda m: m(X, is_causal=True)),
    ("attention_dropout", lambda nnx, r: nnx.MultiHeadAttention(
        2, 8, dropout_rate=0.5, deterministic=False, decode=False, rngs=r), lambda m: m(X)),
    ("sequential",
     lambda nnx, r: nnx.Sequential(nnx.Linear(8, 6, rngs=r), nnx.relu, nnx.Linear(6, 2, rngs=r)),
     lambda m: m(X)),
    ("mlp", _mlp, lambda m: m(X)),
    ("decoder_block", _decoder_block, lambda m: m(IDS)),
]
IDS_ = [case[0] for case in CASES]


def _flat(nnx, state):
    """{path: (variable type name, array)} with typed keys turned into their raw data."""
    flat = {}
    for path, variable in nnx.to_flat_state(state):
        value = variable.get_value()
        if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
            value = jax.random.key_data(value)
        flat[tuple(path)] = (type(variable).__name__, np.asarray(value))
    return flat


def _pair(build):
    return build(our_nnx, our_nnx.Rngs(0, dropout=1)), build(flax_nnx, flax_nnx.Rngs(0, dropout=1))


@pytest.mark.parametrize("name, build, call", CASES, ids=IDS_)
def test_the_same_seed_gives_the_same_state_tree_bit_for_bit(name, build, call):
    ours, theirs = _pair(build)
    ours_state, their_state = _flat(our_nnx, our_nnx.state(ours)), _flat(flax_nnx, flax_nnx.state(theirs))
    assert list(ours_state) == list(their_state)  # same paths, in the same order
    for path, (kind, value) in their_state.items():
        assert ours_state[path][0] == kind, path
        assert ours_state[path][1].dtype == value.dtype, path
        np.testing.assert_array_equal(ours_state[path][1], value, err_msg=str(path))


@pytest.mark.parametrize("name, build, call", CASES, ids=IDS_)
def test_outputs_agree_to_1e_6(name, build, call):
    ours, theirs = _pair(build)
    for mine, reference in zip(jax.tree.leaves(call(ours)), jax.tree.leaves(call(theirs)), strict=True):
        assert mine.shape == reference.shape and mine.dtype == reference.dtype
        # float32 activations of size ~1: 1e-6 absolute is a few ulps.
        np.testing.assert_allclose(mine, reference, rtol=1e-6, atol=1e-6)
    # Mutations during the call (dropout counters) left the states equal too.
    assert _flat(our_nnx, our_nnx.state(ours)).keys() == _flat(flax_nnx, flax_nnx.state(theirs)).keys()
    for path, (_, value) in _flat(flax_nnx, flax_nnx.state(theirs)).items():
        np.testing.assert_array_equal(_flat(our_nnx, our_nnx.state(ours))[path][1], value)


def _param_gradients(nnx, module, call):
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def loss(params):
        # copy=True: `rest` (dropout counters) comes from outside this trace; see merge's docstring.
        output = call(nnx.merge(graphdef, params, rest, copy=True))
        return sum(jnp.sum(jnp.sin(leaf)) for leaf in jax.tree.leaves(output))

    grads = jax.jit(jax.grad(loss))(params)  # jitted: eager flax ops take seconds here
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(grads)}


@pytest.mark.parametrize("name, build, call", [c for c in CASES if not c[0].startswith("dropout")],
                         ids=[i for i in IDS_ if not i.startswith("dropout")])
def test_param_gradients_agree_to_1e_6(name, build, call):
    ours, theirs = _pair(build)
    mine, reference = _param_gradients(our_nnx, ours, call), _param_gradients(flax_nnx, theirs, call)
    assert mine.keys() == reference.keys()
    for path in reference:
        # Sums of up to ~100 float32 products: 1e-5 relative is float32 rounding.
        np.testing.assert_allclose(mine[path], reference[path], rtol=1e-5, atol=1e-6, err_msg=str(path))


def test_a_flax_state_loads_into_our_model_through_pure_dicts():
    ours = _mlp(our_nnx, our_nnx.Rngs(5))
    theirs = _mlp(flax_nnx, flax_nnx.Rngs(0, dropout=1))
    params = flax_nnx.to_pure_dict(flax_nnx.state(theirs, flax_nnx.Param))
    our_params = our_nnx.state(ours, our_nnx.Param)
    our_nnx.replace_by_pure_dict(our_params, params)
    ours.eval()
    theirs.eval()
    np.testing.assert_allclose(ours(X), theirs(X), rtol=1e-6, atol=1e-6)


def test_rng_streams_hand_out_the_same_keys():
    ours, theirs = our_nnx.Rngs(3, dropout=7), flax_nnx.Rngs(3, dropout=7)
    for stream in ["params", "dropout", "default", "params", "noise"]:
        np.testing.assert_array_equal(
            jax.random.key_data(ours[stream]()), jax.random.key_data(theirs[stream]())
        )
    np.testing.assert_array_equal(
        jax.random.key_data(ours.fork().dropout()), jax.random.key_data(theirs.fork().dropout())
    )


# -- sharding metadata: `with_partitioning` attaches the same names in both libraries. Flax
# would also shard each array as it is made (eager sharding, which needs a mesh); we build
# its models with that off, so both hold whole arrays and differ only in what we compare.

def _named(nnx, initializer, *names):
    """`initializer` (a factory in nnx.initializers, by name) with logical names attached."""
    return nnx.with_partitioning(getattr(nnx.initializers, initializer)(), names)


def _named_mlp(nnx, rngs):
    # The shape of chapter 07's classifier (stacklib.parallel.mlp), written once for both.
    class NamedMLP(nnx.Module):
        def __init__(self, *, rngs):
            self.fc1 = nnx.Linear(8, 16, rngs=rngs,
                                  kernel_init=_named(nnx, "lecun_normal", "features", "hidden"),
                                  bias_init=_named(nnx, "zeros_init", "hidden"))
            self.fc2 = nnx.Linear(16, 3, rngs=rngs,
                                  kernel_init=_named(nnx, "lecun_normal", "hidden", "classes"),
                                  bias_init=_named(nnx, "zeros_init", "classes"))

        def __call__(self, x):
            return self.fc2(nnx.relu(self.fc1(x)))

    return NamedMLP(rngs=rngs)


NAMED_CASES = [
    ("mlp", _named_mlp, lambda m: m(X)),
    ("linear_general", lambda nnx, r: nnx.LinearGeneral(
        8, (2, 3), kernel_init=_named(nnx, "lecun_normal", "embed", "heads", "kv"),
        bias_init=_named(nnx, "zeros_init", "heads", "kv"), rngs=r), lambda m: m(X)),
    ("embed", lambda nnx, r: nnx.Embed(11, 4, embedding_init=_named(nnx, "normal", "vocab", "embed"), rngs=r),
     lambda m: m(IDS)),
    ("layer_norm", lambda nnx, r: nnx.LayerNorm(8, scale_init=_named(nnx, "ones_init", "embed"),
                                                bias_init=_named(nnx, "zeros_init", "embed"), rngs=r),
     lambda m: m(X)),
    ("attention", lambda nnx, r: nnx.MultiHeadAttention(
        2, 8, decode=False, kernel_init=_named(nnx, "lecun_normal", "embed", "heads", "kv"),
        out_kernel_init=_named(nnx, "lecun_normal", "heads", "kv", "embed"), rngs=r), lambda m: m(X)),
]
NAMED_IDS = [case[0] for case in NAMED_CASES]


def _named_pair(build):
    with flax_nnx.use_eager_sharding(False):
        theirs = build(flax_nnx, flax_nnx.Rngs(0))
    return build(our_nnx, our_nnx.Rngs(0)), theirs


@pytest.mark.parametrize("name, build, call", NAMED_CASES, ids=NAMED_IDS)
def test_with_partitioning_gives_the_same_metadata_and_weights(name, build, call):
    ours, theirs = _named_pair(build)
    our_vars = dict(our_nnx.to_flat_state(our_nnx.state(ours)))
    their_vars = {tuple(p): v for p, v in flax_nnx.to_flat_state(flax_nnx.state(theirs))}
    assert list(our_vars) == list(their_vars)
    for path, theirs_var in their_vars.items():
        # flax adds required entries (hijax, ref, eager_sharding) to every Variable; we have none.
        assert our_vars[path].get_metadata() == theirs_var.get_metadata(exclude_required=True), path
        np.testing.assert_array_equal(our_vars[path].get_value(), theirs_var.get_value(), err_msg=str(path))
    assert any(v.get_metadata("out_sharding", None) for v in our_vars.values())
    np.testing.assert_allclose(call(ours), call(theirs), rtol=1e-6, atol=1e-6)  # as in the cases above


@pytest.mark.parametrize("name, build, call", NAMED_CASES, ids=NAMED_IDS)
def test_our_names_are_what_flax_get_partition_spec_reads(name, build, call):
    ours, theirs = _named_pair(build)
    specs = jax.tree.leaves(flax_nnx.get_partition_spec(flax_nnx.state(theirs)))
    names = [P(*v.get_metadata("out_sharding", ())) for _, v in our_nnx.to_flat_state(our_nnx.state(ours))]
    assert names == specs


# -- the graph API beyond single modules: iter_graph, modules as pytrees, containers, State ----

def _graph_model(nnx, rngs):
    """A model with every kind of attribute: Variables, submodules, a shared submodule and a
    shared Variable, a list of a module and an int, a static dict, a tuple, None twice."""
    class Leaf(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))
            self.size = 2
            self.name = "leaf"

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.a = Leaf()
            self.shared = self.a
            self.blocks = nnx.data([Leaf(), 3])  # nnx.data: flax 0.12 asks for it on a list of modules
            self.table = {"y": 1, "x": (2, 3)}
            self.dropout = nnx.Dropout(0.5, broadcast_dims=(-1,), rngs=rngs)
            self.scale = nnx.BatchStat(jnp.zeros(()))
            self.tied = self.scale
            self.nothing = None
            self.also_nothing = None
            self.flag = True

    return Model(rngs)


def _iter_graph_entries(nnx, node, only_state=False):
    """(path, type name, repr of a plain value) for each item of nnx.iter_graph, in order.
    Flax also yields its bookkeeping attributes (`_pytree__state`, `_pytree__nodes`): dropped."""
    entries = []
    for path, value in nnx.iter_graph(node):
        if any(isinstance(part, str) and part.startswith("_pytree__") for part in path):
            continue
        # flax's nnx.List is a Module; ours is a plain list (see stacklib/nn/module.py).
        is_state = isinstance(value, nnx.Variable | nnx.Module) and type(value).__name__ != "List"
        if only_state and not is_state:
            continue
        plain = isinstance(value, int | float | str | bool | type(None))
        entries.append((path, type(value).__name__, repr(value) if plain else None))
    return entries


def test_iter_graph_yields_what_flax_yields_in_the_same_order():
    ours = _iter_graph_entries(our_nnx, _graph_model(our_nnx, our_nnx.Rngs(0)))
    theirs = _iter_graph_entries(flax_nnx, _graph_model(flax_nnx, flax_nnx.Rngs(0)))
    assert ours == theirs
    assert ours[-1] == ((), "Model", None)  # the root last
    assert (("scale",), "BatchStat", None) in ours and ("tied",) not in [e[0] for e in ours]


@pytest.mark.parametrize("name, build, call", CASES, ids=IDS_)
def test_iter_graph_yields_the_same_modules_and_variables(name, build, call):
    # Library layers keep different static attributes (flax's Linear has `dot_general`, ...),
    # so here only the modules and Variables are compared.
    ours, theirs = _pair(build)
    assert _iter_graph_entries(our_nnx, ours, True) == _iter_graph_entries(flax_nnx, theirs, True)


def _leaves_with_paths(module):
    leaves = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(module)[0]:
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        leaves.append((jax.tree_util.keystr(path), np.asarray(leaf)))
    return leaves


@pytest.mark.parametrize("name, build, call", CASES, ids=IDS_)
def test_a_module_is_a_pytree_with_flaxs_paths_and_leaves(name, build, call):
    ours, theirs = _pair(build)
    mine, reference = _leaves_with_paths(ours), _leaves_with_paths(theirs)
    assert [path for path, _ in mine] == [path for path, _ in reference]  # e.g. '.hidden.kernel.value'
    for (path, a), (_, b) in zip(mine, reference, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=path)


@pytest.mark.parametrize("name, build, call", CASES, ids=IDS_)
def test_jax_jit_takes_a_module_as_an_argument_and_its_mutations_stay_inside(name, build, call):
    ours, theirs = _pair(build)
    mine, reference = jax.jit(call)(ours), jax.jit(call)(theirs)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)  # as in test_outputs_agree_to_1e_6
    # jit rebuilt the module from its leaves: in both, the originals' dropout counters did not move.
    for used, fresh in zip([ours, theirs], _pair(build), strict=True):
        for (path, a), (_, b) in zip(_leaves_with_paths(used), _leaves_with_paths(fresh), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=path)


# What split/state/merge/update/clone accept besides a module, built the same way for both.
def _linear_pair(nnx):
    rngs = nnx.Rngs(0)
    return nnx.Linear(2, 3, rngs=rngs), nnx.Linear(3, 1, rngs=rngs)


GRAPHS = [
    ("module", lambda nnx: _linear_pair(nnx)[0]),
    ("dict_of_modules", lambda nnx: dict(zip("ab", _linear_pair(nnx), strict=True))),
    ("list_of_modules", lambda nnx: list(_linear_pair(nnx))),
    ("tuple_with_an_int", lambda nnx: (_linear_pair(nnx)[0], 3)),
    ("nested", lambda nnx: {"encoder": [_linear_pair(nnx)[0]], "size": 4}),
    ("shared_in_a_list", lambda nnx: [_linear_pair(nnx)[0]] * 2),
    ("dict_with_an_array", lambda nnx: {"w": jnp.arange(3.0), "p": nnx.Param(jnp.ones(2)), "n": 7}),
    ("dict_of_variables", lambda nnx: {"p": nnx.Param(jnp.ones(2)), "b": nnx.BatchStat(jnp.zeros(1))}),
    ("nnx_dict", lambda nnx: nnx.Dict(a=_linear_pair(nnx)[0], p=nnx.Param(jnp.ones(2)), n=3)),
    ("shared_nnx_dict", lambda nnx: [nnx.Dict(p=nnx.Param(jnp.ones(2)), n=3)] * 2),
    ("variable", lambda nnx: nnx.Param(jnp.arange(2.0))),
    ("int", lambda nnx: 3),
    ("array", lambda nnx: jnp.arange(4.0)),
]
GRAPH_IDS = [case[0] for case in GRAPHS]
SINGLE = ("variable", "int", "array")  # a whole graph that is one Variable or leaf


def _structure(nnx, value):
    """A comparable description: container types and keys, module and Variable types, values."""
    if isinstance(value, nnx.State):
        return ("State", [(path, _structure(nnx, leaf)) for path, leaf in nnx.to_flat_state(value)])
    if isinstance(value, nnx.Module):
        return (type(value).__name__, _structure(nnx, nnx.state(value)))
    if isinstance(value, nnx.Variable):
        return (type(value).__name__, np.asarray(value.get_value()).tolist())
    if isinstance(value, dict):
        return ("dict", [(key, _structure(nnx, value[key])) for key in sorted(value)])
    if isinstance(value, list | tuple):
        return (type(value).__name__, [_structure(nnx, item) for item in value])
    return ("leaf", np.asarray(value).tolist())


@pytest.mark.parametrize("name, build", GRAPHS, ids=GRAPH_IDS)
def test_split_and_merge_take_containers_variables_and_leaves_as_flax_does(name, build):
    ours, theirs = build(our_nnx), build(flax_nnx)
    for filters in [(), (our_nnx.Param, ...)]:
        flax_filters = tuple(flax_nnx.Param if f is our_nnx.Param else f for f in filters)
        mine, reference = our_nnx.split(ours, *filters)[1:], flax_nnx.split(theirs, *flax_filters)[1:]
        assert [_structure(our_nnx, s) for s in mine] == [_structure(flax_nnx, s) for s in reference]
    rebuilt, flax_rebuilt = our_nnx.merge(*our_nnx.split(ours)), flax_nnx.merge(*flax_nnx.split(theirs))
    assert _structure(our_nnx, rebuilt) == _structure(flax_nnx, flax_rebuilt)
    if name in ("shared_in_a_list", "shared_nnx_dict"):
        assert rebuilt[0] is rebuilt[1] and flax_rebuilt[0] is flax_rebuilt[1]


@pytest.mark.parametrize("name, build", GRAPHS, ids=GRAPH_IDS)
def test_state_and_clone_take_containers_as_flax_does(name, build):
    ours, theirs = build(our_nnx), build(flax_nnx)
    if name not in SINGLE:  # flax 0.12.8's state() raises IndexError on a Variable or a leaf
        assert _structure(our_nnx, our_nnx.state(ours)) == _structure(flax_nnx, flax_nnx.state(theirs))
    copy, flax_copy = our_nnx.clone(ours), flax_nnx.clone(theirs)
    assert _structure(our_nnx, copy) == _structure(flax_nnx, flax_copy)
    originals = {id(v) for _, v in our_nnx.iter_graph(ours) if isinstance(v, our_nnx.Variable)}
    assert not any(id(v) in originals for _, v in our_nnx.iter_graph(copy))  # new Variables


@pytest.mark.parametrize("name, build", [g for g in GRAPHS if g[0] not in SINGLE],
                         ids=[i for i in GRAPH_IDS if i not in SINGLE])
def test_update_writes_into_containers_as_flax_does(name, build):
    ours, theirs = build(our_nnx), build(flax_nnx)
    our_nnx.update(ours, jax.tree.map(lambda a: a + 1, our_nnx.state(ours)))
    flax_nnx.update(theirs, jax.tree.map(lambda a: a + 1, flax_nnx.state(theirs)))
    assert _structure(our_nnx, ours) == _structure(flax_nnx, theirs)


@pytest.mark.parametrize("name, build", GRAPHS, ids=GRAPH_IDS)
def test_merge_without_a_state_raises_type_error_as_in_flax(name, build):
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'state'"):
        flax_nnx.merge(flax_nnx.graphdef(build(flax_nnx)))
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'state'"):
        our_nnx.merge(our_nnx.graphdef(build(our_nnx)))


def test_a_state_takes_new_nested_entries_and_deletions_as_in_flax():
    states = []
    for nnx in (our_nnx, flax_nnx):
        state = nnx.State({"a": nnx.Param(1), "b": {"c": nnx.Param(2)}})
        state.b.d = nnx.Param(5)
        state.e = {"f": nnx.Param(3)}
        state["g"] = nnx.Param(4)
        del state["b"]["c"]
        del state["g"]
        assert isinstance(state["e"], nnx.State)
        states.append([(path, type(v).__name__, v.get_value()) for path, v in nnx.to_flat_state(state)])
    assert states[0] == states[1] == [
        (("a",), "Param", 1), (("b", "d"), "Param", 5), (("e", "f"), "Param", 3)
    ]


def test_an_nnx_dict_is_a_mapping_whose_entries_are_attributes_as_in_flax():
    for nnx in (our_nnx, flax_nnx):
        d = nnx.Dict({"a": 1}, b=2)
        d["c"] = 3
        d.e = 4
        del d["a"]
        seen = (list(d), len(d), d.b, d["e"], d.setdefault("c", 9), "a" in d)
        assert seen == (["b", "c", "e"], 3, 2, 4, 3, False)
        with pytest.raises(KeyError):
            d["a"]


class _WithDicts:
    """A model holding an nnx.Dict of layers and a plain dict (marked data for flax 0.12)."""

    @staticmethod
    def build(nnx):
        class Model(nnx.Module):
            def __init__(self, rngs):
                self.layers = nnx.Dict(encoder=nnx.Linear(2, 3, rngs=rngs), scale=nnx.Param(jnp.ones(3)))
                self.plain = nnx.data({"b": nnx.Param(jnp.zeros(2))})

            def __call__(self, x):
                return self.layers.encoder(x) * self.layers.scale[...]

        return Model(nnx.Rngs(0))


def test_an_nnx_dict_keeps_its_attribute_access_through_clone_merge_and_jit_as_in_flax():
    x = jnp.ones((1, 2))
    for nnx in (our_nnx, flax_nnx):
        model = _WithDicts.build(nnx)
        expected = model(x)
        for copy in (nnx.clone(model), nnx.merge(*nnx.split(model))):
            assert type(copy.layers) is nnx.Dict and copy.layers.encoder.kernel is not None
            np.testing.assert_array_equal(copy(x), expected)
        np.testing.assert_array_equal(jax.jit(lambda m, x: m(x))(model, x), expected)


def test_update_adds_entries_the_model_does_not_have_yet_as_flax_does():
    """flax's update sets a new attribute on a module or nnx.Dict, a new key in a dict."""
    structures = []
    for nnx in (our_nnx, flax_nnx):
        model = _WithDicts.build(nnx)
        new = nnx.State({"layers": {"extra": nnx.Param(jnp.full(1, 5.0))},
                         "plain": {"c": nnx.BatchStat(jnp.ones(1))},
                         "top": nnx.Param(jnp.zeros(1))})
        nnx.update(model, new)
        assert model.layers.extra is not new["layers"]["extra"]  # a copy, not the state's Variable
        structures.append(_structure(nnx, model))
    assert structures[0] == structures[1]


def test_a_variable_subclass_that_overrides_get_and_set_value_is_honoured_as_in_flax():
    seen = []
    for nnx in (our_nnx, flax_nnx):
        class Offset(nnx.Param):  # reads add 3, writes add 7
            def get_value(self, **kwargs):
                return super().get_value(**kwargs) + 3

            def set_value(self, value, **kwargs):
                super().set_value(value + 7, **kwargs)

        class Holder(nnx.Module):
            def __init__(self):
                self.x = Offset(jnp.array(1))

        holder = Holder()
        read = int(holder.x[...])
        holder.x[...] = 5
        raw = int(holder.x.get_raw_value())
        leaves = [int(leaf) for leaf in jax.tree.leaves(nnx.state(holder))]  # the pytree holds raw values
        seen.append((read, raw, int(holder.x.get_value()), leaves))
    assert seen[0] == seen[1] == (4, 12, 15, [12])
