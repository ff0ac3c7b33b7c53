"""The demo GPT sharded per block then at the root, and its training step, for the
fully_shard benchmarks: each library shards and steps the same model the same way."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn import functional

from torchcontract.apis import fully_shard
from torchcontract.demo import GPT, GPTConfig

#: The library whose fully_shard ``sharded_gpt`` applies for this name; ours otherwise.
TORCH = "torch"


def sharded_gpt(
    config: GPTConfig,
    library: str,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> GPT:
    """A GPT from seed 0, each block sharded, then the root, by ``library``'s fully_shard.

    ``mp_policy``: FSDP2's mixed precision for both (none by default).
    """
    torch.manual_seed(0)
    model = GPT(config)
    policy = MixedPrecisionPolicy() if mp_policy is None else mp_policy
    for module in [*model.blocks, model]:
        if library == TORCH:
            torch_fully_shard(module, mesh=mesh, mp_policy=policy)
        else:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    return model


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, tokens: Tensor, targets: Tensor
) -> None:
    """Forward, cross-entropy, backward and an optimizer step."""
    logits: Tensor = model(tokens)
    loss = functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    torch.autograd.backward(loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
