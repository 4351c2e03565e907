"""Readers and writers for the on-disk dataset formats: IDX (MNIST) and CIFAR-10 python batches.

The tests' writers (``tests/formats.py``) make small files in these formats that go through
the very same readers as the real datasets.

IDX: a 4-byte big-endian magic ``00 00 <type> <ndim>``, then ``ndim`` big-endian uint32 sizes,
then the data in C order, big-endian. MNIST images are ``0x00000803`` (ubyte, N x 28 x 28) and
labels ``0x00000801`` (ubyte, N); files may be gzip-compressed.

CIFAR-10 (python version): ``data_batch_1`` .. ``data_batch_5`` and ``test_batch`` are pickled
dicts with bytes keys, ``b"data"`` a uint8 array (N, 3072) holding the R, G and B planes of each
32x32 image, and ``b"labels"`` a list of ints; ``batches.meta`` holds ``b"label_names"``.
"""

from __future__ import annotations

from dynabatch.actors.workloads import WorkloadError


class FormatError(WorkloadError):
    """A file that is not valid in its format; the message starts with the file name."""
