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

__all__ = [
    "Block",
    "LlamaStack",
    "Model",
    "blocks_of",
    "build_model",
    "llama_modules",
    "llama_on_meta",
    "module_count",
    "modules_in",
]

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


# ----------------------------------------------------------------- Llama-7B-shaped, on meta


class LlamaAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)


class LlamaFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)


class LlamaLayer(nn.Module):
    """A Llama-7B decoder layer's modules and parameters (12 modules, 9 parameters)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = LlamaAttention(dim)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = LlamaFeedForward(dim, hidden)


class LlamaStack(nn.Module):
    """Embedding, ``layers`` Llama-7B layers, a final norm and the output head."""

    def __init__(self, layers: int, dim: int = 4096, hidden: int = 11008) -> None:
        super().__init__()
        self.embed = nn.Embedding(32000, dim)
        self.layers = nn.ModuleList(LlamaLayer(dim, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, 32000, bias=False)


def llama_on_meta(layers: int) -> LlamaStack:
    """A Llama-7B-shaped stack of ``layers`` layers on the meta device: shapes, no storage."""
    with torch.device("meta"):
        return LlamaStack(layers)


def llama_modules(layers: int) -> int:
    """How many modules a stack of ``layers`` layers has: 12 a layer, 5 around them."""
    return 5 + 12 * layers
