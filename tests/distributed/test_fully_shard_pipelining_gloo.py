"""torch's pipeline schedules over stages sharded by fully_shard, against FSDP2's, on 4 gloo ranks.

A ``(pp, dp)`` mesh of 2 x 2: each stage's module is sharded over ``dp``
(its inner layer, then the stage), ``PipelineStage`` runs it on its ``pp`` rank,
and each schedule trains it for a few steps of 4 microbatches, once with ours and
once with PyTorch's ``fully_shard``, from the same seed and on the same data.
Losses and every parameter must agree. The schedules end each step by reading
FSDP2's state (``PipelineStage.perform_reduce_grad``), which finds ours there
(``apis/fully_shard/_torch_state.py``). The same job accumulates gradients over
two steps, clips them by their norm across stages, and saves and loads the
pipelined model through DCP. One launch for all of it: 4 ranks share the cores.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fully_shard_models import needs_reference_fully_shard
from pages import DOCS, run_shown_torchrun
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from torchcontract.apis import fully_shard
from torchcontract.testing import run_distributed

Results = dict[str, Any]
Apply = Callable[..., Any]

#: Every schedule that runs on CPU and gloo with PyTorch's fully_shard.
SCHEDULES = (
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleLoopedBFS",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)
DIM, BATCH, MICROBATCHES, STEPS, PP, TOLERANCE = 5, 8, 4, 3, 2, 1e-6
#: The width with tensor parallelism: the tp ranks split it evenly.
TP_DIM = 6

pytestmark = needs_reference_fully_shard


class Stage(nn.Module):
    """One stage: two layers, the inner one sharded on its own (sizes odd: uneven shards)."""

    def __init__(self, width: int = DIM) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.outer = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.outer(torch.tanh(self.inner(x)))
        return out


def _mse(output: Tensor, target: Tensor) -> Tensor:
    return ((output - target) ** 2).mean()


def _stage_indices(name: str, pp_rank: int) -> list[int]:
    """The stages this ``pp`` rank runs: one, two looped, or two in a V."""
    schedule = getattr(schedules, name)
    if not issubclass(schedule, schedules.PipelineScheduleMulti):
        return [pp_rank]
    if name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        return [pp_rank, 2 * PP - 1 - pp_rank]
    return [pp_rank, pp_rank + PP]


class Pipeline:
    """The stages of one ``pp`` rank, sharded over ``dp`` by ``apply``, and their schedule."""

    def __init__(self, mesh: DeviceMesh, name: str, apply: Apply) -> None:
        self.indices = _stage_indices(name, mesh["pp"].get_local_rank())
        count = PP * (2 if len(self.indices) == 2 else 1)
        self.last = count - 1
        self.modules: list[Stage] = []
        stages: list[PipelineStage] = []
        tensor_parallel = "tp" in (mesh.mesh_dim_names or ())
        self.width = TP_DIM if tensor_parallel else DIM
        for index in self.indices:
            torch.manual_seed(index)
            module = Stage(self.width)
            if tensor_parallel:
                plan = {"inner": ColwiseParallel(), "outer": RowwiseParallel()}
                parallelize_module(module, mesh["tp"], plan)
            apply(module.inner, mesh=mesh["dp"])
            apply(module, mesh=mesh["dp"])
            self.modules.append(module)
            stages.append(
                PipelineStage(
                    module, index, count, torch.device("cpu"), group=mesh["pp"].get_group()
                )
            )
        schedule = getattr(schedules, name)
        multi = issubclass(schedule, schedules.PipelineScheduleMulti)
        self.schedule = schedule(
            stages if multi else stages[0], n_microbatches=MICROBATCHES, loss_fn=_mse
        )
        self.parameters = [p for module in self.modules for p in module.parameters()]
        self.optimizer = torch.optim.SGD(self.parameters, lr=0.1)
        self.dp_rank = mesh["dp"].get_local_rank()

    def step(self, step: int) -> list[float]:
        """One schedule step on this ``dp`` rank's batch; the microbatches' losses, if last."""
        generator = torch.Generator().manual_seed(100 * step + self.dp_rank)
        inputs = torch.randn(BATCH, self.width, generator=generator)
        target = torch.randn(BATCH, self.width, generator=generator)
        losses: list[Tensor] = []
        args = (inputs,) if 0 in self.indices else ()
        if self.last in self.indices:
            self.schedule.step(*args, target=target, losses=losses)
        else:
            self.schedule.step(*args)
        return [float(loss.detach()) for loss in losses]

    def full_parameters(self) -> dict[str, Tensor]:
        return {
            f"{index}.{name}": _full(parameter).detach().clone()
            for index, module in zip(self.indices, self.modules, strict=True)
            for name, parameter in module.named_parameters()
        }

    def full_gradients(self) -> dict[str, Tensor]:
        return {
            f"{index}.{name}": _full(parameter.grad).clone()
            for index, module in zip(self.indices, self.modules, strict=True)
            for name, parameter in module.named_parameters()
            if parameter.grad is not None
        }

    def state_dict(self) -> dict[str, Any]:
        """Every stage's state dict, its keys prefixed with the stage (unique across ``pp``)."""
        return {
            f"stage{index}.{name}": value
            for index, module in zip(self.indices, self.modules, strict=True)
            for name, value in module.state_dict().items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for index, module in zip(self.indices, self.modules, strict=True):
            prefix = f"stage{index}."
            module.load_state_dict(
                {
                    key[len(prefix) :]: value
                    for key, value in state.items()
                    if key.startswith(prefix)
                }
            )


def _full(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _gap(mine: dict[str, Tensor], theirs: dict[str, Tensor]) -> float:
    assert mine
    assert mine.keys() == theirs.keys()
    return max(float((mine[name] - theirs[name]).abs().max()) for name in mine)


def _losses_gap(mine: list[list[float]], theirs: list[list[float]]) -> float:
    assert len(mine) == len(theirs)
    pairs = [pair for a, b in zip(mine, theirs, strict=True) for pair in zip(a, b, strict=True)]
    return max((abs(a - b) for a, b in pairs), default=0.0)


def _train(mesh: DeviceMesh, name: str) -> Results:
    """``STEPS`` optimizer steps of ``name``, ours and PyTorch's; the gaps and what moved."""
    runs = {}
    for api, apply in (("ours", fully_shard), ("torch", torch_fully_shard)):
        pipeline = Pipeline(mesh, name, apply)
        before = pipeline.full_parameters()
        losses = []
        for step in range(STEPS):
            losses.append(pipeline.step(step))
            pipeline.optimizer.step()
            pipeline.optimizer.zero_grad()
        runs[api] = (losses, before, pipeline.full_parameters())
    (mine, start, mine_after), (theirs, _, theirs_after) = runs["ours"], runs["torch"]
    return {
        "loss_gap": _losses_gap(mine, theirs),
        "losses": sum(len(each) for each in mine),
        "parameter_gap": _gap(mine_after, theirs_after),
        "moved": _gap(mine_after, start),
    }


def _accumulate(mesh: DeviceMesh) -> Results:
    """Two schedule steps before one optimizer step: gradients add up across steps."""
    first, gradients, parameters = {}, {}, {}
    for api, apply in (("ours", fully_shard), ("torch", torch_fully_shard)):
        pipeline = Pipeline(mesh, "Schedule1F1B", apply)
        pipeline.step(0)
        first[api] = pipeline.full_gradients()
        pipeline.step(1)
        gradients[api] = pipeline.full_gradients()
        pipeline.optimizer.step()
        parameters[api] = pipeline.full_parameters()
    return {
        "gradient_gap": _gap(gradients["ours"], gradients["torch"]),
        "first_gap": _gap(first["ours"], first["torch"]),
        "parameter_gap": _gap(parameters["ours"], parameters["torch"]),
        "accumulated": _gap(gradients["ours"], first["ours"]),
    }


def _clip_across_stages(pipeline: Pipeline, mesh: DeviceMesh, max_norm: float) -> float:
    """Clip the gradients by their norm over every stage and ``dp`` rank (as torchtitan does)."""
    grads = [p.grad for p in pipeline.parameters if p.grad is not None]
    norm = _full(torch.nn.utils.get_total_norm(grads, 2.0))
    squared = norm**2
    dist.all_reduce(squared, group=mesh["pp"].get_group())
    total = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_(pipeline.parameters, max_norm, total)
    return float(total)


def _clip(mesh: DeviceMesh) -> Results:
    norms, parameters = {}, {}
    for api, apply in (("ours", fully_shard), ("torch", torch_fully_shard)):
        pipeline = Pipeline(mesh, "ScheduleInterleaved1F1B", apply)
        pipeline.step(0)
        norms[api] = _clip_across_stages(pipeline, mesh, max_norm=0.05)
        pipeline.optimizer.step()
        parameters[api] = pipeline.full_parameters()
    return {
        "norm": norms["ours"],
        "norm_gap": abs(norms["ours"] - norms["torch"]),
        "parameter_gap": _gap(parameters["ours"], parameters["torch"]),
    }


def _checkpoint(mesh: DeviceMesh, directory: str) -> Results:
    """Train, save through DCP, load into fresh stages of both APIs, train on as one."""
    trained = Pipeline(mesh, "Schedule1F1B", fully_shard)
    trained.step(0)
    trained.optimizer.step()
    trained.optimizer.zero_grad()
    dcp_save(trained.state_dict(), checkpoint_id=directory)
    saved = trained.full_parameters()
    loaded: dict[str, Pipeline] = {}
    for api, apply in (("ours", fully_shard), ("torch", torch_fully_shard)):
        fresh = Pipeline(mesh, "Schedule1F1B", apply)
        state = fresh.state_dict()
        dcp_load(state, checkpoint_id=directory)
        fresh.load_state_dict(state)
        loaded[api] = fresh
    gaps = {api: _gap(pipeline.full_parameters(), saved) for api, pipeline in loaded.items()}
    losses = {api: pipeline.step(1) for api, pipeline in loaded.items()}
    losses["trained"] = trained.step(1)
    sharded = all(isinstance(p, DTensor) for p in loaded["ours"].parameters)
    return {
        "loaded_gap": max(gaps.values()),
        "loss_gap": max(
            _losses_gap([losses[api]], [losses["trained"]]) for api in ("ours", "torch")
        ),
        "sharded": sharded,
    }


def _job(rank: int, world_size: int, directory: str) -> Results:
    mesh = init_device_mesh("cpu", (PP, world_size // PP), mesh_dim_names=("pp", "dp"))
    results: Results = {name: _train(mesh, name) for name in SCHEDULES}
    results["accumulation"] = _accumulate(mesh)
    results["clipping"] = _clip(mesh)
    results["checkpoint"] = _checkpoint(mesh, directory)
    results["pp_rank"] = mesh["pp"].get_local_rank()
    return results


def _tensor_parallel_job(rank: int, world_size: int) -> Results:
    mesh = init_device_mesh("cpu", (PP, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    return {name: _train(mesh, name) for name in ("Schedule1F1B", "ScheduleInterleaved1F1B")}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Results]:
    directory: Path = tmp_path_factory.mktemp("pipelined_checkpoint")
    return run_distributed(_job, 4, timeout=300.0, args=(str(directory),))


@pytest.mark.parametrize("name", SCHEDULES)
def test_schedule_trains_sharded_stages_as_torch_fully_shard(
    ranks: list[Results], name: str
) -> None:
    for result in ranks:
        assert result[name]["loss_gap"] <= TOLERANCE
        assert result[name]["parameter_gap"] <= TOLERANCE
        assert result[name]["moved"] > 1e-3  # every rank's stages trained
    assert sum(result[name]["losses"] for result in ranks) == 2 * STEPS * MICROBATCHES


def test_gradients_accumulate_across_schedule_steps_as_torch_fully_shard(
    ranks: list[Results],
) -> None:
    for result in ranks:
        assert result["accumulation"]["first_gap"] <= TOLERANCE
        assert result["accumulation"]["gradient_gap"] <= TOLERANCE
        assert result["accumulation"]["parameter_gap"] <= TOLERANCE
        assert result["accumulation"]["accumulated"] > 1e-3  # two steps' sum, not one's


def test_clipping_by_the_norm_across_stages_matches_torch_fully_shard(
    ranks: list[Results],
) -> None:
    norms = {round(result["clipping"]["norm"], 6) for result in ranks}
    assert len(norms) == 1  # one norm on every rank
    assert norms.pop() > 0.05  # above the limit: it clips
    for result in ranks:
        assert result["clipping"]["norm_gap"] <= TOLERANCE
        assert result["clipping"]["parameter_gap"] <= TOLERANCE


def test_a_pipelined_sharded_model_round_trips_through_dcp(ranks: list[Results]) -> None:
    for result in ranks:
        assert result["checkpoint"]["loaded_gap"] == 0.0  # into ours and into torch's
        assert result["checkpoint"]["loss_gap"] <= TOLERANCE
        assert result["checkpoint"]["sharded"]


@pytest.mark.slow
def test_schedules_train_stages_with_tensor_parallelism_as_torch_fully_shard() -> None:
    """A (pp, dp, tp) mesh of 2 x 2 x 2: each stage's TP-local tensors sharded over dp."""
    for result in run_distributed(_tensor_parallel_job, 8, timeout=400.0):
        for name, gaps in result.items():
            assert gaps["loss_gap"] <= TOLERANCE, name
            assert gaps["parameter_gap"] <= TOLERANCE, name
            assert gaps["moved"] > 1e-3, name


@pytest.mark.slow
def test_the_pages_torchrun_example_trains() -> None:
    """The command docs/fully-shard.md shows, as it shows it: 4 processes, losses going down."""
    losses = run_shown_torchrun(
        DOCS / "fully-shard.md", "examples/pipeline_parallel.py", timeout=240.0
    )
    assert len(losses) == 3
    assert losses[-1] < losses[0]
