# torch leaves manual_seed's seed and the schedules' step() partly unannotated.
# pyright: reportUnknownMemberType=false
"""Pipeline parallelism over stages sharded by fully_shard: 4 CPU processes, a (pp, dp) mesh.

Run: ``torchrun --standalone --nproc-per-node 4 examples/pipeline_parallel.py``. Each of
the 2 pipeline ranks holds one stage of a small MLP, sharded over its 2 data-parallel
ranks; ``Schedule1F1B`` runs 4 microbatches per step. The code is what it would be
with PyTorch's ``fully_shard``, the import aside.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from torchcontract.apis import fully_shard

STEPS, MICROBATCHES, DIM = 3, 4, 16


def stage_module(index: int) -> nn.Sequential:
    torch.manual_seed(index)  # the same stage on both of its data-parallel ranks
    return nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()

    module = stage_module(pp_rank)
    for layer in (module[0], module[2]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(module, mesh=mesh["dp"])
    stage = PipelineStage(module, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)

    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step * 10 + dp_rank)  # dp ranks: own data
        inputs, target = torch.randn(8, DIM, generator=generator), torch.zeros(8, DIM)
        losses: list[torch.Tensor] = []
        if pp_rank == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=target, losses=losses)
            if dp_rank == 0:
                print(f"step {step}: loss {torch.stack(losses).mean().item():.4f}")
        optimizer.step()
        optimizer.zero_grad()
    # Every rank done with every group before any is taken down: torch 2.6's gloo can hang
    # destroying a group whose threads still hold the last collective's tensors.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
