"""Which machine this is, how big each chapter's problems should be on it, and notebook setup.

Every chapter runs unchanged on a 2-core laptop CPU, a GPU, and a one-chip Colab TPU. It
does so by asking this module three questions instead of hard-coding anything:

* `describe()` — which backend, device kind and device count JAX sees;
* `sizes(problem)` — the problem sizes for this backend, read from the one table
  `PROBLEM_SIZES`, so that "small on CPU, real on TPU" is decided in a single place;
* `simulate_cpu_devices(n)` — n virtual CPU devices, for the sharding lessons on a
  machine that has one chip (or none).

It also owns the first code cell of every notebook (`setup_cell_source()`): on Colab or
Kaggle that cell installs `stacklib` from `REPOSITORY_URL` and calls `prepare_runtime()`,
which installs the locked stack once and restarts the runtime if it must (`stacklib.hw.hosted`
says how); anywhere else it does nothing, because the README's commands have installed
everything already. `colab_badge` and `kaggle_badge` are the links that open a notebook there.

JAX is imported inside the functions that need it, so that `import stacklib.hw` is
instant and never initialises a backend behind the reader's back (which would make
`simulate_cpu_devices` impossible afterwards).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import platform
import types

from stacklib.hw.glue import glue  # noqa: F401  (the chapters' figures, for their prose)

# Re-exported: the setup cell calls `hw.prepare_runtime()`, `make test-accelerator` calls
# `hw.install_accelerator_support()`.
from stacklib.hw.hosted import (  # noqa: F401
    accelerator_requirement,
    accelerator_runtime,
    hosted_runtime,
    install_accelerator_support,
    prepare_runtime,
)

# The repository's address lives here and nowhere else: the notebooks' setup cells and
# Colab badges are generated from it, and tests/test_notebooks.py checks them.
REPOSITORY_URL = "https://github.com/build-the-jax-ai-stack/book"
BRANCH = "main"

BACKENDS = ("cpu", "gpu", "tpu")
# A TPU runtime with 8 chips (Kaggle's v5e-8, a v4-8 or v6e-8 slice): the multi-device chapters
# (07, 16) have a row for it, where their mesh is real chips instead of simulated CPU devices.
# Every other problem runs its one-chip "tpu" row there.
MULTI_CHIP_TPU = "tpu-8"
ROWS = (*BACKENDS, MULTI_CHIP_TPU)

# The packages whose versions `describe()` reports (those installed).
STACK = ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "flax", "optax", "orbax-checkpoint", "grain", "qwix",
         "numpy")

# Problem sizes by backend, one row per problem. A chapter asks `sizes("name")` and
# gets the row for the backend it runs on. CPU rows keep every notebook within a
# couple of minutes on 2 cores (the CI budget); GPU/TPU rows do real work.
PROBLEM_SIZES: dict[str, dict[str, dict[str, int]]] = {
    # Chapter 00: a square matmul, timed to show what this machine can do.
    "matmul": {
        "cpu": {"n": 1024, "repeats": 5},
        "gpu": {"n": 8192, "repeats": 20},
        "tpu": {"n": 8192, "repeats": 20},
    },
    # Chapter 01: forward vs reverse mode as the input dimension grows to `max_dim`
    # (inputs x of size n, a hidden layer of `hidden` units), timed with our NumPy evaluator
    # (which runs on the host CPU on every backend).
    "transforms_cost": {
        "cpu": {"max_dim": 1024, "hidden": 32},
        "gpu": {"max_dim": 2048, "hidden": 64},
        "tpu": {"max_dim": 2048, "hidden": 64},
    },
    # Chapter 01: the gradient of an MLP loss, eager vs staged (NumPy) vs compiled by XLA.
    "transforms_mlp": {
        "cpu": {"batch": 32, "width": 32, "repeats": 20},
        "gpu": {"batch": 512, "width": 512, "repeats": 20},
        "tpu": {"batch": 512, "width": 512, "repeats": 20},
    },
    # Chapters 02-03: an MLP on scikit-learn's 8x8 digits (1797 images, fixed size), trained
    # for `steps` mini-batches; accelerators get a wider model and a longer run.
    "digits_mlp": {
        "cpu": {"hidden": 64, "batch_size": 128, "steps": 300},
        "gpu": {"hidden": 512, "batch_size": 256, "steps": 2000},
        "tpu": {"hidden": 512, "batch_size": 256, "steps": 2000},
    },
    # Chapter 11: quantizing the digits MLP: QAT fine-tuning and (Q)LoRA adapter steps, and the
    # size of the weight matrix whose quantization error is measured against the tile size.
    "quantization": {
        "cpu": {"qat_steps": 100, "lora_steps": 150, "matrix": 512},
        "gpu": {"qat_steps": 500, "lora_steps": 500, "matrix": 4096},
        "tpu": {"qat_steps": 500, "lora_steps": 500, "matrix": 4096},
    },
    # Chapter 03: optimizers' paths on a 2-D loss surface (cheap everywhere).
    "loss_surface": {
        "cpu": {"steps": 150, "grid": 200},
        "gpu": {"steps": 400, "grid": 400},
        "tpu": {"steps": 400, "grid": 400},
    },
    # Chapter 04: records through a CPU-heavy map (`work` loop iterations, ~1 ms per
    # 20k on a laptop core) with up to `max_workers` threads or worker processes.
    "pipeline_throughput": {
        "cpu": {"records": 300, "work": 20_000, "max_workers": 2},
        "gpu": {"records": 3000, "work": 20_000, "max_workers": 8},
        "tpu": {"records": 3000, "work": 20_000, "max_workers": 8},
    },
    # Chapter 04: linear regression on a pipeline with one corrupted record (one epoch).
    "loss_spike": {
        "cpu": {"records": 2048, "batch_size": 32, "features": 16},
        "gpu": {"records": 65536, "batch_size": 256, "features": 256},
        "tpu": {"records": 65536, "batch_size": 256, "features": 256},
    },
    # Chapter 05: the pytree saved to compare synchronous and asynchronous saves.
    "checkpoint_async": {
        "cpu": {"megabytes": 48, "repeats": 3},
        "gpu": {"megabytes": 1024, "repeats": 3},
        "tpu": {"megabytes": 1024, "repeats": 3},
    },
    # Chapter 05: the run that is killed mid-epoch and resumed (stacklib.examples).
    "resumable_training": {
        "cpu": {"records": 512, "batch_size": 32, "width": 64, "steps": 48, "save_every": 4},
        "gpu": {"records": 16384, "batch_size": 512, "width": 1024, "steps": 96, "save_every": 8},
        "tpu": {"records": 16384, "batch_size": 512, "width": 1024, "steps": 96, "save_every": 8},
    },
    # Chapter 06: a transformer block (batch, sequence, width, heads) whose programs we
    # read and count, and the length of the elementwise chain that shows what fusion saves.
    "compiler_block": {
        "cpu": {"batch": 8, "seq": 64, "d_model": 128, "heads": 4},
        "gpu": {"batch": 32, "seq": 512, "d_model": 1024, "heads": 16},
        "tpu": {"batch": 32, "seq": 512, "d_model": 1024, "heads": 16},
    },
    "compiler_fusion": {
        "cpu": {"n": 1 << 22, "repeats": 5},
        "gpu": {"n": 1 << 27, "repeats": 10},
        "tpu": {"n": 1 << 27, "repeats": 10},
    },
    # Chapter 07: the MLP trained with each sharding strategy on an 8-device mesh (on a
    # one-chip runtime the mesh is 8 simulated CPU devices, so accelerator rows stay modest).
    "sharded_mlp": {
        "cpu": {"batch": 256, "features": 32, "hidden": 256, "classes": 8, "steps": 25},
        "gpu": {"batch": 2048, "features": 128, "hidden": 1024, "classes": 16, "steps": 100},
        "tpu": {"batch": 2048, "features": 128, "hidden": 1024, "classes": 16, "steps": 100},
        "tpu-8": {"batch": 32768, "features": 1024, "hidden": 8192, "classes": 16, "steps": 200},
    },
    # Chapter 07: collective timings over per-device messages of 2**min_log2 .. 2**max_log2 bytes.
    "collective_sweep": {
        "cpu": {"min_log2": 12, "max_log2": 20, "repeats": 5},
        "gpu": {"min_log2": 12, "max_log2": 22, "repeats": 10},
        "tpu": {"min_log2": 12, "max_log2": 22, "repeats": 10},
        "tpu-8": {"min_log2": 12, "max_log2": 26, "repeats": 20},
    },
    # Chapter 08: the training step we profile, and the sizes that measure the peaks
    # (the matmul's n; the largest array, in MB, of the bandwidth sweep).
    "profile_step": {
        "cpu": {"batch": 16, "seq": 128, "d_model": 128, "heads": 4, "steps": 3},
        "gpu": {"batch": 32, "seq": 1024, "d_model": 1024, "heads": 16, "steps": 5},
        "tpu": {"batch": 32, "seq": 1024, "d_model": 1024, "heads": 16, "steps": 5},
    },
    "profile_peaks": {
        "cpu": {"matmul_n": 1024, "max_mb": 256, "repeats": 20},
        "gpu": {"matmul_n": 8192, "max_mb": 4096, "repeats": 20},
        "tpu": {"matmul_n": 8192, "max_mb": 4096, "repeats": 20},
    },
    # Chapter 09: the Pallas kernels' demo sizes. On CPU they run in the interpreter (a
    # grid step costs milliseconds), so grids stay small; on a TPU they compile natively.
    "pallas_matmul": {
        "cpu": {"m": 200, "n": 136, "k": 264, "block": 64},
        "gpu": {"m": 200, "n": 136, "k": 264, "block": 64},
        "tpu": {"m": 4096, "n": 4096, "k": 4096, "block": 512},
    },
    "pallas_attention": {
        "cpu": {"batch": 1, "seq": 200, "heads": 4, "kv_heads": 2, "head_dim": 32, "block": 64},
        "gpu": {"batch": 1, "seq": 200, "heads": 4, "kv_heads": 2, "head_dim": 32, "block": 64},
        "tpu": {"batch": 4, "seq": 4096, "heads": 16, "kv_heads": 4, "head_dim": 128, "block": 512},
    },
    # Chapter 10: temporary memory of plain vs chunked attention at sequence lengths
    # 2**min_log2 .. 2**max_log2 (compile-time numbers: nothing that large is allocated), and
    # the attention call the autotuner times (every candidate block size is compiled).
    "kernel_library_memory": {
        "cpu": {"min_log2": 10, "max_log2": 13, "heads": 4, "head_dim": 64},
        "gpu": {"min_log2": 10, "max_log2": 14, "heads": 8, "head_dim": 128},
        "tpu": {"min_log2": 10, "max_log2": 14, "heads": 8, "head_dim": 128},
    },
    "kernel_library_autotune": {
        "cpu": {"batch": 1, "seq": 1024, "heads": 2, "head_dim": 64, "repeats": 3},
        "gpu": {"batch": 4, "seq": 4096, "heads": 16, "head_dim": 128, "repeats": 10},
        "tpu": {"batch": 4, "seq": 4096, "heads": 16, "head_dim": 128, "repeats": 10},
    },
    # Chapter 12: the language model trained on the standard library's source (stacklib.llm
    # config overrides). CPU: ~0.15 M parameters in well under a minute; accelerators: ~25 M.
    "llm_train": {
        "cpu": {"d_model": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "d_ff": 192,
                "seq_len": 64, "batch_size": 16, "steps": 300, "checkpoint_every": 25},
        "gpu": {"d_model": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "head_dim": 64, "d_ff": 1536,
                "seq_len": 512, "batch_size": 64, "steps": 2000, "checkpoint_every": 250},
        "tpu": {"d_model": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "head_dim": 64, "d_ff": 1536,
                "seq_len": 512, "batch_size": 64, "steps": 2000, "checkpoint_every": 250},
    },
    # Chapter 13: the live parts of post-training, in steps (the SFT -> GRPO recipe itself lives
    # in stacklib.align.recipes, and its long runs are cached by stacklib.align.zoo). CPU: each
    # section trains for seconds; accelerators: long enough to converge.
    "post_training": {
        "cpu": {"sft_live_steps": 40, "lora_rank": 8, "lora_steps": 40, "dpo_steps": 50, "grpo_steps": 30,
                "grpo_eval_every": 5},
        "gpu": {"sft_live_steps": 200, "lora_rank": 8, "lora_steps": 800, "dpo_steps": 200, "grpo_steps": 100,
                "grpo_eval_every": 20},
        "tpu": {"sft_live_steps": 200, "lora_rank": 8, "lora_steps": 800, "dpo_steps": 200, "grpo_steps": 100,
                "grpo_eval_every": 20},
    },
    # Chapter 16: the capstone's own training run (stacklib.llm overrides, on a 2x2x2 mesh),
    # killed after `kill_after` steps and resumed; then the held-out batches it scores on
    # (50 MB of corpus is more than the whole standard library: all of it). The kill lands
    # between two local checkpoints, so that both tiers' lost work shows.
    "capstone": {
        "cpu": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "d_ff": 96,
                "seq_len": 32, "batch_size": 16, "steps": 24, "checkpoint_every": 8,
                "local_checkpoint_every": 4, "kill_after": 14,
                "max_corpus_bytes": 400_000, "eval_batches": 4},
        "gpu": {"d_model": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "head_dim": 64, "d_ff": 1536,
                "seq_len": 512, "batch_size": 64, "steps": 400, "checkpoint_every": 100,
                "local_checkpoint_every": 20, "kill_after": 250,
                "max_corpus_bytes": 50_000_000, "eval_batches": 8},
        "tpu": {"d_model": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "head_dim": 64, "d_ff": 1536,
                "seq_len": 512, "batch_size": 64, "steps": 400, "checkpoint_every": 100,
                "local_checkpoint_every": 20, "kill_after": 250,
                "max_corpus_bytes": 50_000_000, "eval_batches": 8},
        # ~104 M parameters on the real 2x2x2 mesh of 8 chips: 40 M tokens, ~3.5 passes over the corpus.
        "tpu-8": {"d_model": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 4, "head_dim": 64,
                  "d_ff": 3072, "seq_len": 1024, "batch_size": 64, "steps": 600, "checkpoint_every": 150,
                  "local_checkpoint_every": 25, "kill_after": 360,
                  "max_corpus_bytes": 50_000_000, "eval_batches": 8},
    },
    # Chapter 17: diffusion on the digits. The models come from stacklib.diffusion.zoo (trained
    # once, on CPU, everywhere); these are the samples judged per setting, the sampler steps, and
    # the live training run that shows each objective's loss going down.
    "diffusion": {
        "cpu": {"samples": 200, "euler_steps": 16, "ddim_steps": 20, "ddpm_steps": 50, "live_steps": 60,
                "live_batch": 32, "live_width": 16},
        "gpu": {"samples": 2000, "euler_steps": 50, "ddim_steps": 50, "ddpm_steps": 250, "live_steps": 1500,
                "live_batch": 256, "live_width": 64},
        "tpu": {"samples": 2000, "euler_steps": 50, "ddim_steps": 50, "ddpm_steps": 250, "live_steps": 1500,
                "live_batch": 256, "live_width": 64},
    },
}


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What JAX sees on this machine."""

    backend: str  # 'cpu', 'gpu' or 'tpu'
    device_kind: str  # e.g. 'cpu', 'NVIDIA H100 80GB HBM3', 'TPU v5 lite'
    device_count: int  # devices visible to this process
    process_count: int  # > 1 only under jax.distributed
    jax_version: str
    python_version: str
    runtime: str  # 'colab', 'kaggle' or 'local'
    stack: str  # the installed versions of STACK, e.g. 'jax 0.10.2, jaxlib 0.10.2, flax 0.12.8, ...'

    def __str__(self) -> str:
        rows = [(field.name, getattr(self, field.name)) for field in dataclasses.fields(self)]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def stack_versions() -> str:
    """The installed versions of the packages in `STACK`, as one line."""
    versions = []
    for name in STACK:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(versions)


def describe() -> Hardware:
    """Return what JAX sees (backend, device kind and counts) and the stack's versions (starts JAX)."""
    import jax

    devices = jax.devices()
    return Hardware(
        backend=jax.default_backend(),
        device_kind=devices[0].device_kind,
        device_count=len(devices),
        process_count=jax.process_count(),
        jax_version=jax.__version__,
        python_version=platform.python_version(),
        runtime=hosted_runtime() or "local",
        stack=stack_versions(),
    )


def sizes(problem: str, backend: str | None = None) -> types.SimpleNamespace:
    """Return the sizes of `problem` for `backend` (default: the machine JAX runs on).

    Example: `sizes("matmul").n` is 1024 on a CPU and 8192 on a GPU or TPU.

    The default is JAX's backend, and `MULTI_CHIP_TPU` ('tpu-8') on a TPU runtime with 8 or
    more chips. A problem without a row for 8 chips gets its one-chip 'tpu' row there.

    Raises:
      KeyError: `problem` is not a row of `PROBLEM_SIZES`; the message lists the rows.
      ValueError: `backend` is not one of 'cpu', 'gpu', 'tpu', 'tpu-8'.
    """
    if problem not in PROBLEM_SIZES:
        known = ", ".join(sorted(PROBLEM_SIZES))
        raise KeyError(
            f"No problem sizes for {problem!r}. Known problems: {known}. "
            f"Add a row to stacklib.hw.PROBLEM_SIZES for a new one."
        )
    if backend is None:
        import jax

        backend = jax.default_backend()
        if backend == "tpu" and jax.device_count() >= 8:
            backend = MULTI_CHIP_TPU
    if backend not in ROWS:
        raise ValueError(
            f"Unknown backend {backend!r}; expected one of {ROWS}. "
            "Pass backend='cpu', 'gpu', 'tpu' or 'tpu-8' explicitly."
        )
    rows = PROBLEM_SIZES[problem]
    return types.SimpleNamespace(**rows.get(backend, rows["tpu"]))


def simulate_cpu_devices(count: int = 8) -> list:
    """Make JAX expose `count` CPU devices, for multi-device lessons on one machine.

    XLA can split the host CPU into several virtual devices. Collectives between them
    are real (they run through the same runtime as on a pod), only slower, which is
    what makes sharding teachable on a laptop. On a one-chip TPU the simulated devices
    are the CPU ones: pass `jax.devices("cpu")` to the mesh.

    This must run before JAX executes anything, because the CPU backend fixes its
    device count when it starts.

    Returns:
      The list of CPU devices (`jax.devices("cpu")`), `count` long.

    Raises:
      ValueError: `count` is not a positive integer.
      RuntimeError: JAX already started with a different number of CPU devices.
    """
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive integer, got {count!r}.")
    import jax
    from jax._src import xla_bridge  # NB: no public API says whether backends started.

    if xla_bridge.backends_are_initialized():
        current = len(jax.devices("cpu"))
        if current != count:
            raise RuntimeError(
                f"JAX has already started with {current} CPU device(s), so it cannot "
                f"switch to {count}. Restart the kernel and call "
                f"stacklib.hw.simulate_cpu_devices({count}) before any other JAX operation."
            )
    else:
        jax.config.update("jax_num_cpu_devices", count)
    return jax.devices("cpu")


def setup_cell_source() -> str:
    """The first code cell of every notebook (tests check that each notebook has it).

    Before `stacklib` is installed nothing of it can run, so the cell itself tests for a hosted
    runtime (as `hosted_runtime()` does) and installs the package alone; `prepare_runtime()`
    then installs the locked stack it ships with.
    """
    return (
        "# Setup. On Colab or Kaggle this installs the book's locked stack once (a few minutes; the\n"
        "# runtime then restarts: run the notebook again from the top). Anywhere else it does nothing.\n"
        "import importlib.util\n"
        "import os\n"
        "import sys\n"
        "\n"
        'if "google.colab" in sys.modules or "KAGGLE_KERNEL_RUN_TYPE" in os.environ:\n'
        '    if importlib.util.find_spec("stacklib") is None:\n'
        f'        %pip install --quiet --no-deps "stacklib @ git+{REPOSITORY_URL}@{BRANCH}"\n'
        "    from stacklib import hw\n"
        "\n"
        "    hw.prepare_runtime()"
    )


def colab_url(notebook_path: str) -> str:
    """The Colab address that opens `notebook_path` (relative to the repository root)."""
    github = REPOSITORY_URL.removeprefix("https://github.com/")
    return f"https://colab.research.google.com/github/{github}/blob/{BRANCH}/{notebook_path}"


def colab_badge(notebook_path: str) -> str:
    """The Markdown "Open in Colab" badge that each notebook shows under its title."""
    image = "https://colab.research.google.com/assets/colab-badge.svg"
    return f"[![Open in Colab]({image})]({colab_url(notebook_path)})"


# The notebooks that get a Kaggle badge beside the Colab one: Kaggle's v5e-8 has 8 TPU chips,
# where these chapters' meshes are real (Colab's free TPU is one chip).
KAGGLE_NOTEBOOKS = ("chapters/07_scaling_out.ipynb", "chapters/16_capstone.ipynb")


def kaggle_url(notebook_path: str) -> str:
    """The Kaggle address that imports `notebook_path` from the repository into a new notebook."""
    return f"https://kaggle.com/kernels/welcome?src={REPOSITORY_URL}/blob/{BRANCH}/{notebook_path}"


def kaggle_badge(notebook_path: str) -> str:
    """The Markdown "Open in Kaggle" badge, shown beside the Colab one in `KAGGLE_NOTEBOOKS`."""
    image = "https://kaggle.com/static/images/open-in-kaggle.svg"
    return f"[![Open in Kaggle]({image})]({kaggle_url(notebook_path)})"
