"""Bounds shared by the mesh's signed JSON objects: a capacity summary
(:mod:`viiwork.mesh.summary`) and its extensions (:mod:`viiwork.mesh.extensions`) hold
their model names, labels and integers to the same limits (docs/mesh.md, "Limits")."""

MAX_MODELS = 64  # models in one summary (and model entries in one extension)
MAX_NAME_CHARS = 200  # a model's name
MAX_LABEL_CHARS = 64  # an engine, kind or other short label
MAX_INT = 2**53  # JSON-safe; integers beyond this are malformed
