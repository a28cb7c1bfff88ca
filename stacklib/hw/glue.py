"""`glue`: hand a figure the notebook computed to the chapter's prose.

A chapter's Markdown never types a measured number: the code cell that computes it calls
`glue("name", value)`, and the sentence that states it says `` {glue:text}`name:.1f` ``.
When Jupyter Book builds the book, MyST-NB replaces the role with the value this run
computed, so the prose and the code cannot disagree.

MyST-NB is installed with the book's tools (`make book`, `make test`), not on Colab or
Kaggle, where the reader runs the notebook without building a book. There `glue` shows
the value under the cell instead (or nothing, with `display=False`, as in the book), so a
notebook runs the same everywhere.
"""

from __future__ import annotations

from typing import Any


def glue(name: str, value: Any, display: bool = True) -> Any:
    """Record `value` under `name` for the prose's `{glue:...}` roles; return `value`.

    Args:
      name: the key the Markdown names, e.g. `` {glue:text}`speedup:.2f` ``. Unique within a chapter.
      value: a number, a string, or anything IPython can display (a figure).
      display: also show the value under the cell (MyST-NB's `display`); the book hides it with False.

    Returns:
      `value` (a NumPy or JAX scalar as the Python number), so a cell can write
      `speedup = glue("speedup", fast / slow)`.
    """
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"glue name {name!r}: use letters, digits, '_' and '-', as MyST roles need")
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        # A NumPy or JAX scalar prints as `np.float64(0.5)` or `Array(0.5, ...)`, which a role's
        # format spec (`{glue:text}`name:.1f``) cannot read back; the Python number prints as 0.5.
        value = value.item()
    try:
        from myst_nb import glue as myst_glue
    except ImportError:  # a hosted notebook without the book's tools
        if display:
            from IPython.display import display as show

            show(value)
        return value
    myst_glue(name, value, display=display)
    return value
