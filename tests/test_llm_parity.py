"""stacklib.llm against the same model in plain flax.nnx + optax (stacklib/llm/twin.py).

Weights copied key by key (the parameter paths are the same), the same batches from our
pipeline, the same optimizer built from the real optax: 50 steps of both must give the
same losses. Tolerance: float32 rounding, since the two attention implementations
(ours: a grouped einsum; the twin's: jax.nn.dot_product_attention) and RoPE formulas
round differently; measured differences are ~1e-7 relative.
"""

import jax
import numpy as np
import optax

import stacklib.nn as nnx
from stacklib.llm import data, train, twin
from stacklib.llm.config import load_config

CONFIG = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=32,
              seq_len=32, batch_size=8, steps=50, warmup_steps=5, max_corpus_bytes=200_000)


def test_the_twin_has_our_parameter_paths_and_shapes():
    config = load_config(None, **CONFIG)
    ours = nnx.state(train.make_model(config), nnx.Param)
    _, theirs = twin.copy_params(ours, config)
    def shapes(state):
        return {jax.tree_util.keystr(k): np.shape(v) for k, v in jax.tree_util.tree_leaves_with_path(state)}

    assert shapes(ours) == shapes(theirs)


def test_fifty_steps_give_the_losses_of_flax_and_optax():
    config = load_config(None, **CONFIG)
    graphdef, params = nnx.split(train.make_model(config), nnx.Param)
    tx = train.make_optimizer(config)
    opt_state = tx.init(params)
    step = jax.jit(train.make_train_step(graphdef, tx))
    twin_graphdef, twin_params = twin.copy_params(params, config)
    twin_step, twin_tx = twin.make_train_step(twin_graphdef, config)
    twin_opt_state = twin_tx.init(twin_params)
    assert isinstance(twin_tx, optax.GradientTransformation)
    batches = iter(data.train_dataset(config))
    ours, theirs = [], []
    for _ in range(config.steps):
        batch = next(batches)
        params, opt_state, metrics = step(params, opt_state, batch)
        twin_params, twin_opt_state, loss = twin_step(twin_params, twin_opt_state, batch)
        ours.append(float(metrics["loss"]))
        theirs.append(float(loss))
    assert ours[-1] < ours[0] - 2  # it learned something
    np.testing.assert_allclose(ours, theirs, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(twin_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)
