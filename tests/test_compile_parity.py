"""stacklib.compile against XLA's own numbers: cost_analysis before and after optimization,
and jax.jit's compilation cache and cache-miss explanations."""

import logging

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax import lax

from stacklib.compile import DEFAULT_CPU_PIPELINE, cost_analysis, op_costs, track_compiles

X = jnp.linspace(0.1, 1.0, 1000).reshape(10, 100)
Y = jnp.linspace(0.2, 2.0, 1000).reshape(10, 100)

# ------------------------------------------------ jaxpr rules vs XLA on the unoptimized program
# Lowered (pre-optimization) HLO maps one-to-one onto the jaxpr's primitives, so the FLOP
# and transcendental counts must agree exactly: these are the same rules, counted twice.
EXACT_CASES = {
    "add": (lambda a, b: a + b, X, Y),
    "div": (lambda a, b: a / b, X, Y),
    "exp, tanh, log": (lambda a: jnp.exp(a) + jnp.tanh(a) * jnp.log(a), X),
    "logistic": (jax.nn.sigmoid, X),
    "gelu (tanh)": (jax.nn.gelu, X),
    "integer_pow": (lambda a: a**3 + a**-2, X),
    "where": (lambda a, b: jnp.where(a > 0.5, a, b), X, Y),
    "convert": (lambda a: a.astype(jnp.bfloat16), X),
    "reductions": (lambda a: a.sum(1) + a.max(1) - a.mean(1), X),
    "argmax": (lambda a: a.argmax(1), X),
    "softmax": (lambda a: jax.nn.softmax(a, -1), X),
    "logsumexp": (lambda a: jax.nn.logsumexp(a, -1), X),
    "layer norm": (lambda a: (a - a.mean(-1, keepdims=True)) * lax.rsqrt(a.var(-1, keepdims=True) + 1e-5), X),
    "matmul": (lambda a, b: a @ b.T, X, Y),
    "batched einsum": (lambda a, b: jnp.einsum("bik,bkj->bij", a, b), X.reshape(10, 10, 10),
                       Y.reshape(10, 10, 10)),
    "sort": (lambda a: jnp.sort(a, 1), X),
    "scatter-add": (lambda a, i: a.at[i].add(1.0), X, jnp.array([1, 3, 5])),
    "gather": (lambda a, i: a[i], X, jnp.array([1, 3, 5])),
    "cond": (lambda a, p: lax.cond(p, lambda v: v @ v.T, lambda v: v[:, :10] + 1, a), X, True),
}


@pytest.mark.parametrize("name", list(EXACT_CASES))
def test_flops_and_transcendentals_equal_xla_on_the_unoptimized_program(name):
    fn, *args = EXACT_CASES[name]
    xla = jax.jit(fn).lower(*args).cost_analysis()
    ours = cost_analysis(fn, *args)
    assert ours.flops == xla.get("flops", 0.0)
    assert ours.transcendentals == xla.get("transcendentals", 0.0)


# ------------------------------------------------ the documented differences, each in its direction
def _scan(a):
    return lax.scan(lambda c, _: (c @ a.T[:10, :10] + 0.5, None), a[:, :10], None, length=5)[0]


DIFFERENT_CASES = [
    # (name, fn, args, how ours compares with XLA's unoptimized count, why)
    ("cumsum", lambda a: jnp.cumsum(a, 1), (X,), "lower", "n - 1 steps a row, not the O(n^2) reduce_window"),
    ("erf_inv", jax.scipy.special.erfinv, (X,), "lower", "XLA counts the polynomial JAX lowers it to"),
    ("conv SAME", lambda a, k: lax.conv_general_dilated(a, k, (1, 1), "SAME"),
     (jnp.ones((2, 3, 16, 16)), jnp.ones((4, 3, 3, 3))), "higher", "ours counts taps in the padding"),
    ("scan", _scan, (X,), "higher", "ours counts the body `length` times, XLA once"),
]


@pytest.mark.parametrize("name, fn, args, direction, why", DIFFERENT_CASES,
                         ids=[c[0] for c in DIFFERENT_CASES])
def test_documented_differences_go_the_documented_way(name, fn, args, direction, why):
    xla = jax.jit(fn).lower(*args).cost_analysis()["flops"]
    ours = cost_analysis(fn, *args).flops
    assert (ours < xla) if direction == "lower" else (ours > xla), why


# ------------------------------------------------ matmul-heavy programs vs XLA after optimization
class Block(nnx.Module):
    """A pre-norm transformer block: the shape of most of the book's FLOPs."""

    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


def _block_programs():
    model = Block(64, 4, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    x = jnp.ones((4, 32, 64))

    def forward(state, x):
        model, _ = nnx.merge(graphdef, state)
        return model(x)

    def train_step(state, x):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return {"block forward": (forward, state, x), "block train step (adam)": (train_step, state, x)}


def _mlp(x, w1, w2):
    return jax.nn.relu(x @ w1) @ w2


MLP_ARGS = (jnp.ones((64, 128)), jnp.ones((128, 256)), jnp.ones((256, 32)))
MATMUL_HEAVY = {
    "mlp forward": (_mlp, *MLP_ARGS),
    "mlp gradient": (jax.grad(lambda x, w1, w2: jnp.mean(_mlp(x, w1, w2) ** 2), argnums=(1, 2)), *MLP_ARGS),
    **_block_programs(),
}


@pytest.mark.parametrize("name", list(MATMUL_HEAVY))
def test_flops_are_within_one_percent_of_xla_after_optimization(name):
    fn, *args = MATMUL_HEAVY[name]
    xla = jax.jit(fn).lower(*args).compile().cost_analysis()
    ours = cost_analysis(fn, *args)
    # 1%: the optimizer rewrites the few non-matmul FLOPs (folds x + 0, fuses max/min into
    # clamp, splits long reductions on CPU); the matmuls, >97% of the FLOPs, are untouched.
    assert ours.flops == pytest.approx(xla["flops"], rel=0.01)
    assert ours.transcendentals == pytest.approx(xla.get("transcendentals", 0.0), rel=0.01)
    # XLA's bytes lie between perfect fusion and none.
    assert ours.bytes_min <= xla["bytes accessed"] <= ours.bytes_accessed


# ------------------------------------------------ HLO rules vs XLA after optimization
HLO_CASES = {**{k: v for k, v in EXACT_CASES.items() if k not in ("cond", "gather")}, **MATMUL_HEAVY}


@pytest.mark.parametrize("name", list(HLO_CASES))
def test_per_kernel_costs_add_up_to_xla_totals_of_the_compiled_program(name):
    fn, *args = HLO_CASES[name]
    compiled = jax.jit(fn).lower(*args).compile(compiler_options=DEFAULT_CPU_PIPELINE)
    xla = compiled.cost_analysis()
    costs = op_costs(compiled).values()
    assert sum(c.flops for c in costs) == pytest.approx(xla.get("flops", 0.0), rel=1e-6)
    assert sum(c.transcendentals for c in costs) == pytest.approx(xla.get("transcendentals", 0.0), rel=1e-6)
    # 0.1%: XLA charges a few scalar operands (loop counters, constants) slightly differently.
    assert sum(c.bytes_accessed for c in costs) == pytest.approx(xla["bytes accessed"], rel=1e-3)


# ------------------------------------------------ the recompile tracker vs jax.jit's own cache
def test_compile_count_equals_the_size_of_jits_cache():
    def f(x, n):
        return x * n

    tracked = track_compiles(f, static_argnums=1)
    for shape, n in [((3,), 1), ((3,), 1), ((4,), 1), ((4,), 2), ((3,), 2), ((4,), 2)]:
        tracked(jnp.ones(shape), n)
    assert tracked.compile_count == tracked._jitted._cache_size() == 4


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("first, second, path, now, before", [
    ((jnp.ones(3),), (jnp.ones(4),), "x", "f32[4]", "f32[3]"),
    ((jnp.ones(3),), (jnp.ones(3, jnp.int32),), "x", "i32[3]", "f32[3]"),
    (({"w": jnp.ones(3)},), ({"w": jnp.ones((3, 2))},), "x['w']", "f32[3,2]", "f32[3]"),
])
def test_the_reason_names_the_same_argument_and_types_as_jax_explain_cache_misses(
        first, second, path, now, before):
    def f(x):
        return jax.tree.map(lambda v: v + 1, x)

    handler = _Messages()
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    previous = jax.config.jax_explain_cache_misses
    jax.config.update("jax_explain_cache_misses", True)
    try:
        tracked = track_compiles(f)
        tracked(*first)
        tracked(*second)
    finally:
        jax.config.update("jax_explain_cache_misses", previous)
        logger.removeHandler(handler)
    jax_says = next(m for m in handler.messages if "different input types" in m)
    assert f"at {path}, now {now}" in jax_says and f"before {before}" in jax_says
    assert tracked.compilations[1].reason == f"at {path}: now {now}, before {before}"
