"""Readers of the on-disk dataset formats: IDX (MNIST, :mod:`.idx`) and CIFAR-10's python
batches (:mod:`.cifar`). The tests' writers (``tests/formats.py``) make small files that go
through the very same readers.
"""

from __future__ import annotations

from dynabatch.actors.workloads import WorkloadError


class FormatError(WorkloadError):
    """A file that is not valid in its format; the message starts with the file name."""
