"""The small GPT the fully_shard tests train: tied embedding and head, sizes not divisible by 3."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn import functional
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchcontract.apis._compat import REFERENCE_FULLY_SHARD_ON_CPU
from torchcontract.testing import free_port

#: For tests that compare with PyTorch's fully_shard, which cannot run on CPU on every torch.
needs_reference_fully_shard = pytest.mark.skipif(
    not REFERENCE_FULLY_SHARD_ON_CPU,
    reason=f"compares with PyTorch's fully_shard, which fails on CPU with torch "
    f"{torch.__version__}",
)

VOCAB, DIM, HIDDEN, SEQ, HEADS, BATCH = 23, 10, 26, 7, 2, 3


class Block(nn.Module):
    """Pre-norm attention and MLP, as in GPT-2."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(DIM, dim=-1)

        def heads(z: Tensor) -> Tensor:
            return z.view(batch, length, HEADS, DIM // HEADS).transpose(1, 2)

        attended = functional.scaled_dot_product_attention(
            heads(q), heads(k), heads(v), is_causal=True
        )
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, DIM))
        out: Tensor = x + self.down(functional.gelu(self.up(self.norm2(x))))
        return out


class MLP(nn.Module):
    """The MLP of PyTorch's FSDP tests: ``dim -> dim * multiplier -> dim``."""

    def __init__(self, dim: int, multiplier: int = 4, bias: bool = True) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim * multiplier, bias=bias)
        self.out_proj = nn.Linear(dim * multiplier, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.out_proj(torch.relu(self.in_proj(x)))
        return out


class GPT(nn.Module):
    """Token and position embeddings, blocks, a final norm and a head tied to the embedding.

    ``repeat_first`` runs the first block twice per forward.
    """

    def __init__(self, blocks: int = 2, repeat_first: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.position = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.repeat_first = repeat_first

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        if self.repeat_first:
            x = self.blocks[0](x)
        for block in self.blocks:
            x = block(x)
        out: Tensor = self.head(self.norm(x))
        return out


def gpt(repeat_first: bool = False) -> GPT:
    torch.manual_seed(0)
    return GPT(repeat_first=repeat_first)


def batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    """Rank ``rank``'s tokens and targets at ``step``: different on every rank."""
    generator = torch.Generator().manual_seed(1000 * rank + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return tokens, torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def global_batch(world_size: int, step: int) -> tuple[Tensor, Tensor]:
    """Every rank's batch at ``step``, concatenated in rank order."""
    parts = [batch(rank, step) for rank in range(world_size)]
    return torch.cat([tokens for tokens, _ in parts]), torch.cat([target for _, target in parts])


def loss_on(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    logits: Tensor = model(tokens)
    return functional.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def full_parameters(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter, gathered if sharded (a collective: every rank calls it)."""
    return {
        name: (parameter.full_tensor() if isinstance(parameter, DTensor) else parameter).detach()
        for name, parameter in model.named_parameters()
    }


def full_gradients(model: nn.Module) -> dict[str, Tensor]:
    """Every gradient, gathered if sharded; parameters without one are left out."""
    found: dict[str, Tensor] = {}
    for name, parameter in model.named_parameters():
        grad = parameter.grad
        if grad is not None:
            found[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return found


def largest_gap(mine: dict[str, Tensor], theirs: dict[str, Tensor]) -> float:
    """The largest absolute difference; both must have the same names."""
    if mine.keys() != theirs.keys():
        raise AssertionError(f"different names: {sorted(mine)} and {sorted(theirs)}")
    return max(
        (float((mine[name].float() - theirs[name].float()).abs().max()) for name in mine),
        default=0.0,
    )


def sharded_gpt(apply: Callable[..., Any], mesh: DeviceMesh) -> GPT:
    """A seeded 2-block ``GPT`` with ``apply`` (ours or FSDP2's) on each block, then the root."""
    torch.manual_seed(0)
    model = GPT(blocks=2)
    for block in model.blocks:
        apply(block, mesh=mesh)
    apply(model, mesh=mesh)
    return model


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """The modules of ``model`` sharded by either API (``FSDPModule`` instances), in order."""
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def tiny_llama_config() -> Any:
    """A Hugging Face ``LlamaConfig`` of two layers of width 16 (built, never downloaded)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=37,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )


@contextmanager
def one_rank_cuda_mesh() -> Iterator[DeviceMesh]:
    """A 1-D CUDA mesh of this one process, over NCCL, for the ``gpu`` tests."""
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield init_device_mesh("cuda", (1,))
    finally:
        dist.destroy_process_group()


@contextmanager
def fake_cuda_mesh_of_two() -> Iterator[DeviceMesh]:
    """A CUDA mesh of a fake 2-rank group: this process is rank 0, collectives do nothing."""
    torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cuda", (2,))
    finally:
        dist.destroy_process_group()
