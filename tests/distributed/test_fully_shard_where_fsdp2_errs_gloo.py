"""Where FSDP2's numbers are not the exact ones, and fully_shard's are: two rows of the differences.

Both on 2 gloo ranks, FSDP2 run beside on the same model and data, each side also run
without the step in question, or against gradients averaged by hand:

- ``unshard(async_op=True)``, then ``reshard()`` before waiting, then an optimizer step,
  then a forward: FSDP2 keeps the pending all-gather and its next forward uses what it
  gathered, the parameters before the step; fully_shard drops it and gathers the
  parameters as they are.
- HSDP with ``set_requires_all_reduce(False)`` on a micro-batch that uses one layer and
  ``True`` on one that uses another of the same shape: FSDP2 adds its deferred partial
  sums to the next reduction as one flat buffer, by position, so one layer's lands in
  the other's gradient; fully_shard keeps them per parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, cast

import pytest
import torch
import torch.distributed as dist
from fully_shard_models import needs_reference_fully_shard
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from torchcontract.apis import fully_shard
from torchcontract.testing import run_distributed

pytestmark = needs_reference_fully_shard

Apply = Callable[..., Any]
APPLIES: Final[dict[str, Apply]] = {"ours": fully_shard, "FSDP2": torch_fully_shard}


def _batch(rank: int, step: int) -> Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * rank + step))


def _second_loss(apply: Apply, mesh: DeviceMesh, rank: int, unshard_first: bool) -> float:
    """A step, then the next forward's loss; with ``unshard_first`` the block's async
    unshard and reshard come between the backward and the step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    apply(model[0], mesh=mesh)
    apply(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.autograd.backward(cast(Tensor, model(_batch(rank, 0))).pow(2).mean())
    if unshard_first:
        cast(Any, model[0]).unshard(async_op=True)
        cast(Any, model[0]).reshard()
    optimizer.step()
    optimizer.zero_grad()
    return float(cast(Tensor, model(_batch(rank, 1))).pow(2).mean())


class Branches(nn.Module):
    """Two layers of one shape; a micro-batch uses one of them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)

    def forward(self, x: Tensor, use_a: bool) -> Tensor:
        out: Tensor = self.a(x) if use_a else self.b(x)
        return out


def _micro_batch(rank: int, index: int) -> Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + index))


def _deferred_gradients(apply: Apply | None, mesh: DeviceMesh, rank: int) -> list[Tensor]:
    """Both layers' gradients after the two micro-batches (``a``'s all-reduce deferred);
    without ``apply``, the exact ones: summed locally, averaged by hand."""
    torch.manual_seed(0)
    model = Branches()
    if apply is not None:
        apply(model, mesh=mesh)
    for index, use_a in enumerate((True, False)):
        if apply is not None:
            cast(Any, model).set_requires_all_reduce(index == 1)
        torch.autograd.backward(model(_micro_batch(rank, index), use_a).pow(2).sum())
    gradients = []
    for parameter in model.parameters():
        grad = parameter.grad
        if grad is None:
            gradients.append(torch.zeros(tuple(parameter.shape)))
        elif isinstance(grad, DTensor):
            gradients.append(grad.full_tensor())
        else:
            averaged = grad.clone()
            dist.all_reduce(averaged)
            gradients.append(averaged / dist.get_world_size())
    return gradients


def _job(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    hsdp = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    exact = _deferred_gradients(None, hsdp, rank)
    return {
        "stale": {
            name: (_second_loss(apply, mesh, rank, True), _second_loss(apply, mesh, rank, False))
            for name, apply in APPLIES.items()
        },
        "deferred": {
            name: all(map(torch.equal, _deferred_gradients(apply, hsdp, rank), exact))
            for name, apply in APPLIES.items()
        },
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_job, 2, timeout=120.0)


def test_a_reshard_before_an_async_unshard_was_waited_for_drops_it(
    ranks: list[dict[str, Any]],
) -> None:
    for rank in ranks:
        ours, theirs = rank["stale"]["ours"], rank["stale"]["FSDP2"]
        assert ours[0] == ours[1]  # the step's parameters, as without the unshard
        assert theirs[1] == ours[1]
        assert theirs[0] != theirs[1]  # FSDP2's: the parameters before the step


def test_deferred_all_reduces_of_different_parameters_stay_with_their_own(
    ranks: list[dict[str, Any]],
) -> None:
    for rank in ranks:
        assert rank["deferred"] == {"ours": True, "FSDP2": False}
