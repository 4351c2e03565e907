"""Load an HF export of examples/hf-text/bert-sentiment.yaml with transformers alone (no
dynabatch import) and label some reviews: what a Hugging Face user does with the folder
``dynabatch export ID --format hf -o DIR`` wrote.

    .venv/bin/python examples/hf-text/classify.py DIR ["a review" ...]

Prints one JSON line: the labels the config names (id2label) and, for each review, its
token ids and the predicted label.
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

REVIEWS = ["the film was really great and fun", "the plot felt dull and slow"]


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    folder, reviews = sys.argv[1], sys.argv[2:] or REVIEWS
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out = []
    for text in reviews:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        out.append({"text": text, "ids": ids[0].tolist(),
                    "label": model.config.id2label[int(logits.argmax(-1))]})
    print(json.dumps({"labels": model.config.id2label, "reviews": out}))


if __name__ == "__main__":
    main()
