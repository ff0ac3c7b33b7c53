"""``unshard(async_op=True)``, the function and the method, against FSDP2's, on 2 gloo ranks.

The function takes the method's ``async_op`` and returns the same handle. A gather
started so and not waited for before the next forward is that forward's gather, as
in FSDP2: gathering again gives the same numbers, so the all-gathers each step
issues are recorded (``fully_shard_recorder``) and compared with FSDP2's. A save
(``state_dict()``) on one rank while the gather is in flight keeps it, as FSDP2's:
had it dropped it, that rank alone would gather again and fall out of step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import pytest
import torch
from fully_shard_models import (
    batch,
    full_parameters,
    largest_gap,
    loss_on,
    needs_reference_fully_shard,
    sharded_gpt,
)
from fully_shard_recorder import Collective, Recorder
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, UnshardHandle
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from torchcontract.apis import fully_shard, reshard, unshard
from torchcontract.testing import run_distributed

pytestmark = needs_reference_fully_shard

TOLERANCE: Final = 1e-6
Results = dict[str, Any]
Unshard = Callable[[FSDPModule], UnshardHandle | None]


def _fsdp(module: object) -> FSDPModule:
    assert isinstance(module, FSDPModule)
    return module


def _function(module: FSDPModule) -> UnshardHandle | None:
    assert isinstance(module, torch.nn.Module)
    return unshard(module, async_op=True)


def _method(module: FSDPModule) -> UnshardHandle | None:
    return module.unshard(async_op=True)


def _async_states(mesh: DeviceMesh, apply: Callable[..., Any], start: Unshard) -> list[object]:
    """What is registered before and after the handle's wait, and the handle's type."""
    model = sharded_gpt(apply, mesh)
    block = _fsdp(model.blocks[0])
    handle = start(block)
    states: list[object] = [isinstance(handle, UnshardHandle)]
    states.append(isinstance(model.get_parameter("blocks.0.up.weight"), DTensor))
    assert handle is not None
    handle.wait()
    states.append(isinstance(model.get_parameter("blocks.0.up.weight"), DTensor))
    states.append(isinstance(model.norm.weight, DTensor))  # the root is left alone
    if apply is fully_shard:
        reshard(model.blocks[0])
    else:
        block.reshard()
    states.append(isinstance(model.get_parameter("blocks.0.up.weight"), DTensor))
    return states


def _pending_before_forward(
    rank: int, mesh: DeviceMesh, apply: Callable[..., Any], start: Unshard, save: bool = False
) -> tuple[list[list[Collective]], dict[str, Any]]:
    """3 SGD steps, each forward preceded by an unwaited async unshard of the root.

    ``save``: rank 0 alone saves the model (``state_dict()``) while the gather is in
    flight, as torchft's quorum thread saves while a step runs.
    """
    model = sharded_gpt(apply, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = Recorder()
    per_step: list[list[Collective]] = []
    with recorder.recording():
        for step in range(3):
            start(_fsdp(model))  # not waited for: the forward's pre-hook waits
            if save and rank == 0:
                model.state_dict()
            torch.autograd.backward(loss_on(model, *batch(rank, step)))
            optimizer.step()
            optimizer.zero_grad()
            per_step.append([c for c in recorder.collectives if c[0] == "all_gather"])
            recorder.collectives.clear()
    return per_step, full_parameters(model)


def _job(rank: int, world_size: int) -> Results:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.use_deterministic_algorithms(True)
    found: Results = {
        "function": _async_states(mesh, fully_shard, _function),
        "method": _async_states(mesh, fully_shard, _method),
        "theirs": _async_states(mesh, torch_fully_shard, _method),
    }
    runs = {
        "function": _pending_before_forward(rank, mesh, fully_shard, _function),
        "method": _pending_before_forward(rank, mesh, fully_shard, _method),
        "theirs": _pending_before_forward(rank, mesh, torch_fully_shard, _method),
        "saved": _pending_before_forward(rank, mesh, fully_shard, _method, save=True),
        "saved_theirs": _pending_before_forward(rank, mesh, torch_fully_shard, _method, save=True),
    }
    found["gathers"] = {name: gathers for name, (gathers, _) in runs.items()}
    theirs = runs["theirs"][1]
    found["gaps"] = [largest_gap(runs[name][1], theirs) for name in ("function", "method", "saved")]
    return found


@pytest.fixture(scope="module")
def ranks() -> list[Results]:
    return run_distributed(_job, 2, timeout=180.0)


def test_the_unshard_function_takes_async_op_as_the_method_does(ranks: list[Results]) -> None:
    for found in ranks:
        assert found["function"] == found["method"] == found["theirs"]
        assert found["theirs"] == [True, True, False, True, True]


def test_an_unwaited_async_unshard_serves_the_next_forward_as_torch(
    ranks: list[Results],
) -> None:
    for found in ranks:
        gathers = found["gathers"]
        assert gathers["function"] == gathers["method"] == gathers["theirs"]
        # the root once (the unshard), each block in forward and again in backward
        assert [len(step) for step in gathers["theirs"]] == [5, 5, 5]


def test_training_after_async_unshards_matches_torch(ranks: list[Results]) -> None:
    for found in ranks:
        assert max(found["gaps"]) <= TOLERANCE


def test_a_save_on_one_rank_keeps_the_gather_in_flight_as_torch(ranks: list[Results]) -> None:
    """No rank gathers again after rank 0 alone saved: the ranks stay in step, as FSDP2's."""
    for found in ranks:
        gathers = found["gathers"]
        assert gathers["saved"] == gathers["saved_theirs"] == gathers["theirs"]
