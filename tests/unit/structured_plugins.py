"""Structured samples named by import path in the tests: a tabular dataset whose inputs are
a dict ``{"num", "cat"}`` (or a tuple), variable-length token sequences with a collate that
pads them to the share's longest and adds an attention mask, and the models and the masked
per-sample losses that go with them."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 16
PAD_TARGET = -100  # a padded position's target: the losses below skip it


class Tabular(torch.utils.data.Dataset):
    """Three numeric features and one categorical one (4 categories); 3 classes. ``form``:
    ``dict`` gives ``{"num": (3,), "cat": ()}`` inputs, ``tuple`` gives ``(num, cat)``;
    ``odd_keys_at`` returns another key set for that sample."""

    num_classes = 3

    def __init__(self, n: int = 96, form: str = "dict", odd_keys_at: int = -1):
        rng = np.random.default_rng(1)
        self.num = rng.standard_normal((n, 3)).astype(np.float32)
        self.cat = rng.integers(0, 4, n)
        self.y = ((self.num[:, 0] > 0).astype(np.int64) + (self.cat >= 2)).astype(np.int64)
        self.form, self.odd_keys_at = form, odd_keys_at

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        num, cat = torch.from_numpy(self.num[i]), torch.tensor(int(self.cat[i]))
        if self.form == "tuple":
            return (num, cat), int(self.y[i])
        if i == self.odd_keys_at:
            return {"num": num, "category": cat}, int(self.y[i])
        return {"num": num, "cat": cat}, int(self.y[i])


def tabular(n: int = 96, form: str = "dict", odd_keys_at: int = -1) -> Tabular:
    return Tabular(n, form, odd_keys_at)


class TabularModel(nn.Module):
    """Takes the numeric features and the category by name (or by position: a tuple)."""

    def __init__(self, num_classes: int = 3):
        super().__init__()
        self.emb = nn.Embedding(4, 4)
        self.head = nn.Sequential(nn.Linear(3 + 4, 16), nn.ReLU(), nn.Linear(16, num_classes))

    def forward(self, num: torch.Tensor, cat: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([num, self.emb(cat)], dim=1))


def tabular_model(input_shape: tuple[int, ...], num_classes: int) -> TabularModel:
    return TabularModel(num_classes)


class Sequences(torch.utils.data.Dataset):
    """Token sequences of 2 to ``longest`` tokens. ``task``: ``classify`` labels a sequence
    1 when most of its tokens are in the upper half of the vocabulary; ``lm`` gives each
    sequence's next tokens as its target (same length). ``bad_at``: that sample is a bare
    tensor, not an (input, target) pair."""

    num_classes = 2

    def __init__(
        self,
        n: int = 128,
        longest: int = 12,
        task: str = "classify",
        bad_at: int = -1,
        seed: int = 2,
    ):
        rng = np.random.default_rng(seed)
        self.seqs = [rng.integers(1, VOCAB, rng.integers(2, longest + 1)) for _ in range(n)]
        self.task, self.bad_at = task, bad_at

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int):
        ids = torch.from_numpy(self.seqs[i]).long()
        if i == self.bad_at:
            return ids
        if self.task == "lm":
            return ids, torch.roll(ids, -1)
        return ids, int((ids >= VOCAB // 2).sum() * 2 > len(ids))


def sequences(
    n: int = 128, longest: int = 12, task: str = "classify", bad_at: int = -1
) -> Sequences:
    return Sequences(n, longest, task, bad_at)


def pad(samples: list) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The share's sequences padded to its longest, with an attention mask; a sequence
    target is padded with PAD_TARGET, a label stacked."""
    longest = max(len(ids) for ids, _ in samples)
    ids = torch.zeros((len(samples), longest), dtype=torch.long)
    mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for j, (s, _) in enumerate(samples):
        ids[j, : len(s)], mask[j, : len(s)] = s, 1
    targets = [t for _, t in samples]
    if isinstance(targets[0], torch.Tensor) and targets[0].dim() == 1:
        y = torch.full((len(samples), longest), PAD_TARGET, dtype=torch.long)
        for j, t in enumerate(targets):
            y[j, : len(t)] = t
    else:
        y = torch.tensor(targets)
    return {"input_ids": ids, "attention_mask": mask}, y


def broken_collate(samples: list):
    raise ValueError(f"cannot pad {len(samples)} samples\nsecond line")


class SeqClassifier(nn.Module):
    """Masked mean of token embeddings, then a linear head: padding changes nothing."""

    def __init__(self, num_classes: int = 2, dim: int = 16):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        m = attention_mask.unsqueeze(-1).to(self.emb.weight.dtype)
        pooled = (self.emb(input_ids) * m).sum(1) / m.sum(1).clamp(min=1)
        return self.head(pooled)


def seq_classifier(input_shape: tuple[int, ...], num_classes: int, dim: int = 16) -> SeqClassifier:
    return SeqClassifier(num_classes, dim)


class TinyLM(nn.Module):
    """Per-token logits from each token and its predecessor (a causal, padding-blind
    model: a sequence's logits do not depend on how far it is padded)."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.prev = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        e = self.emb(input_ids) * attention_mask.unsqueeze(-1).to(self.emb.weight.dtype)
        before = F.pad(e, (0, 0, 1, 0))[:, :-1]
        return self.out(torch.tanh(e + self.prev(before)))


def tiny_lm(input_shape: tuple[int, ...], num_classes: int) -> TinyLM:
    return TinyLM()


def masked_token_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per sample: the mean cross-entropy over its real (unpadded) tokens."""
    per = F.cross_entropy(
        outputs.flatten(0, 1), targets.flatten(), reduction="none", ignore_index=PAD_TARGET
    ).view(targets.shape)
    real = (targets != PAD_TARGET).to(per.dtype)
    return (per * real).sum(1) / real.sum(1).clamp(min=1)
