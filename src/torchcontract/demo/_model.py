"""The demo's model and data: a small GPT, and batches that are a function of rank and index."""

from __future__ import annotations

import attrs
import torch
from torch import Tensor, nn
from torch.nn import functional

__all__ = ["GPT", "GPTConfig", "synthetic_batch"]


@attrs.frozen
class GPTConfig:
    """The shape of the demo model."""

    vocabulary: int = 64
    context: int = 32
    width: int = 64
    heads: int = 4
    layers: int = 4
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which a token sees only the tokens before it."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.out = nn.Linear(config.width, config.width)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        q, k, v = (
            part.reshape(batch, length, self.heads, width // self.heads).transpose(1, 2)
            for part in self.qkv(x).split(width, dim=2)
        )
        dropout = self.dropout if self.training else 0.0
        y = functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        output: Tensor = self.out(y.transpose(1, 2).reshape(batch, length, width))
        return output


class Block(nn.Module):
    """A pre-norm transformer block: attention, then a two-layer MLP, each with a residual."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.width)
        self.attention = CausalSelfAttention(config)
        self.norm2 = nn.LayerNorm(config.width)
        self.mlp = nn.Sequential(
            nn.Linear(config.width, 4 * config.width),
            nn.GELU(),
            nn.Linear(4 * config.width, config.width),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.norm1(x))
        output: Tensor = x + self.mlp(self.norm2(x))
        return output


class GPT(nn.Module):
    """A small GPT: token and position embeddings, blocks, and a head tied to the embedding."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocabulary, config.width)
        self.positions = nn.Embedding(config.context, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocabulary, bias=False)
        self.head.weight = self.tokens.weight
        for name, parameter in self.named_parameters():
            if parameter.dim() > 1:  # embeddings and linear weights, as GPT-2 initializes them
                nn.init.normal_(parameter, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(parameter)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.head(self.norm(x))
        return logits


def synthetic_batch(config: GPTConfig, batch: int, rank: int, step: int) -> tuple[Tensor, Tensor]:
    """Sequences that count up mod the vocabulary from a random start, by a random stride.

    Predicting the next token means finding the stride in the context, so the loss
    falls well below ln(vocabulary) within a few dozen steps. Each rank and step
    draws its own batch.
    """
    generator = torch.Generator().manual_seed(1_000 * step + rank)
    start = torch.randint(0, config.vocabulary, (batch, 1), generator=generator)
    stride = torch.randint(1, 6, (batch, 1), generator=generator)
    sequence = (start + stride * torch.arange(config.context + 1)) % config.vocabulary
    return sequence[:, :-1], sequence[:, 1:]
