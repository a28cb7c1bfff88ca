"""Looking inside XLA: what a program costs, what the compiler fused, and when it recompiles.

Chapter 06 follows a JAX function down the compiler: jaxpr → StableHLO → optimized HLO.
This package holds the tools the chapter builds and later chapters reuse:

* `cost_analysis(fn, *args)` — FLOPs, transcendentals and bytes counted from the jaxpr
  with XLA's rules (`cost.py`); compare `jax.jit(fn).lower(*args).cost_analysis()`;
* `parse_hlo`, `fusions`, `count_fusions`, `op_costs` — read the optimized HLO text:
  which kernels XLA launches, what each fused, what each costs (`hlo.py`), and
  `DEFAULT_CPU_PIPELINE`, the compiler options that give that text XLA's default fusions;
* `CompileWatcher`, `track_compiles` — count compilations and explain recompiles
  (`recompile.py`); compare `jax.jit(f)._cache_size()` and `jax_explain_cache_misses`.

Differences from XLA and JAX are listed in each file's docstring. In short: our counts
come from the jaxpr or the HLO text, not from XLA's C++ cost model, and agree with it to
the tolerances the tests state (exactly on most programs, within 1% on matmul-heavy ones).
"""

from stacklib.compile.cost import Cost, cost_analysis, jaxpr_cost
from stacklib.compile.hlo import (
    DEFAULT_CPU_PIPELINE,
    Fusion,
    HloComputation,
    HloInstruction,
    HloModule,
    OpCost,
    count_fusions,
    fusions,
    op_costs,
    parse_hlo,
)
from stacklib.compile.recompile import (
    Compilation,
    CompileEvent,
    CompileWatcher,
    TrackedFunction,
    track_compiles,
)

__all__ = [
    "Compilation",
    "CompileEvent",
    "CompileWatcher",
    "Cost",
    "DEFAULT_CPU_PIPELINE",
    "Fusion",
    "HloComputation",
    "HloInstruction",
    "HloModule",
    "OpCost",
    "TrackedFunction",
    "cost_analysis",
    "count_fusions",
    "fusions",
    "jaxpr_cost",
    "op_costs",
    "parse_hlo",
    "track_compiles",
]
