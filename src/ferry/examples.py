"""Bundled example models for the README and the `ferry` command: each factory returns
(model, example_inputs), the SPEC format `ferry compile` takes (e.g. ferry.examples:transformer_block)."""

from __future__ import annotations

import torch
from torch import nn


class TransformerBlock(nn.Module):
    """Pre-norm attention + MLP: a typical decoder block."""

    def __init__(self, dim: int = 64, heads: int = 4, hidden: int = 256):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


def transformer_block(batch: int = 2, seq: int = 16, dim: int = 64):
    torch.manual_seed(0)
    return TransformerBlock(dim).eval(), (torch.randn(batch, seq, dim),)


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def small_cnn(batch: int = 2):
    torch.manual_seed(0)
    return SmallCNN().eval(), (torch.randn(batch, 3, 32, 32),)
