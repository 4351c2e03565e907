"""Where samples come from: sources read by position and the per-worker loader.

* :mod:`.source`: the interface (``len``, ``read(ids, keys) -> (x, y)``), in-memory arrays,
  splits, augmentation keys;
* :mod:`.arrow` (Parquet), :mod:`.files` (``.npy`` shards, image folders),
  :mod:`.mapstyle` (a user's ``Dataset``);
* :mod:`.open`: which source a spec names, and the recipe a worker opens it from;
* :mod:`.order`: the block order of sources that read row groups;
* :mod:`.loader`: the worker's read-ahead of its planned positions.
"""
