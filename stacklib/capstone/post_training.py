"""Stage 4: post-training with GRPO on chapter 13's arithmetic task (`stacklib.align`).

Runs only where `stacklib.align` is importable; `available()` says whether it is.
"""

from __future__ import annotations

import importlib.util


def available() -> bool:
    """Whether `stacklib.align` (chapter 13) is installed alongside this package."""
    return importlib.util.find_spec("stacklib.align") is not None
