"""``charlm``: a small causal Transformer for character-level language modelling.

Input: token ids ``(B, T)``; output: next-token logits ``(B, T, V)`` with ``V`` the spec's
``num_classes`` (the vocabulary). Token and learned position embeddings of width
``model.hidden``, ``layers`` pre-norm Transformer encoder layers under a causal mask (position
``t`` attends to ``0..t`` only), a final LayerNorm and a linear read-out. No dropout and no
buffers that training updates, so data-parallel replicas stay identical from gradients alone.
"""

from __future__ import annotations

import torch
from torch import nn


class CharLM(nn.Module):
    def __init__(self, seq_len: int, vocab: int, width: int = 64, layers: int = 2,
                 heads: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(seq_len, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=4 * width, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.seq_len = seq_len

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        h = self.tok(ids.long()) + self.pos[:t]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))
