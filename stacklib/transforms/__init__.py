"""`stacklib.transforms`: a tracer-based mini-JAX over NumPy (chapter 01).

The same program runs against both:

    import jax, jax.numpy as jnp                      # the real library
    import stacklib.transforms as jax                  # ours
    import stacklib.transforms.numpy as jnp

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    jax.grad(loss)(w, x); jax.vmap(loss, in_axes=(None, 0))(w, xs); jax.jit(loss)(w, x)

Mirrors `jax.jvp`, `jax.linearize`, `jax.vjp`, `jax.grad`, `jax.value_and_grad`,
`jax.vmap`, `jax.jit`, `jax.make_jaxpr`, `jax.tree_util` (a subset), `jax.errors`
(a subset) and a subset of `jax.numpy` and `jax.lax`. One concept per module:

  core       abstract values, primitives, tracers, the interpreter stack, `bind`
  lax        the primitives with their NumPy implementations and shape rules
  numpy      the user-facing array functions (promotion, broadcasting) and tracer operators
  jaxpr      the IR: jaxprs, printing, evaluation, dead-code elimination
  staging    tracing to a jaxpr (`make_jaxpr`)
  forward    forward mode (`jvp`), one JVP rule per primitive, symbolic zero tangents
  reverse    reverse mode (`grad`, `vjp`): linearize, then transpose (rules for linear primitives)
  batching   `vmap`, one batching rule per primitive
  caching    `jit`: staging with a cache keyed by abstract signature, and the `jit` primitive
  lowering   jaxprs to StableHLO text, one lowering rule per primitive; XLA compiles and runs it
  tree_util  pytrees
  errors     the errors tracing raises, with messages that explain the fix

Differences from JAX (details in each module): eager operations run with NumPy (only
`jit` compiles, through our own StableHLO emitter and XLA; `jit(f, interpret=True)`
runs the jaxpr with NumPy instead), about thirty primitives, no control-flow
primitives, no `custom_jvp`/`custom_vjp`, no symbolic zeros or weak types, no sharding.
"""

from stacklib.transforms import lax, numpy, tree_util
from stacklib.transforms.batching import vmap
from stacklib.transforms.caching import config, jit
from stacklib.transforms.core import Primitive, ShapedArray, Tracer
from stacklib.transforms.errors import (
    ConcretizationTypeError,
    MissingRuleError,
    TracerArrayConversionError,
    TracerBoolConversionError,
    UnexpectedTracerError,
    UnsupportedOperationError,
)
from stacklib.transforms.forward import jvp
from stacklib.transforms.jaxpr import ClosedJaxpr, Jaxpr, JaxprEqn, eval_jaxpr
from stacklib.transforms.reverse import grad, linearize, value_and_grad, vjp
from stacklib.transforms.staging import make_jaxpr

__all__ = [
    "ClosedJaxpr",
    "ConcretizationTypeError",
    "Jaxpr",
    "JaxprEqn",
    "MissingRuleError",
    "Primitive",
    "ShapedArray",
    "Tracer",
    "TracerArrayConversionError",
    "TracerBoolConversionError",
    "UnexpectedTracerError",
    "UnsupportedOperationError",
    "config",
    "eval_jaxpr",
    "grad",
    "jit",
    "jvp",
    "lax",
    "linearize",
    "make_jaxpr",
    "numpy",
    "tree_util",
    "value_and_grad",
    "vjp",
    "vmap",
]
