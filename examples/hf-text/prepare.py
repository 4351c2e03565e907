"""Write the Parquet text set that examples/hf-text/gpt2-hetero.yaml trains on.

The text is the Python standard library's own source (the modules ``pysource`` reads, so
it is on every machine, offline). A byte-level BPE tokenizer from the ``tokenizers``
package is trained on it, the token stream is cut into windows of ``--seq-len + 1`` ids,
and each window is a row: ``ids`` (the first ``seq-len`` tokens) and ``next`` (the same
shifted by one, the token to predict at every position). The last ``--test-fraction`` of
the stream (other modules) is ``test/``, the rest ``train/``; the tokenizer is saved
beside them (``tokenizer.json``) to decode what the model writes.

    .venv/bin/python examples/hf-text/prepare.py [DIR] [--chars N] [--vocab V] [--seq-len T]

DIR defaults to /tmp/dynabatch-hf-text (the path the example config names). It prints the
vocabulary size, which the config's ``dataset.options.num_classes`` must be at least.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from dynabatch.actors.workloads.text import stdlib_text, windows
from tokenizers import ByteLevelBPETokenizer


def write_split(path: str, x: np.ndarray, y: np.ndarray) -> None:
    """One Parquet file of list<int32> columns ``ids`` and ``next``, in row groups of 512
    rows (a worker reads by row group)."""
    os.makedirs(path, exist_ok=True)
    t = x.shape[1]
    table = pa.table(
        {
            "ids": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel(), pa.int32()), t),
            "next": pa.FixedSizeListArray.from_arrays(pa.array(y.ravel(), pa.int32()), t),
        }
    )
    pq.write_table(table, os.path.join(path, "part-00000.parquet"), row_group_size=512)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", nargs="?", default="/tmp/dynabatch-hf-text")
    ap.add_argument("--chars", type=int, default=200_000, help="characters of text")
    ap.add_argument("--vocab", type=int, default=512, help="the BPE vocabulary size")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per sample")
    ap.add_argument("--test-fraction", type=float, default=0.1)
    args = ap.parse_args()
    t0 = time.monotonic()
    text = stdlib_text(args.chars)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([text], vocab_size=args.vocab, min_frequency=2, show_progress=False)
    ids = np.asarray(tok.encode(text).ids, dtype=np.int64)
    cut = int(len(ids) * (1.0 - args.test_fraction))
    x, y = windows(ids[:cut], args.seq_len)
    xt, yt = windows(ids[cut:], args.seq_len)
    write_split(f"{args.dir}/train", x, y)
    write_split(f"{args.dir}/test", xt, yt)
    tok.save(f"{args.dir}/tokenizer.json")
    print(
        f"wrote {len(x)} training and {len(xt)} test sequences of {args.seq_len} tokens "
        f"({len(text) / len(ids):.2f} characters a token, vocabulary "
        f"{tok.get_vocab_size()}) under {args.dir} in {time.monotonic() - t0:.1f}s"
    )


if __name__ == "__main__":
    main()
