"""stacklib: a small, readable version of each component of the JAX AI stack.

Each module mirrors a documented subset of a real library's API (see its docstring for
the subset and the differences), so the same user code runs against both:

    import optax                      # the real library
    import stacklib.optim as optax    # ours

Layers (a module imports only from layers below it):
  0  hw, grading, transforms, flat_config
  1  nn, optim, data, checkpoint, compile, profile, http
  2  parallel, kernels, quant
  3  llm, diffusion
  4  align, infer, serve
  5  capstone, examples
`examples` holds whole programs that combine components, such as chapter 05's resumable
run; like the capstone, nothing in stacklib imports them. On top of them all, like the
tests, sit `cases` (the exercises' grading cases, which the grader loads by id): they may
import anything, and nothing in stacklib imports them.
"""

__version__ = "0.1.0"
