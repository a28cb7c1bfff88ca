"""Which collectives a compiled program runs, and how many bytes each moves, read from its HLO.

Mirrors no public API: it reads the text of `jax.jit(f).lower(...).compile().as_text()`,
where XLA writes the collectives its SPMD partitioner inserted, e.g.

    %all-gather.1 = f32[256,10]{1,0} all-gather(%param.4), ..., replica_groups=[1,8]<=[8], ...
    %all-reduce.5 = (f32[256]{0}, f32[10]{0}) all-reduce(%a, %b), ..., replica_groups={{0,1,2,3}}

so a chapter can check that a sharding strategy communicates what the cost model
predicts, without a profiler. Each collective is reported with `num_bytes` in the
convention of `stacklib.parallel.costs`:

  * all-gather: the gathered result (what each device holds afterwards);
  * all-reduce: the array reduced (tuples, which XLA makes by combining several
    all-reduces into one, count all their elements);
  * reduce-scatter: the array before scattering (result x group size);
  * all-to-all: the whole array (result x group size);
  * collective-permute: the block each device sends.

Differences from what XLA does:
  * A text parser of one HLO dialect (the pinned XLA's); it recognises the
    synchronous ops and their `-start` async forms, and ignores `-done` halves.
  * The group size is read from `replica_groups` in its explicit (`{{0,1},{2,3}}`),
    iota (`[4,2]<=[8]`) and mesh (`mesh['x'=4,'y'=2] {'y'}`) forms; an empty group
    list means all `num_partitions` devices.
"""

from __future__ import annotations

import dataclasses
import math
import re

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

# Bytes per element of the HLO element types that appear in practice.
_ELEMENT_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+(?P<op>" + "|".join(KINDS) + r")(?P<start>-start)?\("
)
# Explicit {{0,1},{2,3}}, iota [4,2]<=[8] (optionally transposed), or mesh['x'=4,'y'=2] {'y'}.
_REPLICA_GROUPS = re.compile(
    r"replica_groups=(\{[{}0-9, ]*\}|\[[0-9,]+\]<=\[[0-9,]+\]\S*|mesh\[[^\]]*\]\s*\{[^}]*\})"
)
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[(?P<dims>[0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program."""

    kind: str  # one of KINDS
    num_bytes: int  # see the module docstring for what is counted
    group_size: int  # devices that take part together (1 for collective-permute)
    line: str  # the HLO instruction, for the curious


def _element_bytes(dtype: str) -> int:
    if dtype.startswith("f8"):
        return 1
    if dtype not in _ELEMENT_BYTES:
        raise ValueError(f"Unknown HLO element type {dtype!r}; add it to _ELEMENT_BYTES.")
    return _ELEMENT_BYTES[dtype]


def _array_bytes(shape_text: str) -> list[int]:
    """Bytes of every array in an HLO shape such as `(f32[2,3]{1,0}, bf16[4]{0})`."""
    sizes = []
    for match in _ARRAY.finditer(shape_text):
        dims = [int(d) for d in match["dims"].split(",") if d]
        sizes.append(math.prod(dims) * _element_bytes(match["dtype"]))
    return sizes


def _group_size(line: str, num_partitions: int) -> int:
    groups = _REPLICA_GROUPS.search(line)
    if groups is None:
        return num_partitions
    text = groups.group(1)
    if text.startswith("mesh["):
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", text))
        chosen = re.findall(r"'([^']+)'", text[text.index("]"):])
        return math.prod(int(sizes[axis]) for axis in chosen)
    if text.startswith("["):
        shape = [int(d) for d in text[1:text.index("]")].split(",")]
        return shape[-1]
    first = re.search(r"\{([0-9, ]+)\}", text)
    return num_partitions if first is None else len(first.group(1).split(","))


def collectives(hlo_text: str) -> list[Collective]:
    """The collectives of a compiled HLO module, in program order.

    Args:
      hlo_text: `jax.jit(f).lower(*args).compile().as_text()`.

    Returns:
      One `Collective` per collective instruction (an async pair counts once).
    """
    header = re.search(r"num_partitions=(\d+)", hlo_text)
    num_partitions = int(header.group(1)) if header else 1
    found = []
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        kind = match["op"]
        sizes = _array_bytes(match["shape"])
        if match["start"] and kind in ("all-gather", "collective-permute", "all-to-all"):
            sizes = sizes[1:2]  # the async start returns (operand, result, ...): keep the result
        group = 1 if kind == "collective-permute" else _group_size(line, num_partitions)
        num_bytes = sum(sizes)
        if kind in ("reduce-scatter", "all-to-all"):
            num_bytes *= group
        found.append(Collective(kind, num_bytes, group, line.strip()))
    return found


def bytes_by_kind(found: list[Collective]) -> dict[str, int]:
    """Total `num_bytes` per collective kind, for the kinds that occur."""
    totals: dict[str, int] = {}
    for collective in found:
        totals[collective.kind] = totals.get(collective.kind, 0) + collective.num_bytes
    return totals
