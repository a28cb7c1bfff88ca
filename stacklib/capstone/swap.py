"""The swap matrix: one training program, each component ours or the real library's, by a flag.

The book's drop-in principle says `import stacklib.optim as optax` and `import optax` run
the same program. This file is that program, written once against the libraries' shared
names (`grain.MapDataset`, `nnx.merge`, `optax.chain`, `ocp.CheckpointManager`,
`qwix.quantize_model`), with a `Stack` saying which library plays each part:

    losses = run(config, Stack(optimizer="optax")).losses    # ours everywhere but the optimizer

What the program does, and which component each step exercises:

1. data: the chapter-12 records in a shuffled, repeated, batched pipeline (`grain`);
2. modules: the chapter-12 Transformer, or its flax twin (stacklib/llm/twin.py) holding
   the same initial weights, copied key by key (`nnx`);
3. optimizer: chapter 12's clip + AdamW on warmup-cosine, from `optax`;
4. checkpoint: half way, the parameters, optimizer state and iterator state are saved,
   a fresh manager restores them, and training continues from what was restored (`ocp`);
5. quantization: the trained weights, int8 per channel by PTQ, scored on held-out
   batches (`qwix`).

What agrees, and why:

* data (grain), checkpoint (orbax): bitwise. Grain's shuffle is a deterministic function
  of the seed and the index, and ours computes the same function (chapter 04); a
  checkpoint restores the exact bytes (chapter 05). The losses are equal with `==`.
* optimizer (optax): bitwise here as well, where our update rules evaluate the same
  float32 expressions in the same order; the comparison allows float32 rounding
  (`rtol=1e-5`) because nothing in optax promises its order of operations.
* modules (flax.nnx): float32 tolerance. The twin's attention is
  `jax.nn.dot_product_attention`, ours a grouped einsum, so XLA rounds differently
  (~1e-7 relative per step, growing slowly over steps).
* quantization (qwix): qwix quantizes flax modules only, so the program hands it the
  same trained weights in the flax twin. The int8 values and scales are compared
  exactly; the quantized models' held-out losses within float32 tolerance (the
  contractions that stay float round as in the modules row).

Random streams never have to agree: the only randomness is the initial parameters,
which the twin copies from ours rather than drawing from flax's own `Rngs`.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stacklib import profile
from stacklib.llm import data as llm_data
from stacklib.llm import train, twin
from stacklib.llm.config import Config

COMPONENTS = ("data", "modules", "optimizer", "checkpoint", "quantization")
REAL = {"data": "grain", "modules": "flax", "optimizer": "optax", "checkpoint": "orbax",
        "quantization": "qwix"}


@dataclasses.dataclass(frozen=True)
class Stack:
    """Which library plays each part: "ours" or the real library's name (see `REAL`)."""

    data: str = "ours"
    modules: str = "ours"
    optimizer: str = "ours"
    checkpoint: str = "ours"
    quantization: str = "ours"

    def __post_init__(self):
        for component in COMPONENTS:
            choice = getattr(self, component)
            if choice not in ("ours", REAL[component]):
                raise ValueError(f"Stack({component}={choice!r}): choose 'ours' or {REAL[component]!r}.")

    @classmethod
    def real(cls, *components: str) -> Stack:
        """Ours everywhere except `components` (default: every component real)."""
        return cls(**{c: REAL[c] for c in (components or COMPONENTS)})

    def libraries(self) -> types.SimpleNamespace:
        """The modules the program calls, under the real libraries' names."""
        if self.data == "ours":
            import stacklib.data as grain
        else:
            import grain
        if self.modules == "ours":
            import stacklib.nn as nnx
        else:
            from flax import nnx
        if self.optimizer == "ours":
            import stacklib.optim as optax
        else:
            import optax
        if self.checkpoint == "ours":
            import stacklib.checkpoint as ocp
        else:
            import orbax.checkpoint as ocp
        if self.quantization == "ours":
            import stacklib.nn as quant_nnx
            import stacklib.quant as qwix
        else:
            import qwix
            from flax import nnx as quant_nnx
        return types.SimpleNamespace(grain=grain, nnx=nnx, optax=optax, ocp=ocp, qwix=qwix,
                                     quant_nnx=quant_nnx)

    def label(self) -> str:
        real = [getattr(self, c) for c in COMPONENTS if getattr(self, c) != "ours"]
        return " + ".join(real) if real else "ours"


@dataclasses.dataclass
class SwapRun:
    """What one run of the program gives: its losses, timings and the quantized model's numbers."""

    stack: Stack
    losses: list[float]  # training loss of each step
    step_seconds: list[float]  # wall times of 10 timed calls of the compiled step, after training
    restored_at: int  # the step the run was checkpointed at and restored from
    params: dict  # the trained weights, a pure dict
    quantized_loss: float  # held-out loss of the int8 PTQ model
    float_loss: float  # held-out loss of the trained float model
    int8_weights: dict  # module path -> (int8 values, scales) of the quantized kernels

    @property
    def step_time(self) -> float:
        """Median time of one compiled step."""
        return float(np.median(self.step_seconds))


def make_dataset(config: Config, grain: Any):
    """Chapter 12's pipeline (stacklib/llm/data.py `train_dataset`) written against `grain`."""
    records = llm_data.PackedSequences(llm_data.streams(config)[0], config.seq_len)
    dataset = (grain.MapDataset.source(records).shuffle(seed=config.data_seed).repeat()
               .batch(config.batch_size, drop_remainder=True))
    return dataset.to_iter_dataset(grain.ReadOptions(num_threads=0))


def make_model(config: Config, nnx: Any):
    """(graphdef, params): our Transformer, or the flax twin holding our initial weights."""
    import stacklib.nn

    graphdef, params = stacklib.nn.split(train.make_model(config), stacklib.nn.Param)
    if nnx is stacklib.nn:
        return graphdef, params
    return twin.copy_params(params, config)  # the same initial weights, key by key


def load_weights(config: Config, nnx: Any, weights: dict):
    """A model of `nnx`'s kind (ours or the twin) holding `weights` (a pure dict)."""
    import stacklib.nn

    if nnx is stacklib.nn:
        model = train.make_model(config)
    else:
        model = twin.Transformer(config, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(params, jax.tree.map(jnp.asarray, weights))
    nnx.update(model, params)
    return model


def checkpoint_round_trip(ocp: Any, directory: pathlib.Path, step: int, state: dict, iterator_state: dict):
    """Save `state` and the iterator's state at `step`, then restore both with a fresh manager."""
    options = ocp.CheckpointManagerOptions(max_to_keep=1)
    with ocp.CheckpointManager(directory, options=options) as manager:
        manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                   data=ocp.args.JsonSave(iterator_state)))
        manager.wait_until_finished()
    with ocp.CheckpointManager(directory, options=options) as manager:
        target = jax.tree.map(np.zeros_like, state)  # the structure to restore into, values unused
        restored = manager.restore(manager.latest_step(), args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
    return restored.state, restored.data


def ptq_rules(qwix: Any) -> list:
    """int8 weights, one scale per output channel, for every layer (activations stay float)."""
    return [qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.int8)]


def int8_weights(quantized_model, nnx: Any) -> dict:
    """kernel path -> (int8 values, scales) of every quantized weight of a PTQ model.

    Ours keeps a `QArray` where the kernel was; qwix a `WithAux` holding one under `array`.
    Both flatten to leaves named `.../kernel/.../qvalue` and `.../scale`, which is all we read.
    """
    leaves = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(quantized_model)):
        names = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
        names = [n for n in names if n not in ("value", "array", ".value")]
        leaves["/".join(names)] = np.asarray(leaf)
    return {path.removesuffix("/qvalue"): (values, leaves[path.removesuffix("qvalue") + "scale"])
            for path, values in leaves.items() if path.endswith("/qvalue")}


def heldout_loss(model, batches: list[np.ndarray], optax: Any) -> float:
    """Mean next-token loss (nats per byte) of `model` on held-out batches."""
    losses = [optax.softmax_cross_entropy_with_integer_labels(model(b[:, :-1]), b[:, 1:]).mean()
              for b in batches]
    return float(np.mean(losses))


def run(config: Config, stack: Stack = Stack(), *, workdir: str | pathlib.Path | None = None) -> SwapRun:
    """Train `config.steps` steps with `stack`'s libraries, checkpointing half way; then PTQ.

    Args:
      config: the run (chapter 12's Config); `steps` >= 2.
      stack: which library plays each part.
      workdir: where the checkpoint goes (default: a temporary directory, removed after).

    Returns:
      A `SwapRun`.
    """
    lib = stack.libraries()
    iterator = iter(make_dataset(config, lib.grain))
    graphdef, params = make_model(config, lib.nnx)
    tx = train.make_optimizer(config, optax_module=lib.optax)
    opt_state = tx.init(params)
    step_fn = twin.jitted_step(graphdef, tx, lib.nnx, lib.optax)
    restored_at = config.steps // 2
    losses = []
    with tempfile.TemporaryDirectory(dir=workdir) as scratch:
        for step in range(1, config.steps + 1):
            params, opt_state, loss = step_fn(params, opt_state, next(iterator))
            losses.append(float(loss))  # waits for the step
            if step == restored_at:
                state, iterator_state = checkpoint_round_trip(
                    lib.ocp, pathlib.Path(scratch) / "checkpoints", step,
                    {"params": params, "opt_state": opt_state}, iterator.get_state())
                params, opt_state = state["params"], state["opt_state"]
                iterator = iter(make_dataset(config, lib.grain))
                iterator.set_state(iterator_state)
    # Timed apart from training: the loop's own step times mix in checkpointing and the first
    # call's compilation, and the first run in a process pays JAX's one-time start-up costs.
    seconds = list(profile.time_fn(step_fn, params, opt_state, next(iterator), repeats=10).seconds)
    weights = jax.tree.map(np.asarray, lib.nnx.to_pure_dict(params))
    batches = llm_data.heldout_batches(config)
    model = load_weights(config, lib.quant_nnx, weights)
    quantized = lib.qwix.quantize_model(model, lib.qwix.PtqProvider(ptq_rules(lib.qwix)), batches[0][:, :-1])
    return SwapRun(stack, losses, seconds, restored_at, weights,
                   quantized_loss=heldout_loss(quantized, batches, lib.optax),
                   float_loss=heldout_loss(model, batches, lib.optax),
                   int8_weights=int8_weights(quantized, lib.quant_nnx))


# -- the matrix ---------------------------------------------------------------------------------

# How closely each swap must agree with ours, and why (see the module docstring): 0 means
# bitwise; otherwise a relative float32 tolerance on each step's loss.
TOLERANCE = {"data": 0.0, "checkpoint": 0.0, "quantization": 0.0,
             "optimizer": 1e-5,  # optax promises no order of operations; measured: bitwise
             "modules": 2e-5,  # another attention implementation; as tests/test_llm_parity.py
             "all": 2e-5}


@dataclasses.dataclass
class SwapRow:
    """One row of the swap table: a component swapped for the real library, against ours."""

    component: str  # a name from COMPONENTS, or "all" (every component real at once)
    library: str  # what replaced ours
    steps: int
    max_loss_difference: float  # over the training steps, absolute
    bitwise: bool  # the training losses equal with ==
    quantized_loss_difference: float  # held-out loss of the int8 model, absolute
    int8_equal: bool  # the int8 values and scales equal exactly
    step_time_ratio: float  # the real library's median step time / ours (printed, never asserted)
    tolerance: float  # the agreement promised (0: bitwise)
    agrees: bool  # the losses agree as promised


def compare(component: str, ours: SwapRun, theirs: SwapRun) -> SwapRow:
    """The row comparing a run with a swapped component to the run with ours."""
    difference = float(np.max(np.abs(np.subtract(ours.losses, theirs.losses))))
    int8_equal = ours.int8_weights.keys() == theirs.int8_weights.keys() and all(
        np.array_equal(a, b) for key in ours.int8_weights
        for a, b in zip(ours.int8_weights[key], theirs.int8_weights[key], strict=True))
    return SwapRow(component, theirs.stack.label(), len(ours.losses), difference,
                   ours.losses == theirs.losses,
                   abs(ours.quantized_loss - theirs.quantized_loss), int8_equal,
                   theirs.step_time / ours.step_time, TOLERANCE[component],
                   agrees=bool(np.allclose(theirs.losses, ours.losses, rtol=TOLERANCE[component], atol=0)))


def swap_matrix(config: Config, components=(*COMPONENTS, "all"), *, progress: bool = False
                ) -> tuple[SwapRun, list[SwapRow]]:
    """Run the program with ours, then once per component with the real library swapped in.

    Returns:
      (the run with ours, one `SwapRow` per component; "all" swaps every component at once).
    """
    stacks = [Stack.real() if c == "all" else Stack.real(c) for c in components]
    if progress:
        from tqdm.auto import tqdm

        stacks = tqdm(stacks, desc="swap matrix", unit="run")
    ours = run(config, Stack())
    return ours, [compare(c, ours, run(config, stack)) for c, stack in zip(components, stacks, strict=True)]


def format_table(rows: list[SwapRow]) -> str:
    """The swap table in Markdown."""
    lines = ["| component | swapped in | steps | max abs Δ loss | bitwise | promised | Δ int8-PTQ loss "
             "| int8 weights equal | step time (real / ours) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        promised = "bitwise" if r.tolerance == 0 else f"rtol {r.tolerance:g}"
        lines.append(f"| {r.component} | {r.library} | {r.steps} | {r.max_loss_difference:.1e} | "
                     f"{'yes' if r.bitwise else 'no'} | {promised} | {r.quantized_loss_difference:.1e} | "
                     f"{'yes' if r.int8_equal else 'no'} | {r.step_time_ratio:.2f} |")
    return "\n".join(lines)
