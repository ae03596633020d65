"""Small models the reliability scenarios share."""

from __future__ import annotations

import os

import torch
from torch import nn


def rss_mb() -> float:
    """Resident memory of this process, from /proc (no psutil needed)."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class Encoder(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.1, batch_first=True)
        self.head = nn.Linear(d, 1)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x)).mean() * self.scale


class TinyLM(nn.Module):
    """A causal language model: embedding, two transformer layers, a tied head."""

    def __init__(self, vocab: int = 97, d: int = 48) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.position = nn.Embedding(64, d)
        layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.temperature = 1.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        steps = ids.shape[1]
        positions = torch.arange(steps, device=ids.device)
        h = self.embed(ids) + self.position(positions)
        mask = torch.triu(torch.full((steps, steps), float("-inf"), device=ids.device), 1)
        h = self.norm(self.blocks(h, mask=mask))
        logits = h @ self.embed.weight.t() / self.temperature
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.0)
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))
