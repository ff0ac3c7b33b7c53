# torch leaves manual_seed's seed and the optimizer's step() partly unannotated.
# pyright: reportUnknownMemberType=false
"""Train with fully_shard or replicate on GPUs: one process per GPU, started by torchrun.

Run: ``torchrun --standalone --nproc-per-node 2 examples/train_on_gpus.py fully_shard``
(or ``replicate``), with ``--nproc-per-node`` the number of GPUs. Each process takes
the GPU of its ``LOCAL_RANK`` and talks to the others over NCCL. On a machine without
CUDA the same script runs on the CPU over gloo, which is how the project's tests run it.
Rank 0 prints its loss after each step; both APIs print the same losses.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from torchcontract.apis import fully_shard, replicate

STEPS = 5
WIDTH = 64


def pick_device() -> torch.device:
    """This process's GPU (``LOCAL_RANK``, set by torchrun), or the CPU where there is no CUDA."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)  # before anything touches CUDA: NCCL uses this device
    return device


def build_model() -> nn.Sequential:
    """The same model on every rank: the seed is the same everywhere."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(4)))


def parallelize(model: nn.Sequential, api: str, device: torch.device) -> nn.Sequential:
    """``model`` sharded (FSDP2's way) or replicated (DDP's way) over every process."""
    if api == "fully_shard":
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model:
            fully_shard(block, mesh=mesh)  # each block gathered for its own forward and backward
        fully_shard(model, mesh=mesh)
        return model
    if api == "replicate":
        if device.type == "cuda":
            # As DDP on a GPU: the one device this process's model and inputs are on.
            return replicate(model, device_ids=[device.index])
        return replicate(model)
    raise SystemExit(f"usage: train_on_gpus.py fully_shard|replicate (got {api!r})")


def main() -> None:
    api = sys.argv[1] if len(sys.argv) > 1 else "fully_shard"
    device = pick_device()
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = parallelize(build_model().to(device), api, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator(device=device).manual_seed(rank)  # each rank its own batches
    for step in range(STEPS):
        inputs = torch.randn(8, WIDTH, device=device, generator=generator)
        loss = nn.functional.mse_loss(model(inputs), inputs.flip(1))
        torch.autograd.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"{api} step {step} loss {loss.item():.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
