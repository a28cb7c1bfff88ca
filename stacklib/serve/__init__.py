"""Exporting and serving: `jax.export` artifacts and a model server with dynamic batching.

    import stacklib.serve as serve

    serve.export(predict, params, (x,), "models/digits/1")    # traced once, symbolic batch
    model = serve.load("models/digits/1")                      # no model code, no flax
    logits = model(x)                                          # any batch size

    from stacklib.serve import lm
    lm.export(language_model, "models/stdlib-bytes/1")         # symbolic batch and length
    lm.generate(serve.load("models/stdlib-bytes/1"), prompt, 48)  # greedy, from the artifact

    python -m stacklib.serve --model-dir models/               # the HTTP server

The pieces, one file each:

  artifact.py    export / verify / load: program + weights + manifest with SHA-256 hashes
  batching.py    DynamicBatcher: requests from many clients padded into one call
  repository.py  models/<name>/<version>/ scanned while serving; a broken version never
                 replaces a working one
  server.py      the HTTP endpoints (predict, status, health, metrics) on `stacklib.http`
  lm.py          chapter 12's language model as an artifact: next-token logits of
                 int32[b, t] with t <= max_seq_len, -1 padding, greedy generation from it

Importing this package imports JAX and NumPy only (the server's FastAPI is imported by
`stacklib.serve.server`), so a process that only loads artifacts stays small.

Differences from the real thing (`jax.export` + orbax-export + a serving runtime such as
TF Serving): one process, one host; JSON over HTTP only (no gRPC); no TensorFlow
SavedModel; the manifest is checked, not signed.
"""

from stacklib.serve.artifact import ArtifactError, LoadedModel, export, load, read_manifest, verify

__all__ = ["ArtifactError", "LoadedModel", "export", "load", "read_manifest", "verify"]
