# torch leaves manual_seed's seed and the optimizer's step() partly unannotated.
# pyright: reportUnknownMemberType=false
"""Tensor parallelism under fully_shard: 4 CPU processes, a (dp, tp) mesh of 2 x 2.

Run: ``torchrun --standalone --nproc-per-node 4 examples/tensor_parallel.py``. Each
block's ``up`` projection is split column-wise and ``down`` row-wise over ``tp``
(``parallelize_module``); ``fully_shard`` then shards each rank's TP-local tensors
over ``dp``. The code is what it would be with PyTorch's ``fully_shard``, the import
aside.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from torchcontract.apis import fully_shard

STEPS = 3


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.relu(self.up(x)))
        return out


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # the same model on every rank
    model = nn.Sequential(MLP(), MLP())
    for block in model:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])  # each TP-local tensor sharded over dp
    fully_shard(model, mesh=mesh["dp"])

    first = model[0]
    assert isinstance(first, MLP)
    up, down = first.up.weight, first.down.weight
    assert isinstance(up, DTensor)
    assert isinstance(down, DTensor)
    assert up.device_mesh.mesh_dim_names == ("dp", "tp")
    assert str(up.placements) == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"  # rows: tp, then dp
    assert down.placements == (Shard(0), Shard(1))
    assert up.to_local().shape == (8, 8)  # a quarter each
    assert down.to_local().shape == (4, 16)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # The ranks of one tp group see the same batch; the dp groups see their own.
    generator = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
    inputs, targets = torch.randn(4, 8, generator=generator), torch.zeros(4, 8)
    for step in range(STEPS):
        loss = nn.functional.mse_loss(model(inputs), targets)
        torch.autograd.backward(loss)  # gathers and reduce-scatters over dp only
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # over the 2-D shards
        optimizer.step()
        optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    # Every rank done with every group before any is taken down: torch 2.6's gloo can hang
    # destroying a group whose threads still hold the last collective's tensors.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
