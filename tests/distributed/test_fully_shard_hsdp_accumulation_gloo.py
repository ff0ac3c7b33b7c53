"""HSDP accumulation with ``set_requires_all_reduce(False)`` against FSDP2's, on 4 gloo ranks.

Micro-batches with the all-reduce off reduce-scatter only; FSDP2 keeps their
reduced shards and adds them to those of the backward that turns it back on, which
all-reduces once over the replicas. All-reducing every micro-batch gives nearly the
same sum (other roundings) with three times the traffic, so the all-reduces each
issues are recorded (``apis._torch.all_reduce`` for ours, ``torch.distributed``'s
for FSDP2), and the gradients are compared after every micro-batch: FSDP2 leaves
``.grad`` unset until the all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import pytest
import torch
from fully_shard_models import (
    batch,
    full_gradients,
    full_parameters,
    largest_gap,
    loss_on,
    needs_reference_fully_shard,
    sharded_gpt,
)
from fully_shard_recorder import recording_all_reduces
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from torchcontract.apis import fully_shard
from torchcontract.testing import run_distributed

pytestmark = needs_reference_fully_shard

STEPS: Final = 3
MICRO: Final = 3
TOLERANCE: Final = 1e-6
Results = dict[str, Any]


def _accumulate(rank: int, mesh: DeviceMesh, apply: Callable[..., Any]) -> Results:
    """3 AdamW steps of 3 micro-batches, the all-reduce on for the last only."""
    model = sharded_gpt(apply, mesh)
    assert isinstance(model, FSDPModule)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per_step: list[list[int]] = []
    grads_unset: list[bool] = []
    gradients: list[dict[str, Tensor]] = []
    for step in range(STEPS):
        issued: list[int] = []
        with recording_all_reduces(issued):
            for micro in range(MICRO):
                model.set_requires_all_reduce(micro == MICRO - 1)
                torch.autograd.backward(loss_on(model, *batch(rank, 10 * step + micro)))
                if micro < MICRO - 1:
                    grads_unset.append(all(p.grad is None for p in model.parameters()))
        per_step.append(issued)
        gradients.append(full_gradients(model))
        optimizer.step()
        optimizer.zero_grad()
    return {
        "per_step": per_step,
        "grads_unset": grads_unset,
        "gradients": gradients,
        "parameters": full_parameters(model),
    }


def _job(rank: int, world_size: int) -> Results:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.use_deterministic_algorithms(True)
    ours = _accumulate(rank, mesh, fully_shard)
    theirs = _accumulate(rank, mesh, torch_fully_shard)
    return {
        "per_step": (ours["per_step"], theirs["per_step"]),
        "grads_unset": (ours["grads_unset"], theirs["grads_unset"]),
        "gradient_gap": max(
            largest_gap(mine, reference)
            for mine, reference in zip(ours["gradients"], theirs["gradients"], strict=True)
        ),
        "parameter_gap": largest_gap(ours["parameters"], theirs["parameters"]),
    }


@pytest.fixture(scope="module")
def ranks() -> list[Results]:
    return run_distributed(_job, 4, timeout=240.0)


def test_all_reduce_off_defers_it_to_the_step_that_turns_it_on_as_torch(
    ranks: list[Results],
) -> None:
    for found in ranks:
        ours, theirs = found["per_step"]
        assert ours == theirs
        assert [len(issued) for issued in ours] == [3] * STEPS  # one per group, per step


def test_gradients_stay_unset_until_the_all_reduce_as_torch(ranks: list[Results]) -> None:
    for found in ranks:
        ours, theirs = found["grads_unset"]
        assert ours == theirs == [True] * (STEPS * (MICRO - 1))


def test_deferred_all_reduce_gives_torch_numbers(ranks: list[Results]) -> None:
    for found in ranks:
        assert found["gradient_gap"] <= TOLERANCE
        assert found["parameter_gap"] <= TOLERANCE
