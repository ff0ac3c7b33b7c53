"""Zero-bubble and dual-pipe schedules with torchtitan's chunked loss, against FSDP2, on 4 ranks.

torchtitan's chunked loss runs the model's head itself: the last stage's forward
stops after the final norm, and the loss runs the head (sharded with the norm as
one list, ``fully_shard([norm, output])``) on one chunk of the hidden states at
a time, calling ``backward()`` on each chunk's loss, then hands the schedule a
loss whose backward carries the chunks' gradient into the stage. Those backwards
run in the middle of the schedule, before the stage's own input and weight
backwards: they must leave the stage's gathered parameters in place, as FSDP2's
do, or a microbatch's weight gradient is lost. The head sharded alone is checked
too: its backwards then end with the end-of-backward callback, as FSDP2's. A
``(pp, dp)`` mesh of 2 x 2; ours and PyTorch's ``fully_shard`` from the same seed,
on the same data, under torchtitan's policy for pipelining (nothing reshards after
forward); gradients and parameters must be equal to the bit after every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, cast

import pytest
import torch
from fully_shard_models import needs_reference_fully_shard
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.tensor import DTensor

from torchcontract.apis import fully_shard
from torchcontract.testing import run_distributed

Results = dict[str, Any]
#: One rank's results, by schedule and whether the norm and head are one list.
Runs = dict[tuple[str, bool], Results]
Apply = Callable[..., Any]

#: The schedules that split a stage's backward into input and weight backwards.
SCHEDULES = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
DIM, BATCH, MICROBATCHES, STEPS, PP, CHUNKS = 5, 8, 4, 3, 2, 2

pytestmark = needs_reference_fully_shard


class Stage(nn.Module):
    """Two layers, the inner one sharded on its own; the last stage ends as torchtitan's.

    There, a norm and the output head are sharded as one group; the stage's forward
    runs the norm and stops before the head, which the loss runs.
    """

    def __init__(self, *, last: bool) -> None:
        super().__init__()
        self.inner = nn.Linear(DIM, DIM)
        self.outer = nn.Linear(DIM, DIM)
        self.norm = nn.RMSNorm(DIM) if last else None
        self.output = nn.Linear(DIM, DIM) if last else None

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.outer(torch.tanh(self.inner(x)))
        return out if self.norm is None else self.norm(out)


class _CarryGradient(torch.autograd.Function):
    """Returns the chunks' loss; its backward hands the hidden states the chunks' gradient."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, gradient: Tensor, loss: Tensor) -> Tensor:
        ctx.save_for_backward(gradient)
        return loss.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None, None]:
        (gradient,) = ctx.saved_tensors
        return gradient * grad_output, None, None


_carry_gradient: Final = cast(Callable[..., Tensor], _CarryGradient.apply)


class ChunkedLoss:
    """torchtitan's chunked loss: the head per chunk, each chunk's backward at once."""

    def __init__(self, head: nn.Module) -> None:
        self.head = head

    def __call__(self, hidden: Tensor, target: Tensor) -> Tensor:
        head = self.head
        sharded = head if isinstance(head, FSDPModule) else None
        detached = hidden.detach().requires_grad_()
        total = torch.zeros(())
        if sharded is not None:  # the head's weights stay gathered over the chunks
            sharded.set_reshard_after_forward(False)
            sharded.set_reshard_after_backward(False)
            sharded.set_requires_gradient_sync(False, recurse=False)
        gradients = []
        chunks = [chunk.detach().requires_grad_() for chunk in detached.chunk(CHUNKS)]
        for index, (chunk, chunk_target) in enumerate(
            zip(chunks, target.chunk(CHUNKS), strict=True)
        ):
            if sharded is not None and index == CHUNKS - 1:
                sharded.set_requires_gradient_sync(True, recurse=False)
            loss = ((head(chunk) - chunk_target) ** 2).mean() / CHUNKS
            loss.backward()
            total = total + loss.detach()
            assert chunk.grad is not None
            gradients.append(chunk.grad)
        if sharded is not None:
            sharded.set_reshard_after_forward(True)
            sharded.set_reshard_after_backward(True)
            sharded.set_requires_gradient_sync(True, recurse=False)
            sharded.reshard()
        return _carry_gradient(hidden, torch.cat(gradients), total)


def _elsewhere(output: Tensor, target: Tensor) -> Tensor:
    """The loss of a rank without the last stage: never run, but a schedule without a
    loss runs no backward at all."""
    raise AssertionError("the loss runs only where the last stage is")


def _stage_indices(name: str, pp_rank: int) -> list[int]:
    if name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        return [pp_rank, 2 * PP - 1 - pp_rank]
    return [pp_rank, pp_rank + PP]


class Pipeline:
    """The two stages of one ``pp`` rank, sharded over ``dp`` by ``apply``, and their schedule."""

    def __init__(self, mesh: DeviceMesh, name: str, apply: Apply, *, listed: bool) -> None:
        self.indices = _stage_indices(name, mesh["pp"].get_local_rank())
        self.last = 2 * PP - 1
        self.modules: list[Stage] = []
        stages: list[PipelineStage] = []
        loss: ChunkedLoss | None = None
        for index in self.indices:
            torch.manual_seed(index)
            module = Stage(last=index == self.last)
            # torchtitan's "default" policy under pipelining: nothing reshards after forward.
            apply(module.inner, mesh=mesh["dp"], reshard_after_forward=False)
            if module.norm is not None and module.output is not None:
                head = [module.norm, module.output] if listed else module.output
                apply(head, mesh=mesh["dp"], reshard_after_forward=False)
                loss = ChunkedLoss(module.output)
            apply(module, mesh=mesh["dp"])
            self.modules.append(module)
            stages.append(
                PipelineStage(
                    module, index, 2 * PP, torch.device("cpu"), group=mesh["pp"].get_group()
                )
            )
        self.schedule = getattr(schedules, name)(
            stages, n_microbatches=MICROBATCHES, loss_fn=loss or _elsewhere
        )
        self.parameters = [p for module in self.modules for p in module.parameters()]
        self.optimizer = torch.optim.SGD(self.parameters, lr=0.1)
        self.dp_rank = mesh["dp"].get_local_rank()

    def step(self, step: int) -> list[float]:
        generator = torch.Generator().manual_seed(100 * step + self.dp_rank)
        inputs = torch.randn(BATCH, DIM, generator=generator)
        target = torch.randn(BATCH, DIM, generator=generator)
        losses: list[Tensor] = []
        args = (inputs,) if 0 in self.indices else ()
        if self.last in self.indices:
            self.schedule.step(*args, target=target, losses=losses)
        else:
            self.schedule.step(*args)
        return [float(loss.detach()) for loss in losses]

    def named(self, attribute: str) -> dict[str, Tensor]:
        found = {}
        for index, module in zip(self.indices, self.modules, strict=True):
            for name, parameter in module.named_parameters():
                value = parameter if attribute == "data" else parameter.grad
                if value is not None:
                    full = value.full_tensor() if isinstance(value, DTensor) else value
                    found[f"{index}.{name}"] = full.detach().clone()
        return found


def _train(mesh: DeviceMesh, name: str, *, listed: bool) -> Results:
    runs = {}
    for api, apply in (("ours", fully_shard), ("torch", torch_fully_shard)):
        pipeline = Pipeline(mesh, name, apply, listed=listed)
        losses, gradients = [], []
        for step in range(STEPS):
            losses.append(pipeline.step(step))
            gradients.append(pipeline.named("grad"))
            pipeline.optimizer.step()
            pipeline.optimizer.zero_grad()
        runs[api] = (losses, gradients, pipeline.named("data"))
    (losses, gradients, parameters), (their_losses, their_gradients, theirs) = (
        runs["ours"],
        runs["torch"],
    )
    return {
        "losses": losses,
        "their_losses": their_losses,
        "gradient_names": [sorted(each) for each in gradients],
        "their_gradient_names": [sorted(each) for each in their_gradients],
        "unequal_gradients": sorted(
            name
            for ours, torch_ in zip(gradients, their_gradients, strict=True)
            for name in ours.keys() & torch_.keys()
            if not torch.equal(ours[name], torch_[name])
        ),
        "unequal_parameters": sorted(
            name for name in parameters if not torch.equal(parameters[name], theirs[name])
        ),
        "parameter_names": sorted(parameters) == sorted(theirs),
    }


def _job(rank: int, world_size: int) -> Runs:
    mesh = init_device_mesh("cpu", (PP, world_size // PP), mesh_dim_names=("pp", "dp"))
    return {
        (name, listed): _train(mesh, name, listed=listed)
        for name in SCHEDULES
        for listed in (True, False)
    }


@pytest.fixture(scope="module")
def ranks() -> list[Runs]:
    return run_distributed(_job, 4, timeout=300.0)


@pytest.mark.parametrize("listed", [True, False], ids=["norm-and-head-listed", "head-alone"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_a_loss_that_runs_backward_in_the_last_stage_trains_as_torch_fully_shard(
    ranks: list[Runs], name: str, listed: bool
) -> None:
    """The head sharded with the norm as one list (torchtitan's), or alone."""
    for result in ranks:
        run = result[name, listed]
        assert run["losses"] == run["their_losses"]
        assert run["gradient_names"] == run["their_gradient_names"]
        assert run["unequal_gradients"] == []
        assert run["parameter_names"]
        assert run["unequal_parameters"] == []
    assert (
        sum(len(step) for result in ranks for step in result[name, listed]["losses"])
        == 2 * STEPS * MICROBATCHES
    )
