"""A stand-in for `google.colab.output`: JAX imports it when it finds itself on Colab
(jax/_src/debugger/colab_lib.py). Everything asked of it is recorded, as by the package."""

from google.colab import _record


def __getattr__(name: str):
    _record("getattr", name=f"output.{name}")
    raise AttributeError(f"the google.colab.output stub has no attribute {name!r}")
