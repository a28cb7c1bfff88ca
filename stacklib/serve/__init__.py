"""Exporting and serving: `jax.export` artifacts and a model server with dynamic batching.

    import stacklib.serve as serve

    serve.export(predict, params, (x,), "models/digits/1")    # traced once, symbolic batch
    model = serve.load("models/digits/1")                      # no model code, no flax
    logits = model(x)                                          # any batch size

    python -m stacklib.serve --model-dir models/               # the HTTP server

The pieces, one file each:

  artifact.py    export / verify / load: program + weights + manifest with SHA-256 hashes
  batching.py    DynamicBatcher: requests from many clients padded into one call
  repository.py  models/<name>/<version>/ scanned while serving; a broken version never
                 replaces a working one
  server.py      the HTTP endpoints (predict, status, health, metrics) on `stacklib.http`

Importing this package imports JAX and NumPy only (the server's FastAPI is imported by
`stacklib.serve.server`), so a process that only loads artifacts stays small.

Differences from the real thing (`jax.export` + orbax-export + a serving runtime such as
TF Serving): one process, one host; JSON over HTTP only (no gRPC); no TensorFlow
SavedModel; the manifest is checked, not signed.
"""

from stacklib.serve.artifact import ArtifactError, LoadedModel, export, load, read_manifest, verify

__all__ = ["ArtifactError", "LoadedModel", "export", "load", "read_manifest", "verify"]
