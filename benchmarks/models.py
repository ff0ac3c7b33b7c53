"""The transformer-like model every benchmark applies its APIs to.

Per block: two LayerNorms, attention with q/k/v/o Linear layers, and an MLP with
up/act/down/dropout: 12 modules and 16 parameters. 512 blocks make about 6,150
modules and 8,200 parameters. Widths are tiny: the contract's cost depends on the
module tree, not on tensor sizes, and small tensors keep building a model cheap.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

__all__ = ["Block", "Model", "blocks_of", "build_model", "module_count", "modules_in"]

WIDTH = 8


class Attention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.o = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), dim=-1)
        out: torch.Tensor = self.o(scores @ self.v(x))
        return out


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.dropout(self.down(self.act(self.up(x))))
        return out


class Block(nn.Module):
    hook_value: int  # read by the plain-attribute hooks of the forward+backward benchmark

    def __init__(self, width: int) -> None:
        super().__init__()
        self.hook_value = 0
        self.norm1 = nn.LayerNorm(width)
        self.attn = Attention(width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class Model(nn.Module):
    def __init__(self, blocks: int, width: int = WIDTH) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build_model(blocks: int) -> Model:
    """A fresh model of ``blocks`` blocks."""
    return Model(blocks)


def blocks_of(model: Model) -> list[Block]:
    """The blocks of ``model``, in order."""
    return [block for block in model.blocks if isinstance(block, Block)]


def module_count(model: nn.Module) -> int:
    """How many module paths ``model`` has, as ``named_modules(remove_duplicate=False)``."""
    return sum(1 for _ in model.named_modules(remove_duplicate=False))


@functools.cache
def modules_in(blocks: int) -> int:
    """How many module paths a model of ``blocks`` blocks has."""
    return module_count(build_model(blocks))
