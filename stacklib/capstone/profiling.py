"""Stage 3: a profile of one training step: the op table, MFU, and where the time goes.

The trained run's step is compiled again (without buffer donation, so the same inputs can
be fed repeatedly), timed with `profile.time_fn`, and captured with `profile.trace`
(chapter 08). Each op of the trace is then looked up in the step's optimized HLO
(`stacklib.compile`, chapter 06) and put in one of four groups, which answer "where does
the time go" at a glance:

* matmul: a kernel that contains a `dot` or `convolution` (the model's FLOPs live here);
* collective: an all-reduce, all-gather, reduce-scatter, all-to-all or collective-permute
  (the cost of sharding over the mesh; on simulated CPU devices these are memory copies);
* elementwise: every other fused kernel (norms, softmax, the optimizer's update, casts);
* data movement: copies, transposes, slices and the like outside fusions.

MFU is chapter 12's: the step's FLOPs counted from its jaxpr, over the median step
time times the measured matmul peak.

Differences from XProf's op profile: the groups are ours (XProf groups by HLO category);
the whole step's time is summed over all devices' threads, so on 8 simulated CPU
devices the table's total is about 8 times the wall time of a step.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile

import jax

from stacklib import compile as compile_tools
from stacklib import profile
from stacklib.llm import data, train
from stacklib.llm.config import Config

GROUPS = ("matmul", "collective", "elementwise", "data movement")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_MATMULS = ("dot", "convolution")


@dataclasses.dataclass
class StepProfile:
    """What stage 3 measured."""

    module: str  # the step's HLO module name
    steps: int  # executions captured
    table: list[profile.OpStat]  # per op, largest first
    groups: dict[str, float]  # share of op time per group (sums to 1)
    step_seconds: float  # median wall time of one step
    flops: float  # of one step, counted from its jaxpr
    peak_flops: float  # the measured matmul peak
    mfu: float


def op_groups(compiled) -> dict[str, str]:
    """Instruction name -> group (see `GROUPS`) for every kernel of the compiled step."""
    module = compile_tools.parse_hlo(compiled.as_text())
    fused = {f.name: f.opcodes for f in compile_tools.fusions(module)}
    groups = {}
    for computation in module.computations.values():
        for instruction in computation.instructions:
            opcodes = fused.get(instruction.name, (instruction.opcode,))
            if any(op.startswith(_COLLECTIVES) for op in opcodes):
                groups[instruction.name] = "collective"
            elif any(op in _MATMULS for op in opcodes) or instruction.opcode == "custom-call":
                groups[instruction.name] = "matmul"
            elif instruction.name in fused:
                groups[instruction.name] = "elementwise"
            else:
                groups[instruction.name] = "data movement"
    return groups


def profile_step(result: train.TrainResult, *, repeats: int = 5, log_dir: str | None = None) -> StepProfile:
    """Time and trace `repeats` steps of `result`'s train step on its mesh."""
    config: Config = result.config
    tx = train.make_optimizer(config)
    params = result.params
    opt_state = tx.init(params)
    step = train.compile_step(config, result.graphdef, params, opt_state, tx, donate=False)
    params, opt_state = step.place(params, opt_state)
    batch = jax.device_put(next(iter(data.train_dataset(config))), step.batch_sharding)
    timing = profile.time_fn(step, params, opt_state, batch, repeats=repeats)
    log_dir = log_dir or tempfile.mkdtemp(prefix="capstone-profile-")
    with profile.trace(pathlib.Path(log_dir)) as files:
        for _ in range(repeats):
            jax.block_until_ready(step(params, opt_state, batch))
    module = compile_tools.parse_hlo(step.compiled.as_text()).name
    events = [e for e in profile.load_trace(files.perfetto_json) if e.module == module]
    kinds = op_groups(step.compiled)
    by_group = profile.op_table(events, key=lambda e: kinds.get(e.name, "data movement"))
    groups = {g: 0.0 for g in GROUPS} | {row.key: row.fraction for row in by_group}
    flops = train.step_flops(config, result.graphdef, params, opt_state, tx)
    mfu = profile.mfu(flops, timing.median, result.peak_flops)
    return StepProfile(module, profile.runs(events, module=module), profile.op_table(events), groups,
                       timing.median, flops, result.peak_flops, mfu)
