"""User code for the Hugging Face model tests, named by import path like real user code:
model builders returning transformers models, and outputs adapters (``model.output``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def tiny_gpt2(input_shape: tuple[int, ...], num_classes: int, width: int = 16) -> nn.Module:
    """A user's builder returning any transformers model: a 1-layer GPT-2 LM head model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=num_classes,
        n_positions=input_shape[0],
        n_embd=width,
        n_layer=1,
        n_head=2,
        use_cache=False,
    )
    return GPT2LMHeadModel(cfg)


def last_position(outputs: Any) -> torch.Tensor:
    """model.output: the logits at the last position only, (B, V), for a class loss."""
    return outputs.logits[:, -1]


class TupleNet(nn.Module):
    """Returns (logits, features): a model whose output is not a tensor."""

    def __init__(self, width: int, classes: int):
        super().__init__()
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(x), x


def tuple_net(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return TupleNet(input_shape[0], num_classes)


def first(outputs: Any) -> torch.Tensor:
    """model.output for TupleNet: its logits."""
    return outputs[0]


def not_a_tensor(outputs: Any) -> list[int]:
    return [1, 2]


def raises(outputs: Any) -> torch.Tensor:
    raise KeyError("pooler_output")


def tuple_ce(outputs: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """A user's loss that takes the tuple apart itself: no adapter needed."""
    return nn.functional.cross_entropy(outputs[0], targets, reduction="none")


class TokenClasses(torch.utils.data.Dataset):
    """A map-style dataset of token id sequences (``{"input_ids": ...}``, as a tokenizer
    gives them) and 3 classes; the largest id,
    ``vocab - 1``, is in sample ``at`` (0: the one the load-time check of the objective
    reads; a later one is first seen by a worker's training step)."""

    num_classes = 3

    def __init__(self, vocab: int, n: int = 32, t: int = 8, at: int = 0):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, min(vocab, 40), (n, t), generator=g)
        self.x[at, 5] = vocab - 1
        self.y = torch.arange(n) % 3

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return {"input_ids": self.x[i]}, self.y[i]


def token_classes(vocab: int, n: int = 32, t: int = 8, at: int = 0) -> TokenClasses:
    return TokenClasses(vocab, n, t, at)
