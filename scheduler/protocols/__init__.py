"""Training protocols: pure machines that say which steps run next and what an outcome
means. ``sync``: synchronous data-parallel SGD with per-worker batches (DBS)."""
