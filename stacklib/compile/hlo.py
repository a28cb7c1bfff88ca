"""Read XLA's optimized HLO: computations, instructions, fusions, and what each kernel costs.

`jax.jit(f).lower(*args).compile().as_text()` prints the program XLA will run: an HLO
module made of computations, one of them the ENTRY. Each line of a computation is one
instruction,

    %name = f32[64,256]{1,0} opcode(%operand, ...), attribute=value, ...

and a `fusion` instruction is one kernel whose body is another computation (`calls=`).
`parse_hlo` turns that text into small dataclasses; `fusions` lists the fused kernels with
the operations inside each; `op_costs` gives each kernel of the entry computation its
FLOPs, transcendentals and bytes, by the same rules XLA's `HloCostAnalysis` uses. The sum
over kernels is what `compiled.cost_analysis()` reports for the whole program, which is
how the tests check the rules; chapter 08 joins the per-kernel costs with a profile.

Mirrors: the text format of `xla::HloModule::ToString()` and the totals of
`jax.stages.Compiled.cost_analysis()`.

Differences from XLA:
  * A text parser, not XLA's: it reads names, opcodes, shapes, operands and the few
    attributes the rules need (`kind`, `calls`, `to_apply`, contracting dimensions,
    windows, metadata), and keeps the rest as raw text.
  * A kernel's bytes are its operands plus its results. XLA refines this: an operand read
    only through a slice counts the slice, an in-place update counts the update.
  * A convolution counts every kernel tap, also those that fall into the padding.
  * Library calls other than matrix multiplies (`custom-call`) count zero.
  * The kernels of every branch of a `conditional` are listed; XLA's total charges only
    the most expensive branch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any

# Bytes per element of each HLO element type (sub-byte types round up to what they occupy).
_DTYPE_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
    "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "f8e3m4": 1, "f8e4m3b11fnuz": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "token": 0,
}
_ARRAY_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")

_ONE_FLOP = frozenset({
    "add", "subtract", "multiply", "divide", "remainder", "maximum", "minimum", "negate", "abs",
    "sign", "floor", "ceil", "round-nearest-afz", "round-nearest-even", "compare", "select",
    "clamp", "and", "or", "xor", "not", "shift-left", "shift-right-arithmetic",
    "shift-right-logical", "convert", "is-finite", "popcnt", "count-leading-zeros", "real", "imag",
    "complex", "reduce-precision",
})
_TRANSCENDENTAL = frozenset({
    "exponential", "log", "log-plus-one", "exponential-minus-one", "tanh", "sine", "cosine", "tan",
    "sqrt", "rsqrt", "cbrt", "power", "atan2", "erf", "logistic",
})
# Instructions that launch no work of their own: they name, reinterpret or group buffers.
_NO_WORK = frozenset({"parameter", "constant", "bitcast", "tuple", "get-tuple-element",
                      "after-all", "partition-id", "replica-id", "opt-barrier"})
# Control flow: the kernels are the instructions of the computations they run, which
# `_kernels` lists in their own right (each once, as XLA counts a loop body once).
_CONTAINERS = frozenset({"while", "call", "conditional"})

# `compiler_options` for `.compile()` that restore XLA's default CPU fusion pipeline whatever
# XLA_FLAGS say. The fusions XLA forms, and so the text these functions read, depend on it:
# `make test` turns the fusion emitters off to compile faster, and a scatter then becomes a
# while loop around an in-place dynamic-update-slice, which XLA charges for the slice it writes
# and `op_costs` for the whole buffer.
DEFAULT_CPU_PIPELINE = {"xla_cpu_use_fusion_emitters": True}


@dataclasses.dataclass(frozen=True)
class HloInstruction:
    """One line of an HLO computation.

    Attributes:
      name: the instruction's name, without the leading '%'.
      opcode: e.g. 'fusion', 'dot', 'add', 'parameter'.
      shape: the result type as printed, e.g. 'f32[64,256]{1,0}' or a '(...)' tuple.
      operands: names of the operand instructions (literal operands of a constant are dropped).
      attributes: everything after the operand list, raw.
      is_root: whether this instruction is its computation's result.
    """

    name: str
    opcode: str
    shape: str
    operands: tuple[str, ...]
    attributes: str
    is_root: bool = False

    @property
    def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        """(element type, dimensions) of each array in the result (several for a tuple)."""
        return [(dtype, tuple(int(d) for d in dims.split(",") if d))
                for dtype, dims in _ARRAY_SHAPE.findall(self.shape)]

    @property
    def elements(self) -> int:
        """Elements of the first result array: what an elementwise rule counts."""
        arrays = self.arrays
        return math.prod(arrays[0][1]) if arrays else 0

    @property
    def nbytes(self) -> float:
        """Bytes of the result (all arrays of a tuple)."""
        return sum(math.prod(dims) * _DTYPE_BYTES.get(dtype, 0) for dtype, dims in self.arrays)

    def attribute(self, key: str) -> str | None:
        """The raw value of `key=...` (braces kept), or None."""
        match = re.search(rf"(?:^|[\s,]){re.escape(key)}=", self.attributes)
        if not match:
            return None
        rest = self.attributes[match.end():]
        if rest.startswith("{"):
            return rest[: _closing(rest, 0, "{", "}") + 1]
        if rest.startswith('"'):
            return rest[: rest.index('"', 1) + 1]
        return re.match(r"[^,\s]*", rest).group(0)

    @property
    def fusion_kind(self) -> str | None:
        """'kLoop', 'kInput', 'kOutput', or for 'kCustom' the backend's kind (e.g. '__triton_gemm')."""
        kind = self.attribute("kind")
        if kind == "kCustom":
            custom = re.search(r'"kind":"([^"]+)"', self.attributes)
            return custom.group(1) if custom else kind
        return kind

    @property
    def called(self) -> tuple[str, ...]:
        """Names of the computations this instruction calls (fused body, reducer, loop body...)."""
        names = []
        for key in ("calls", "to_apply", "body", "condition", "true_computation",
                    "false_computation", "branch_computations"):
            value = self.attribute(key)
            if value:
                names += [name.lstrip("%") for name in re.findall(r"%?[\w.\-]+", value)]
        return tuple(names)

    @property
    def op_name(self) -> str:
        """The JAX-side name from the metadata, e.g. 'jit(f)/layer1/dot_general' (named scopes)."""
        match = re.search(r'op_name="((?:[^"\\]|\\.)*)"', self.attributes)
        return match.group(1) if match else ""


@dataclasses.dataclass(frozen=True)
class HloComputation:
    name: str
    instructions: tuple[HloInstruction, ...]
    is_entry: bool = False

    @functools.cached_property
    def by_name(self) -> dict[str, HloInstruction]:
        return {instruction.name: instruction for instruction in self.instructions}

    @property
    def root(self) -> HloInstruction:
        return next((i for i in self.instructions if i.is_root), self.instructions[-1])


@dataclasses.dataclass(frozen=True)
class HloModule:
    name: str
    computations: dict[str, HloComputation]
    entry_name: str

    @property
    def entry(self) -> HloComputation:
        return self.computations[self.entry_name]


@dataclasses.dataclass(frozen=True)
class Fusion:
    """One fused kernel: its instruction name, fusion kind, and the opcodes fused into it."""

    name: str
    kind: str | None
    opcodes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class OpCost:
    flops: float
    transcendentals: float
    bytes_accessed: float

    @property
    def arithmetic_intensity(self) -> float:
        return self.flops / self.bytes_accessed if self.bytes_accessed else math.inf


def _closing(text: str, start: int, opening: str, closing: str) -> int:
    """Index of the bracket that closes the one at `text[start]`."""
    depth = 0
    for index in range(start, len(text)):
        if text[index] == opening:
            depth += 1
        elif text[index] == closing:
            depth -= 1
            if depth == 0:
                return index
    raise ValueError(f"unbalanced {opening}{closing} in HLO text: {text[start:start + 80]!r}...")


_INSTRUCTION_HEAD = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_COMPUTATION_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")


def _parse_instruction(line: str) -> HloInstruction | None:
    head = _INSTRUCTION_HEAD.match(line)
    if not head:
        return None
    rest = line[head.end():]
    if rest.startswith("("):  # a tuple-shaped result: (f32[2], s32[])
        end = _closing(rest, 0, "(", ")") + 1
    else:
        end = rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    opcode_match = re.match(r"([\w\-]+)\(", rest)
    if not opcode_match:
        return None
    open_paren = opcode_match.end() - 1
    close_paren = _closing(rest, open_paren, "(", ")")
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[open_paren:close_paren]))
    attributes = rest[close_paren + 1:].lstrip(", ").strip()
    return HloInstruction(head.group(2), opcode_match.group(1), shape, operands, attributes,
                          is_root=bool(head.group(1)))


def parse_hlo(text: str) -> HloModule:
    """Parse the text of an HLO module (`compiled.as_text()` or `lowered.as_text("hlo")`).

    Raises:
      ValueError: the text holds no ENTRY computation (e.g. StableHLO text was passed).
    """
    text = re.sub(r"/\*.*?\*/", "", text)  # /*index=5*/ comments inside long tuple shapes
    module_name = re.search(r"^HloModule\s+([\w.\-]+)", text, re.MULTILINE)
    computations: dict[str, HloComputation] = {}
    entry_name = None
    current, instructions, is_entry = None, [], False
    for line in text.splitlines():
        if current is None:
            head = _COMPUTATION_HEAD.match(line)
            if head:
                current, instructions, is_entry = head.group(2), [], bool(head.group(1))
            continue
        if line.strip() == "}":
            computations[current] = HloComputation(current, tuple(instructions), is_entry)
            entry_name = current if is_entry else entry_name
            current = None
            continue
        instruction = _parse_instruction(line)
        if instruction is not None:
            instructions.append(instruction)
    if entry_name is None:
        raise ValueError(
            "No ENTRY computation found: parse_hlo expects optimized HLO text, such as "
            "jax.jit(f).lower(*args).compile().as_text(). StableHLO text (lower(...).as_text()) "
            "is MLIR, not HLO."
        )
    return HloModule(module_name.group(1) if module_name else "", computations, entry_name)


def _as_module(hlo: Any) -> HloModule:
    """Accept an HloModule, HLO text, or a compiled JAX function (`jax.stages.Compiled`)."""
    if isinstance(hlo, HloModule):
        return hlo
    if hasattr(hlo, "as_text"):
        hlo = hlo.as_text()
    if not isinstance(hlo, str):
        raise TypeError(f"Expected HLO text, an HloModule or a compiled function, got {type(hlo).__name__}.")
    return parse_hlo(hlo)


def _kernels(module: HloModule) -> list[HloInstruction]:
    """Instructions that run as kernels: those of non-fused computations that do work."""
    fused = {name for c in module.computations.values() for i in c.instructions
             if i.opcode == "fusion" for name in i.called}
    # Reducers and comparators (`to_apply` of reduce, scatter, sort...) run per element,
    # inside their instruction's kernel; a `call`'s `to_apply` is a body of kernels.
    applied = {name for c in module.computations.values() for i in c.instructions
               if i.opcode not in ("fusion", "call") and i.attribute("to_apply") for name in i.called}
    return [instruction for name, computation in module.computations.items()
            if name not in fused and name not in applied
            for instruction in computation.instructions
            if instruction.opcode not in _NO_WORK | _CONTAINERS]


def fusions(hlo: Any) -> list[Fusion]:
    """The fused kernels of an optimized HLO module, in program order.

    Args:
      hlo: HLO text, an `HloModule`, or a `jax.stages.Compiled`.

    Returns:
      One `Fusion` per `fusion` instruction outside fused bodies, with its kind and the
      opcodes of the work fused into it (parameters and constants left out).
    """
    module = _as_module(hlo)
    found = []
    for instruction in _kernels(module):
        if instruction.opcode != "fusion":
            continue
        body = module.computations[instruction.called[0]]
        opcodes = tuple(i.opcode for i in body.instructions if i.opcode not in ("parameter", "constant"))
        found.append(Fusion(instruction.name, instruction.fusion_kind, opcodes))
    return found


def count_fusions(hlo: Any) -> int:
    """How many fused kernels the optimized module launches (see `fusions`)."""
    return len(fusions(hlo))


def _operand_shape(computation: HloComputation, instruction: HloInstruction, index: int):
    operand = computation.by_name.get(instruction.operands[index])
    return operand.arrays[0][1] if operand is not None and operand.arrays else ()


def _dims_attribute(instruction: HloInstruction, key: str) -> tuple[int, ...]:
    value = instruction.attribute(key) or "{}"
    return tuple(int(d) for d in re.findall(r"\d+", value))


def _combiner_flops(module: HloModule, instruction: HloInstruction) -> int:
    """FLOPs of one application of a reducer/scatter computation (scalar ops, 1 each)."""
    reducer = module.computations[instruction.called[0]]
    return sum(1 for i in reducer.instructions if i.opcode not in _NO_WORK)


def _instruction_flops(module: HloModule, computation: HloComputation,
                       instruction: HloInstruction) -> tuple[float, float]:
    """(flops, transcendentals) of one instruction, recursing into the computations it runs."""
    op = instruction.opcode
    if op in _ONE_FLOP:
        return instruction.elements, 0
    if op in _TRANSCENDENTAL:
        return (3 * instruction.elements if op == "logistic" else 0), instruction.elements
    if op == "dot":
        lhs = _operand_shape(computation, instruction, 0)
        contracted = math.prod(lhs[d] for d in _dims_attribute(instruction, "lhs_contracting_dims"))
        return 2 * instruction.elements * contracted, 0
    if op == "convolution":
        kernel = _operand_shape(computation, instruction, 1)
        labels = instruction.attribute("dim_labels") or ""
        kernel_labels = labels.split("_")[1].split("->")[0] if "_" in labels else ""
        out_features = kernel[kernel_labels.index("o")] if "o" in kernel_labels else 1
        return 2 * instruction.elements * math.prod(kernel) // out_features, 0
    target = instruction.attribute("custom_call_target") or ""
    if op == "custom-call" and re.search(r"gemm|matmul", target):  # e.g. cuBLAS on a GPU
        lhs = _operand_shape(computation, instruction, 0)
        contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instruction.attributes)
        dims = [int(d) for d in re.findall(r"\d+", contracting.group(1))] if contracting else []
        return 2 * instruction.elements * math.prod(lhs[d] for d in dims), 0
    if op == "reduce":
        inputs = math.prod(_operand_shape(computation, instruction, 0))
        outputs = instruction.elements
        return (inputs - outputs) * _combiner_flops(module, instruction), 0
    if op == "reduce-window":
        window = instruction.attribute("window") or ""
        size = re.search(r"size=([\dx]+)", window)
        taps = math.prod(int(s) for s in size.group(1).split("x")) if size else 1
        return instruction.elements * (taps - 1) * _combiner_flops(module, instruction), 0
    if op == "scatter":
        updates = math.prod(_operand_shape(computation, instruction, len(instruction.operands) - 1))
        return updates * _combiner_flops(module, instruction), 0
    if op == "sort":
        n = math.prod(_operand_shape(computation, instruction, 0))
        return (n * math.ceil(math.log2(n)) if n > 1 else 0), 0
    if op == "fusion":
        totals = [_computation_flops(module, name) for name in instruction.called]
        return sum(t[0] for t in totals), sum(t[1] for t in totals)
    return 0, 0


def _computation_flops(module: HloModule, name: str) -> tuple[float, float]:
    computation = module.computations[name]
    totals = [_instruction_flops(module, computation, i) for i in computation.instructions]
    return sum(t[0] for t in totals), sum(t[1] for t in totals)


def op_costs(hlo: Any) -> dict[str, OpCost]:
    """FLOPs, transcendentals and bytes of each kernel the optimized module launches.

    A kernel is an instruction outside fused bodies and reducers that does work (not a
    parameter, constant, bitcast or tuple). Its bytes are its operands read plus its
    results written; its FLOPs are the sum over the instructions fused into it.

    Args:
      hlo: HLO text, an `HloModule`, or a `jax.stages.Compiled`.

    Returns:
      Instruction name -> `OpCost`, in program order. The names are the ones a profile
      shows for each kernel (chapter 08).
    """
    module = _as_module(hlo)
    owner = {i.name: c for c in module.computations.values() for i in c.instructions}
    costs = {}
    for instruction in _kernels(module):
        computation = owner[instruction.name]
        flops, transcendentals = _instruction_flops(module, computation, instruction)
        operand_bytes = sum(computation.by_name[name].nbytes for name in instruction.operands
                            if name in computation.by_name)
        costs[instruction.name] = OpCost(flops, transcendentals, operand_bytes + instruction.nbytes)
    return costs
