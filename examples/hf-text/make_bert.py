"""Write what examples/hf-text/bert-sentiment.yaml trains on, offline: a tokenizer file, a
pretrained folder and a small labelled text set.

Nothing is downloaded, so the three inputs a Hugging Face user brings are made here, small:

* ``tokenizer.json``: a word-level tokenizer (the ``tokenizers`` package) over the words
  of the texts below, ``[PAD]`` = 0 and ``[UNK]`` = 1 first;
* ``pretrained/``: a 2-layer BERT (width 32, the tokenizer's vocabulary) written by
  ``save_pretrained``: the stand-in for your own pretrained folder. Its weights are drawn
  from the config (seeded), not learned: the example shows the plumbing, a real folder
  brings what it learned;
* ``train/`` and ``test/``: Parquet rows of ``ids`` (``--seq-len`` token ids, padded with
  0) and ``label`` (0 negative, 1 positive) for synthetic reviews such as "the plot was
  dull and slow", labelled by the sentiment words they hold.

    .venv/bin/python examples/hf-text/make_bert.py [DIR] [--train N] [--test N] [--seq-len T]

DIR defaults to /tmp/dynabatch-hf-bert (the path the example spec names).
"""

from __future__ import annotations

import argparse
import os
import random
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

POSITIVE = ["good", "great", "fun", "lovely", "brilliant", "sharp", "warm", "clever"]
NEGATIVE = ["bad", "dull", "slow", "awful", "boring", "weak", "cold", "clumsy"]
SUBJECTS = ["the film", "the plot", "the cast", "the music", "the ending", "this book",
            "the story", "the acting"]
LINKS = ["was", "felt", "is", "seemed"]
ADVERBS = ["", "really", "quite", "very", "rather"]
SPECIAL = ["[PAD]", "[UNK]"]


def review(rng: random.Random) -> tuple[str, int]:
    """One synthetic review and its label: two sentiment words of one side, or, one time in
    four, one of each side with the label of the first ("good but slow" is positive)."""
    label = rng.randrange(2)
    side, other = (POSITIVE, NEGATIVE) if label else (NEGATIVE, POSITIVE)
    second = rng.choice(other if rng.random() < 0.25 else side)
    adverb = rng.choice(ADVERBS)
    words = [rng.choice(SUBJECTS), rng.choice(LINKS), adverb, rng.choice(side),
             "but" if second in other else "and", second]
    return " ".join(w for w in words if w), label


def vocabulary() -> list[str]:
    words = {w for phrase in SUBJECTS for w in phrase.split()}
    words |= {*LINKS, *filter(None, ADVERBS), *POSITIVE, *NEGATIVE, "and", "but"}
    return SPECIAL + sorted(words)


def make_tokenizer(path: str) -> Any:
    """A word-level ``tokenizers`` tokenizer of :func:`vocabulary`, saved to ``path``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(path)
    return tok


def make_pretrained(folder: str, vocab_size: int, seq_len: int) -> None:
    """A small BERT's ``save_pretrained`` folder (config.json, model.safetensors)."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=max(64, seq_len), pad_token_id=0)
    BertForMaskedLM(config).save_pretrained(folder)


def write_split(folder: str, tok: Any, n: int, seq_len: int, rng: random.Random) -> None:
    """``n`` reviews as one Parquet file: ``ids`` (``seq_len`` ids, 0-padded), ``label``."""
    os.makedirs(folder, exist_ok=True)
    rows, labels = [], []
    for _ in range(n):
        text, label = review(rng)
        ids = tok.encode(text).ids[:seq_len]
        rows.append(ids + [0] * (seq_len - len(ids)))
        labels.append(label)
    flat = pa.array([i for row in rows for i in row], pa.int32())
    table = pa.table({"ids": pa.FixedSizeListArray.from_arrays(flat, seq_len),
                      "label": pa.array(labels, pa.int64())})
    pq.write_table(table, os.path.join(folder, "part-00000.parquet"), row_group_size=256)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", nargs="?", default="/tmp/dynabatch-hf-bert")
    ap.add_argument("--train", type=int, default=1024, help="training reviews")
    ap.add_argument("--test", type=int, default=256, help="held-out reviews")
    ap.add_argument("--seq-len", type=int, default=12, help="tokens per review (padded)")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    tok = make_tokenizer(os.path.join(args.dir, "tokenizer.json"))
    size = tok.get_vocab_size()
    make_pretrained(os.path.join(args.dir, "pretrained"), size, args.seq_len)
    rng = random.Random(0)
    write_split(os.path.join(args.dir, "train"), tok, args.train, args.seq_len, rng)
    write_split(os.path.join(args.dir, "test"), tok, args.test, args.seq_len, rng)
    print(f"{args.dir}: tokenizer.json ({size} tokens), pretrained/ (BERT, vocab_size "
          f"{size}), train/ ({args.train} reviews), test/ ({args.test}), {args.seq_len} "
          "tokens a review")


if __name__ == "__main__":
    main()
