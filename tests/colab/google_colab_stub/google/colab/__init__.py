"""A stand-in for `google.colab`, for the simulated Colab runtime of tests/colab/simulate.py.

Colab's kernel loads `google.colab` as an IPython extension before the first cell runs, so a
notebook can tell it is on Colab (`"google.colab" in sys.modules`), and the real package
imports, among others, these packages that the book's stack shares. Importing the real
google-colab (colabtools at 3c07d77, 2026-04) into the TPU image's versions brought in numpy
(by `_reprs`), PIL, pyparsing and certifi (by httplib2) and ipywidgets (by `widgets`); so the
stub imports them too, and a notebook that upgrades them meets what a reader meets.

Everything asked of the stub is appended to $COLAB_STUB_LOG (one JSON object a line): that it
was loaded, with the file and modification time of every module imported at that moment (the
simulation checks after the setup cell that none of those files was replaced under the
running kernel), and every attribute anyone looks up on it (the stub has none: a setup that
needs Colab's APIs fails here, and the log says which). `google.colab.output` exists because
JAX imports it on Colab (jax/_src/debugger/colab_lib.py); it has nothing either.
"""

import json
import os
import sys
import time

import certifi  # noqa: F401
import ipywidgets  # noqa: F401
import numpy  # noqa: F401
import PIL  # noqa: F401
import pyparsing  # noqa: F401


def _record(event: str, **details) -> None:
    log = os.environ.get("COLAB_STUB_LOG")
    if log:
        with open(log, "a") as file:
            file.write(json.dumps({"event": event, "time": time.time(), **details}) + "\n")


def _imported_files() -> dict[str, list]:
    files = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and os.path.exists(path):
            files[name] = [path, os.stat(path).st_mtime]
    return files


def load_ipython_extension(ipython) -> None:
    """Called by IPython at kernel start (`--ext google.colab`), as Colab's kernel does."""
    _record("loaded", pid=os.getpid(), modules=_imported_files())


def __getattr__(name: str):
    _record("getattr", name=name)
    raise AttributeError(f"the google.colab stub has no attribute {name!r}")
