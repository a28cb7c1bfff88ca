"""Lowering: our jaxprs become StableHLO text, which XLA compiles and runs (`jit`'s default).

Mirrors `jax._src.interpreters.mlir`: one *lowering rule* per primitive, kept in a dict
keyed by the primitive (`lowering_rules`, JAX's `mlir.register_lowering`), and a walk
over the jaxpr that calls them in order (`lower_jaxpr_to_module`, JAX's
`mlir.lower_jaxpr_to_module`). A rule receives the SSA names of its operands and emits
one or a few lines of StableHLO, the MLIR dialect that XLA reads:

    %2 = stablehlo.sine %1 : tensor<3xf64>

The result is a module whose `@main` function takes the jaxpr's inputs and returns its
outputs. `compile_stablehlo` hands that text to XLA, which compiles it for the default
device (fusing elementwise operations into their neighbours, planning memory), and
`CompiledProgram` runs it on NumPy arrays.

Why jax is imported lazily: `stacklib.transforms` is layer 0 and is a mini-JAX over
NumPy; everything up to and including the emitter is plain Python and runs without
jax. Only the last step, compiling text and running it, needs XLA, which ships inside
jaxlib. So `compile_stablehlo` and the `XlaExecutable` it returns import jax when
they are first used, and `import stacklib.transforms` stays as light as before.

Differences from JAX:
  * we write MLIR as text with f-strings; JAX builds it with MLIR's Python bindings
    (`jax._src.interpreters.mlir`, `jaxlib.mlir.dialects.stablehlo`) and then prints it;
  * no shardings, layouts, donation, effects, tokens or location info (`loc(...)`);
  * constant arrays are written into the text (`stablehlo.constant dense<"0x...">`);
  * the compile step calls the XLA client's `compile_and_load` (see `compile_stablehlo`),
    which JAX wraps in `jax.jit(f).lower(...).compile()`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from stacklib.transforms import errors, lax
from stacklib.transforms.core import Primitive, ShapedArray
from stacklib.transforms.jaxpr import ClosedJaxpr, Jaxpr, Literal

# --------------------------------------------------------------------------- types

_ELEMENT_TYPES = {
    "float16": "f16", "float32": "f32", "float64": "f64", "int8": "i8", "int16": "i16",
    "int32": "i32", "int64": "i64", "uint8": "ui8", "uint16": "ui16", "uint32": "ui32",
    "uint64": "ui64", "bool": "i1",
}


def element_type(dtype: Any) -> str:
    """The MLIR element type of a NumPy dtype: float64 -> 'f64', bool -> 'i1'."""
    name = np.dtype(dtype).name
    if name not in _ELEMENT_TYPES:
        raise TypeError(f"StableHLO lowering does not handle dtype {name}; it handles "
                        f"{', '.join(_ELEMENT_TYPES)}.")
    return _ELEMENT_TYPES[name]


def tensor_type(aval: ShapedArray) -> str:
    """'tensor<3x4xf64>' for f64[3,4]; 'tensor<f64>' for a scalar."""
    dims = "".join(f"{d}x" for d in aval.shape)
    return f"tensor<{dims}{element_type(aval.dtype)}>"


def _scalar_text(value: Any, dtype: np.dtype) -> str:
    """One element as MLIR writes it; floats always with a '.' (MLIR needs it) or as bits."""
    if dtype == np.bool_:
        return "true" if value else "false"
    if np.issubdtype(dtype, np.integer):
        return str(int(value))
    value = float(value)
    if not np.isfinite(value):  # inf and nan only exist as bit patterns in MLIR text
        return hex(int(np.asarray(value, dtype).view(f"u{dtype.itemsize}")))
    text = repr(value)  # shortest text that reads back as the same double
    mantissa, _, exponent = text.partition("e")
    if "." not in mantissa:
        mantissa += ".0"
    return mantissa + (f"e{exponent}" if exponent else "")


def dense_attribute(value: np.ndarray) -> str:
    """The `dense<...>` attribute of a constant: a splat if all elements agree, else bytes."""
    value = np.asarray(value)
    flat = value.reshape(-1)
    if flat.size == 0:
        return "dense<>"
    if (flat == flat[0]).all():
        return f"dense<{_scalar_text(flat[0], value.dtype)}>"
    if value.dtype == np.bool_:  # i1 has no byte layout in MLIR text: write the nested list
        return f"dense<{str(value.tolist()).lower()}>"
    raw = np.ascontiguousarray(value.astype(value.dtype.newbyteorder("<"))).tobytes()
    return f'dense<"0x{raw.hex().upper()}">'


# --------------------------------------------------------------------------- the emitter


@dataclasses.dataclass
class LoweringRuleContext:
    """What a lowering rule sees besides its operands: their types, and where to write.

    `avals_in`/`avals_out` are the abstract values of the equation (as JAX's
    `mlir.LoweringRuleContext`). `emit(op)` writes `%N = op` into the current function
    and returns `%N`; a rule ends with the SSA name (or names) of its results.
    """

    function: _FunctionBuilder
    avals_in: list[ShapedArray]
    avals_out: list[ShapedArray]

    def emit(self, op: str) -> str:
        return self.function.emit(op)

    def constant(self, value: Any, dtype: Any) -> str:
        """A scalar constant of the given dtype (a reduction's initial value, say)."""
        return self.function.constant(np.asarray(value, dtype))

    def lower_call(self, closed: ClosedJaxpr, name: str, args: Sequence[str]) -> list[str]:
        """Lower `closed` as a private function of the module and call it (nested `jit`)."""
        return self.function.module.call(closed, name, args, self.function)


class _FunctionBuilder:
    """The lines of one `func.func` and its SSA name counter."""

    def __init__(self, module: _ModuleBuilder):
        self.module = module
        self.lines: list[str] = []
        self.count = 0

    def emit(self, op: str) -> str:
        name = f"%{self.count}"
        self.count += 1
        self.lines.append(f"{name} = {op}")
        return name

    def constant(self, value: np.ndarray) -> str:
        aval = ShapedArray(value.shape, value.dtype)
        return self.emit(f"stablehlo.constant {dense_attribute(value)} : {tensor_type(aval)}")


class _ModuleBuilder:
    """The functions of one module: `@main` first, then one private function per inner jit."""

    def __init__(self):
        self.functions: list[str] = []
        self.names: dict[int, str] = {}  # id(inner ClosedJaxpr) -> its function's name
        self.alive: list[Any] = []  # keeps the ids above from being reused

    def function(self, closed: ClosedJaxpr, name: str, visibility: str) -> str:
        builder = _FunctionBuilder(self)
        args = [f"%arg{i}" for i in range(len(closed.jaxpr.invars))]
        outs = lower_jaxpr(builder, closed.jaxpr, closed.consts, args)
        signature = ", ".join(f"{a}: {tensor_type(v.aval)}" for a, v in zip(args, closed.jaxpr.invars,
                                                                            strict=True))
        out_types = ", ".join(tensor_type(v.aval) for v in closed.jaxpr.outvars)
        body = "".join(f"    {line}\n" for line in builder.lines)
        ret = f"    return {', '.join(outs)} : {out_types}\n" if outs else "    return\n"
        return f"  func.func {visibility} @{name}({signature}) -> ({out_types}) {{\n{body}{ret}  }}\n"

    def call(self, closed: ClosedJaxpr, name: str, args: Sequence[str],
             caller: _FunctionBuilder) -> list[str]:
        if id(closed) not in self.names:
            unique = f"{_symbol(name)}_{len(self.names)}"
            self.names[id(closed)] = unique
            self.alive.append(closed)
            self.functions.append(self.function(closed, unique, "private"))
        in_types = ", ".join(tensor_type(v.aval) for v in closed.jaxpr.invars)
        out_types = ", ".join(tensor_type(v.aval) for v in closed.jaxpr.outvars)
        call = f"func.call @{self.names[id(closed)]}({', '.join(args)}) : ({in_types}) -> ({out_types})"
        n = len(closed.jaxpr.outvars)
        if n == 0:  # nothing to name
            caller.lines.append(call)
            return []
        result = caller.emit(call)
        if n == 1:
            return [result]
        # A call with n results defines %N:n; its results are %N#0, %N#1, ...
        caller.lines[-1] = caller.lines[-1].replace(f"{result} =", f"{result}:{n} =", 1)
        return [f"{result}#{i}" for i in range(n)]


def _symbol(name: str) -> str:
    """A valid MLIR symbol from a Python name ('<lambda>' -> '_lambda_')."""
    return re.sub(r"\W", "_", name) or "f"


def lower_jaxpr(function: _FunctionBuilder, jaxpr: Jaxpr, consts: Sequence[Any],
                args: Sequence[str]) -> list[str]:
    """Emit the equations of `jaxpr` into `function`; return the SSA names of its outputs.

    Constants become `stablehlo.constant`s, literals too (once each); every equation
    calls its primitive's rule with the SSA names of its inputs.

    Raises:
      MissingRuleError: a primitive has no lowering rule (before anything is compiled).
    """
    env: dict[int, str] = {}
    for var, name in zip(jaxpr.invars, args, strict=True):
        env[id(var)] = name
    for var, value in zip(jaxpr.constvars, consts, strict=True):
        env[id(var)] = function.constant(np.asarray(value, var.aval.dtype))

    def read(atom) -> str:
        if isinstance(atom, Literal):
            if id(atom) not in env:
                env[id(atom)] = function.constant(atom.val)
            return env[id(atom)]
        return env[id(atom)]

    for eqn in jaxpr.eqns:
        rule = lowering_rules.get(eqn.primitive)
        if rule is None:
            raise errors.MissingRuleError(missing_rule_message(eqn.primitive))
        ctx = LoweringRuleContext(function, [v.aval for v in eqn.invars], [v.aval for v in eqn.outvars])
        outs = rule(ctx, *[read(v) for v in eqn.invars], **eqn.params)
        outs = [outs] if isinstance(outs, str) else list(outs)
        for var, name in zip(eqn.outvars, outs, strict=True):
            env[id(var)] = name
    return [read(v) for v in jaxpr.outvars]


def missing_rule_message(primitive: Primitive) -> str:
    return (
        f"The primitive '{primitive.name}' has no lowering rule, so jit cannot compile it to "
        f"StableHLO. Add one to stacklib/transforms/lowering.py: a function "
        f"rule(ctx, *operands, **params) that emits StableHLO with ctx.emit(...), registered "
        f"with lowering_rules[{primitive.name}_p] = rule. Or run the function with NumPy "
        f"instead: jit(f, interpret=True)."
    )


def lower_jaxpr_to_module(closed: ClosedJaxpr, name: str = "main") -> str:
    """The StableHLO module (as text) of a closed jaxpr: `@main` has its inputs and outputs.

    Args:
      closed: the program, with the values of its constants.
      name: the module's name (`module @jit_<name>`), as JAX names it.

    Returns:
      MLIR text that `compile_stablehlo` accepts.

    Raises:
      MissingRuleError: a primitive of the jaxpr, or of a jaxpr inside it, has no rule.
    """
    module = _ModuleBuilder()
    main = module.function(closed, "main", "public")
    return (f"module @jit_{_symbol(name)} attributes {{mhlo.num_partitions = 1 : i32, "
            f"mhlo.num_replicas = 1 : i32}} {{\n{main}{''.join(module.functions)}}}\n")


# --------------------------------------------------------------------------- the rules

lowering_rules: dict[Primitive, Callable[..., str | list[str]]] = {}


def _broadcast_scalars(ctx: LoweringRuleContext, operands: Sequence[str]) -> list[str]:
    """Our binary primitives accept a rank-0 operand beside a shaped one; StableHLO does not."""
    shape = ctx.avals_out[0].shape
    out = []
    for x, aval in zip(operands, ctx.avals_in, strict=True):
        if aval.shape != shape:
            target = ShapedArray(shape, aval.dtype)
            x = ctx.emit(f"stablehlo.broadcast_in_dim {x}, dims = [] : ({tensor_type(aval)}) -> "
                         f"{tensor_type(target)}")
        out.append(x)
    return out


def _unary_rule(op: str) -> Callable[..., str]:
    def rule(ctx: LoweringRuleContext, x: str) -> str:
        return ctx.emit(f"stablehlo.{op} {x} : {tensor_type(ctx.avals_out[0])}")
    return rule


def _binary_rule(op: str) -> Callable[..., str]:
    def rule(ctx: LoweringRuleContext, x: str, y: str) -> str:
        x, y = _broadcast_scalars(ctx, [x, y])
        return ctx.emit(f"stablehlo.{op} {x}, {y} : {tensor_type(ctx.avals_out[0])}")
    return rule


def _compare_type(dtype: np.dtype) -> str:
    if np.issubdtype(dtype, np.floating):
        return "FLOAT"
    return "SIGNED" if np.issubdtype(dtype, np.signedinteger) else "UNSIGNED"


def _compare_rule(direction: str) -> Callable[..., str]:
    def rule(ctx: LoweringRuleContext, x: str, y: str) -> str:
        x, y = _broadcast_scalars(ctx, [x, y])
        in_type = tensor_type(ShapedArray(ctx.avals_out[0].shape, ctx.avals_in[0].dtype))
        return ctx.emit(f"stablehlo.compare {direction}, {x}, {y}, {_compare_type(ctx.avals_in[0].dtype)} "
                        f": ({in_type}, {in_type}) -> {tensor_type(ctx.avals_out[0])}")
    return rule


for _primitive, _op in [(lax.neg_p, "negate"), (lax.sin_p, "sine"), (lax.cos_p, "cosine"),
                        (lax.exp_p, "exponential"), (lax.log_p, "log"), (lax.tanh_p, "tanh")]:
    lowering_rules[_primitive] = _unary_rule(_op)
for _primitive, _op in [(lax.add_p, "add"), (lax.sub_p, "subtract"), (lax.mul_p, "multiply"),
                        (lax.div_p, "divide"), (lax.max_p, "maximum"), (lax.min_p, "minimum"),
                        (lax.pow_p, "power")]:
    lowering_rules[_primitive] = _binary_rule(_op)
for _primitive, _direction in [(lax.gt_p, "GT"), (lax.lt_p, "LT"), (lax.ge_p, "GE"), (lax.le_p, "LE"),
                               (lax.eq_p, "EQ"), (lax.ne_p, "NE")]:
    lowering_rules[_primitive] = _compare_rule(_direction)


def _integer_pow_rule(ctx: LoweringRuleContext, x: str, *, y: int) -> str:
    """x ** y by repeated squaring, as JAX lowers it: about log2(y) multiplications."""
    out_type = tensor_type(ctx.avals_out[0])
    result, power, n = None, x, abs(y)
    while n:
        if n & 1:
            result = power if result is None else ctx.emit(
                f"stablehlo.multiply {result}, {power} : {out_type}")
        n >>= 1
        if n:
            power = ctx.emit(f"stablehlo.multiply {power}, {power} : {out_type}")
    if result is None:  # x ** 0
        one = ctx.constant(1, ctx.avals_out[0].dtype)
        return ctx.emit(f"stablehlo.broadcast_in_dim {one}, dims = [] : "
                        f"({tensor_type(ShapedArray((), ctx.avals_out[0].dtype))}) -> {out_type}")
    if y < 0:
        one = ctx.constant(1, ctx.avals_out[0].dtype)
        ones = ctx.emit(f"stablehlo.broadcast_in_dim {one}, dims = [] : "
                        f"({tensor_type(ShapedArray((), ctx.avals_out[0].dtype))}) -> {out_type}")
        result = ctx.emit(f"stablehlo.divide {ones}, {result} : {out_type}")
    return result


def _convert_element_type_rule(ctx: LoweringRuleContext, x: str, *, new_dtype: np.dtype) -> str:
    aval_in, aval_out = ctx.avals_in[0], ctx.avals_out[0]
    if aval_in.dtype == aval_out.dtype:
        return x
    if aval_out.dtype == np.bool_:  # NumPy's astype(bool) means "!= 0"; a convert would truncate
        zero = ctx.constant(0, aval_in.dtype)
        zeros = ctx.emit(f"stablehlo.broadcast_in_dim {zero}, dims = [] : "
                         f"({tensor_type(ShapedArray((), aval_in.dtype))}) -> {tensor_type(aval_in)}")
        return ctx.emit(f"stablehlo.compare NE, {x}, {zeros}, {_compare_type(aval_in.dtype)} : "
                        f"({tensor_type(aval_in)}, {tensor_type(aval_in)}) -> {tensor_type(aval_out)}")
    return ctx.emit(f"stablehlo.convert {x} : ({tensor_type(aval_in)}) -> {tensor_type(aval_out)}")


def _select_n_rule(ctx: LoweringRuleContext, predicate: str, on_false: str, on_true: str) -> str:
    pred, case, _ = ctx.avals_in
    return ctx.emit(f"stablehlo.select {predicate}, {on_true}, {on_false} : "
                    f"({tensor_type(pred)}, {tensor_type(case)}, {tensor_type(case)}) -> "
                    f"{tensor_type(ctx.avals_out[0])}")


def reduce(ctx: LoweringRuleContext, x: str, init: str, op: str, axes: Sequence[int]) -> str:
    """`stablehlo.reduce` of `x` over `axes`, starting from `init` and combining with `op`."""
    aval_in, aval_out = ctx.avals_in[0], ctx.avals_out[0]
    scalar = tensor_type(ShapedArray((), aval_in.dtype))
    return ctx.emit(f"stablehlo.reduce({x} init: {init}) applies stablehlo.{op} across dimensions = "
                    f"[{', '.join(map(str, axes))}] : ({tensor_type(aval_in)}, {scalar}) -> "
                    f"{tensor_type(aval_out)}")


def _reduce_sum_rule(ctx: LoweringRuleContext, x: str, *, axes: tuple[int, ...]) -> str:
    return reduce(ctx, x, ctx.constant(0, ctx.avals_in[0].dtype), "add", axes)


def _lowest(dtype: Any) -> Any:
    """The identity of `max`: -inf for floats, the smallest integer, False."""
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.floating):
        return -np.inf
    return False if dtype == np.bool_ else np.iinfo(dtype).min


def _reduce_max_rule(ctx: LoweringRuleContext, x: str, *, axes: tuple[int, ...]) -> str:
    dtype = ctx.avals_in[0].dtype
    return reduce(ctx, x, ctx.constant(_lowest(dtype), dtype), "maximum", axes)


def _broadcast_in_dim_rule(ctx: LoweringRuleContext, x: str, *, shape, broadcast_dimensions) -> str:
    dims = ", ".join(map(str, broadcast_dimensions))
    return ctx.emit(f"stablehlo.broadcast_in_dim {x}, dims = [{dims}] : ({tensor_type(ctx.avals_in[0])}) "
                    f"-> {tensor_type(ctx.avals_out[0])}")


def _reshape_rule(ctx: LoweringRuleContext, x: str, *, new_sizes) -> str:
    return ctx.emit(f"stablehlo.reshape {x} : ({tensor_type(ctx.avals_in[0])}) -> "
                    f"{tensor_type(ctx.avals_out[0])}")


def _transpose_rule(ctx: LoweringRuleContext, x: str, *, permutation) -> str:
    dims = ", ".join(map(str, permutation))
    return ctx.emit(f"stablehlo.transpose {x}, dims = [{dims}] : ({tensor_type(ctx.avals_in[0])}) -> "
                    f"{tensor_type(ctx.avals_out[0])}")


def _dot_general_rule(ctx: LoweringRuleContext, lhs: str, rhs: str, *, dimension_numbers) -> str:
    """Our output order is StableHLO's too: batch dims, then lhs free, then rhs free."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    dims = lambda d: f"[{', '.join(map(str, d))}]"  # noqa: E731
    batching = f"batching_dims = {dims(lhs_batch)} x {dims(rhs_batch)}, " if lhs_batch else ""
    lhs_type, rhs_type = (tensor_type(a) for a in ctx.avals_in)
    return ctx.emit(f"stablehlo.dot_general {lhs}, {rhs}, {batching}contracting_dims = "
                    f"{dims(lhs_contract)} x {dims(rhs_contract)} : ({lhs_type}, {rhs_type}) -> "
                    f"{tensor_type(ctx.avals_out[0])}")


lowering_rules[lax.integer_pow_p] = _integer_pow_rule
lowering_rules[lax.convert_element_type_p] = _convert_element_type_rule
lowering_rules[lax.select_n_p] = _select_n_rule
lowering_rules[lax.reduce_sum_p] = _reduce_sum_rule
lowering_rules[lax.reduce_max_p] = _reduce_max_rule
lowering_rules[lax.broadcast_in_dim_p] = _broadcast_in_dim_rule
lowering_rules[lax.reshape_p] = _reshape_rule
lowering_rules[lax.transpose_p] = _transpose_rule
lowering_rules[lax.dot_general_p] = _dot_general_rule
# The rule of `jit` itself (a private function and a func.call) is registered in caching.py,
# next to the primitive, as its JVP and batching rules are.

# --------------------------------------------------------------------------- compile and run


class StableHLOCompileError(RuntimeError):
    """XLA rejected a module we wrote: the message shows the offending line of our text.

    `text` holds the whole module, for a reader who needs the lines around it.
    """

    text: str = ""


def _explain_compile_error(error: Exception, text: str) -> StableHLOCompileError:
    """Point at the line of `text` that the MLIR parser names (`-:LINE:COL: error: ...`)."""
    message = str(error)
    found = re.search(r"-:(\d+):(\d+): error: (.*)", message)
    if not found:
        return StableHLOCompileError(f"XLA could not compile our StableHLO module:\n{message}")
    line, column, what = int(found[1]), int(found[2]), found[3]
    lines = text.splitlines()
    shown = lines[line - 1] if 0 < line <= len(lines) else "<line not in the module>"
    caret = " " * (column - 1 - (len(shown) - len(shown.lstrip())))  # we print the line unindented
    return StableHLOCompileError(
        f"XLA could not compile our StableHLO module: {what}\n"
        f"  line {line}, column {column}:\n    {shown.strip()}\n    {caret}^\n"
        "A lowering rule wrote this line: check its op name, operand types and result type "
        "against the StableHLO spec (https://openxla.org/stablehlo/spec).")


def compile_stablehlo(text: str, in_avals: Sequence[ShapedArray]) -> XlaExecutable:
    """Compile a StableHLO module (text) with XLA for the default device.

    Returns an `XlaExecutable`: call it with NumPy arrays of types `in_avals` to get the
    outputs as jax Arrays. This is the one function that uses jaxlib below JAX's public
    API, and nothing else in stacklib does:
      * `jax.extend.backend.get_backend()` and `get_compile_options` are public (jax.extend);
      * `Client.compile_and_load(text, devices, options)` is jaxlib's own method (JAX's
        `jax._src.compiler.backend_compile_and_load` calls it), not documented;
      * `XlaExecutable` calls two more jaxlib functions, see there.
    `tests/test_transforms_lowering.py::test_compile_stablehlo_uses_the_xla_client_we_expect`
    fails loudly if an upgrade changes any of them.

    Raises:
      StableHLOCompileError: XLA rejected the text; the message quotes the offending line.
    """
    from jax.extend import backend as jex_backend

    client = jex_backend.get_backend()
    device = client.local_devices()[0]
    options = jex_backend.get_compile_options(num_replicas=1, num_partitions=1)
    try:
        executable = client.compile_and_load(text, [device], options)
    except Exception as error:  # jax.errors.JaxRuntimeError, without importing it eagerly
        explained = _explain_compile_error(error, text)
        explained.text = text
        raise explained from None
    return XlaExecutable(executable, device, in_avals)


class XlaExecutable:
    """A compiled XLA program, and the two steps that take our arrays through it.

    `put` wraps NumPy arrays as device buffers and `execute` runs the program on them;
    calling the object does both. They are separate so that chapter 01 can time each.
    Both are jaxlib calls below JAX's public API, the ones JAX's own `jit` makes:
      * `xla_client.batched_device_put` wraps an array without a copy on CPU and keeps its
        dtype whatever `jax_enable_x64` says; it is what `jax.device_put` calls, minus its
        Python (~0.1 ms a call);
      * `LoadedExecutable.execute_sharded(...).disassemble_into_single_device_arrays()` is
        what jaxlib's own `execute` wraps, minus a Python frame.
    """

    def __init__(self, executable: Any, device: Any, in_avals: Sequence[ShapedArray]):
        import jax
        from jaxlib import xla_client

        self.executable = executable
        self._device_put = xla_client.batched_device_put
        self._devices = [device]
        self._sharding = jax.sharding.SingleDeviceSharding(device)
        self._jax_avals = [jax.core.ShapedArray(aval.shape, aval.dtype) for aval in in_avals]

    def put(self, arrays: Sequence[np.ndarray]) -> list[Any]:
        """Our arrays as device buffers (on CPU: the same memory), one per input."""
        return [self._device_put(aval, self._sharding, [x], self._devices, True, enable_x64=True)
                for aval, x in zip(self._jax_avals, arrays, strict=True)]

    def execute(self, buffers: list[Any]) -> list[Any]:
        """Run the program; the outputs are jax Arrays, still being computed (XLA is asynchronous)."""
        results = self.executable.execute_sharded(buffers).disassemble_into_single_device_arrays()
        return [per_device[0] for per_device in results]  # one device: its single shard

    def __call__(self, *arrays: np.ndarray) -> list[Any]:
        return self.execute(self.put(arrays))


@dataclasses.dataclass
class CompiledProgram:
    """A jaxpr compiled by XLA: call it with NumPy arrays, get NumPy arrays back.

    The outputs are read-only views of XLA's buffers (immutable, as jax Arrays are;
    `jit(f, interpret=True)` returns writable ones): `np.array(out)` copies one to write into.
    """

    text: str
    in_avals: list[ShapedArray]
    out_avals: list[ShapedArray]
    run: Callable[..., list[Any]]

    def __call__(self, *args: Any) -> list[np.ndarray]:
        # XLA reads the arrays in place (no copy on CPU); our dtypes are the program's.
        arrays = [np.asarray(a, aval.dtype) for a, aval in zip(args, self.in_avals, strict=True)]
        return to_numpy(self.run(*arrays))


def to_numpy(outputs: Sequence[Any]) -> list[np.ndarray]:
    """jax Arrays on the CPU as NumPy arrays: read-only views of the same memory, once computed."""
    return [np.asarray(out) for out in outputs]


def compile_jaxpr(closed: ClosedJaxpr, name: str = "main") -> CompiledProgram:
    """Lower `closed` to StableHLO and compile it: what `jit` does on a cache miss."""
    text = lower_jaxpr_to_module(closed, name)
    return CompiledProgram(text, closed.in_avals, closed.out_avals, compile_stablehlo(text, closed.in_avals))
