"""The models the 2-D (tensor parallel x fully_shard) tests train, and how they are sharded.

Each is built on one seed, parallelized with ``parallelize_module`` on a TP mesh and
then sharded with ``fully_shard`` (ours or FSDP2's) on the data-parallel mesh, block by
block and then the root, as torchtitan does. Sizes do not divide evenly by 2 on dim 0
after the TP split, so the data-parallel shards are padded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from fully_shard_models import full_gradients, full_parameters, largest_gap
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

IN, HIDDEN = 6, 10  # up: (10, 6) -> TP rows 5 -> dp shards 3 and 2; down: (6, 10) -> (6, 5)
VOCAB, SEQ, BATCH = 50, 8, 2

#: ``fully_shard``'s signature as both libraries take it here.
ShardFunction = Callable[..., Any]


class MLP(nn.Module):
    """``up`` column-wise, ``down`` row-wise under TP: one all-reduce per forward."""

    def __init__(self, features: int = IN, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.up = nn.Linear(features, hidden)
        self.down = nn.Linear(hidden, features)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = x + self.down(torch.relu(self.up(x)))
        return out


MLP_PLAN: dict[str, ParallelStyle] = {"up": ColwiseParallel(), "down": RowwiseParallel()}


def mlp_stack(features: int = IN, hidden: int = HIDDEN) -> nn.Sequential:
    """Two MLP blocks, seeded: every call returns the same parameters."""
    torch.manual_seed(0)
    return nn.Sequential(MLP(features, hidden), MLP(features, hidden))


def sharded_mlp(
    shard: ShardFunction,
    dp_mesh: DeviceMesh,
    tp_mesh: DeviceMesh,
    *,
    features: int = IN,
    hidden: int = HIDDEN,
    **options: object,
) -> nn.Sequential:
    """``mlp_stack()`` with TP on ``tp_mesh`` and ``shard`` on ``dp_mesh`` (blocks, then root)."""
    model = mlp_stack(features, hidden)
    for block in model:
        parallelize_module(block, tp_mesh, MLP_PLAN)
        shard(block, mesh=dp_mesh, **options)
    shard(model, mesh=dp_mesh)
    return model


def mlp_batch(dp_rank: int, step: int, features: int = IN) -> Tensor:
    """The input of data-parallel rank ``dp_rank`` (the same on its TP ranks) at ``step``."""
    generator = torch.Generator().manual_seed(100 * dp_rank + step)
    return torch.randn(4, features, generator=generator)


def dim_1_of_matrices(parameter: nn.Parameter) -> Shard | None:
    """A ``shard_placement_fn``: matrices on dim 1, vectors on dim 0 (the default)."""
    return Shard(1) if parameter.dim() == 2 else None


def mlp_loss(model: nn.Module, x: Tensor) -> Tensor:
    out: Tensor = model(x)
    return out.pow(2).mean()


class NormMLP(nn.Module):
    """A pre-norm MLP on ``(batch, sequence, features)``: the norm under sequence parallelism."""

    def __init__(self, norm: Callable[[int], nn.Module] = nn.LayerNorm) -> None:
        super().__init__()
        self.norm = norm(IN)
        self.up = nn.Linear(IN, HIDDEN)
        self.down = nn.Linear(HIDDEN, IN)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = x + self.down(torch.relu(self.up(self.norm(x))))
        return out


#: The norm sequence-parallel (its input and output split on the sequence dim), ``up``
#: gathering the sequence, ``down`` scattering it again.
SEQUENCE_PARALLEL_PLAN: dict[str, ParallelStyle] = {
    "norm": SequenceParallel(),
    "up": ColwiseParallel(input_layouts=Shard(1)),
    "down": RowwiseParallel(output_layouts=Shard(1)),
}


def sequence_parallel_mlp(
    shard: ShardFunction,
    dp_mesh: DeviceMesh,
    tp_mesh: DeviceMesh,
    *,
    norm: Callable[[int], nn.Module] = nn.LayerNorm,
    **options: object,
) -> nn.Module:
    """Two ``NormMLP`` blocks: every parameter, the norms' too, a DTensor on ``tp_mesh``.

    ``options`` go to ``shard`` on each block.
    """
    torch.manual_seed(0)
    model = nn.Sequential(NormMLP(norm), NormMLP(norm))
    for block in model:
        parallelize_module(block, tp_mesh, SEQUENCE_PARALLEL_PLAN)
        shard(block, mesh=dp_mesh, **options)
    shard(model, mesh=dp_mesh)
    return model


def sequence_batch(dp_rank: int, tp_rank: int, step: int) -> Tensor:
    """Data-parallel rank ``dp_rank``'s ``(2, 4, IN)`` input: TP rank ``tp_rank``'s half of it."""
    generator = torch.Generator().manual_seed(100 * dp_rank + step)
    return torch.randn(2, 4, IN, generator=generator).chunk(2, dim=1)[tp_rank]


def tiny_llama() -> nn.Module:
    """A 2-layer Hugging Face Llama from a config (no download), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model: nn.Module = LlamaForCausalLM(config)
    return model


LLAMA_PLAN: dict[str, ParallelStyle] = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}


def sharded_llama(shard: ShardFunction, dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> nn.Module:
    """``tiny_llama()``: attention and MLP projections under TP, every layer then the root sharded.

    The embeddings, norms and head stay plain: they are sharded on the data-parallel
    mesh alone, beside the 2-D parameters.
    """
    model = tiny_llama()
    layers: Any = model.get_submodule("model.layers")
    for layer in layers:
        parallelize_module(layer, tp_mesh, LLAMA_PLAN)
        shard(layer, mesh=dp_mesh)
    shard(model, mesh=dp_mesh)
    return model


def llama_batch(dp_rank: int, step: int) -> Tensor:
    generator = torch.Generator().manual_seed(1000 * dp_rank + step)
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)


def llama_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    loss: Tensor = model(input_ids=tokens, labels=tokens).loss
    return loss


def two_dimensional(model: nn.Module) -> list[nn.Parameter]:
    """The parameters on a mesh of more than one dim (those tensor parallelism split)."""
    return [
        parameter
        for parameter in model.parameters()
        if isinstance(parameter, DTensor) and parameter.device_mesh.ndim > 1
    ]


def tensors(state: Mapping[str, object]) -> dict[str, Tensor]:
    """A state dict's values, checked to be tensors (DTensors stay DTensors)."""
    found: dict[str, Tensor] = {}
    for name, value in state.items():
        assert isinstance(value, Tensor), name
        found[name] = value
    return found


def local_tensors(state: Mapping[str, object]) -> dict[str, Tensor]:
    """A sharded state dict's DTensors, as this rank's local tensors."""
    found: dict[str, Tensor] = {}
    for name, value in state.items():
        assert isinstance(value, DTensor), name
        found[name] = value.to_local()
    return found


def placements(state: Mapping[str, object]) -> list[tuple[str, str]]:
    """A sharded state dict's names and placements."""
    return [
        (name, str(value.placements)) for name, value in state.items() if isinstance(value, DTensor)
    ]


def norm_value(norm: Tensor) -> float:
    """``clip_grad_norm_``'s result as a float: the full norm if it is a DTensor."""
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def train_side_by_side(
    models: Sequence[nn.Module],
    loss_of: Callable[[nn.Module, Tensor], Tensor],
    batch_of: Callable[[int, int], Tensor],
    dp_rank: int,
    steps: int,
) -> dict[str, Any]:
    """AdamW steps on both models; losses, gradient gaps and clip_grad_norm_ of each step."""
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in models]
    results: dict[str, Any] = {"losses": [], "gradient_gap": 0.0, "norms": []}
    for step in range(steps):
        batch = batch_of(dp_rank, step)
        losses = [loss_of(model, batch) for model in models]
        for loss in losses:
            torch.autograd.backward(loss)
        results["losses"].append(tuple(loss.item() for loss in losses))
        gap = largest_gap(full_gradients(models[0]), full_gradients(models[1]))
        results["gradient_gap"] = max(results["gradient_gap"], gap)
        norms = [
            torch.nn.utils.clip_grad_norm_(two_dimensional(model), max_norm=0.05)
            for model in models
        ]
        results["norms"].append(tuple(norm_value(norm) for norm in norms))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    results["parameter_gap"] = largest_gap(full_parameters(models[0]), full_parameters(models[1]))
    return results
