"""FSDP2's reduction and gathering settings with tensor parallelism, against FSDP2 on 4 gloo ranks.

``parallelize_module`` on ``mesh["tp"]``, then ``fully_shard`` (ours and FSDP2's, side
by side, same seed and data). HSDP x TP on a (replicate 2, shard 1, tp 2) mesh, where
a replica all-reduce that forgot a dim, or a factor dividing by the wrong size, shows
in the numbers (gloo has no ``PREMUL_SUM``: a shard group of one takes any factor):
``set_requires_all_reduce(False)`` deferring the all-reduce to the last micro-batch
(the all-reduces issued are recorded), ``set_gradient_divide_factor`` and
``set_force_sum_reduction_for_comms`` under a clamping hook. On a (dp 2, tp 2) mesh:
``unshard(async_op=True)`` before each forward, which serves it (the all-gathers are
recorded), and a cast to float64 while unsharded, which reaches the TP shards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import pytest
import torch
from fully_shard_models import (
    fsdp_modules,
    full_gradients,
    full_parameters,
    largest_gap,
    needs_reference_fully_shard,
)
from fully_shard_recorder import Collective, Recorder, recording_all_reduces
from tensor_parallel_models import mlp_batch, mlp_loss, sharded_mlp
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from torchcontract.apis import fully_shard
from torchcontract.testing import run_distributed

pytestmark = needs_reference_fully_shard

STEPS: Final = 2
MICRO: Final = 2
TOLERANCE: Final = 1e-6
CLAMP: Final = 0.01
Results = dict[str, Any]
Configure = Callable[[nn.Module], None]


def _models(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> list[nn.Module]:
    return [sharded_mlp(shard, dp_mesh, tp_mesh) for shard in (fully_shard, torch_fully_shard)]


def _gaps(models: list[nn.Module]) -> tuple[float, float]:
    """The largest gradient and parameter gaps between ours and FSDP2's."""
    gradients = largest_gap(*(full_gradients(model) for model in models))
    return gradients, largest_gap(*(full_parameters(model) for model in models))


def _deferred(dp_rank: int, dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> Results:
    """STEPS SGD steps of MICRO micro-batches, the all-reduce on for the last only."""
    found: Results = {"issued": [], "unset": [], "gradient_gap": 0.0}
    models = _models(dp_mesh, tp_mesh)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in models]
    for step in range(STEPS):
        issued: list[list[int]] = []
        for model in models:
            bytes_sent: list[int] = []
            with recording_all_reduces(bytes_sent):
                for micro in range(MICRO):
                    for module in fsdp_modules(model):
                        module.set_requires_all_reduce(micro == MICRO - 1, recurse=False)
                    torch.autograd.backward(mlp_loss(model, mlp_batch(dp_rank, 10 * step + micro)))
                    if micro < MICRO - 1:
                        found["unset"].append(all(p.grad is None for p in model.parameters()))
            issued.append(bytes_sent)
        found["issued"].append(tuple(issued))
        found["gradient_gap"] = max(found["gradient_gap"], _gaps(models)[0])
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    found["parameter_gap"] = _gaps(models)[1]
    return found


def _clamp(output: Tensor) -> None:
    output.clamp_(-CLAMP, CLAMP)


def _divide_by_3(model: nn.Module) -> None:
    for module in fsdp_modules(model):
        module.set_gradient_divide_factor(3.0)


def _force_sum_clamped(model: nn.Module) -> None:
    for module in fsdp_modules(model):
        module.set_force_sum_reduction_for_comms(True)
        module.set_all_reduce_hook(_clamp)


def _configured(
    dp_rank: int, dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, configure: Configure
) -> tuple[float, float]:
    """Both configured alike, STEPS SGD steps: the largest gradient and parameter gaps."""
    models = _models(dp_mesh, tp_mesh)
    for model in models:
        configure(model)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in models]
    gradients = 0.0
    for step in range(STEPS):
        for model in models:
            torch.autograd.backward(mlp_loss(model, mlp_batch(dp_rank, step)))
        gradients = max(gradients, _gaps(models)[0])
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return gradients, _gaps(models)[1]


def _async_unshard(dp_rank: int, dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> Results:
    """Each step: unshard(async_op=True) on each block, not waited, then the step."""
    models = _models(dp_mesh, tp_mesh)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in models]
    issued: list[list[Collective]] = []
    for model, optimizer in zip(models, optimizers, strict=True):
        recorder = Recorder()
        with recorder.recording():
            for step in range(STEPS):
                for block in model.children():
                    assert isinstance(block, FSDPModule)
                    block.unshard(async_op=True)
                torch.autograd.backward(mlp_loss(model, mlp_batch(dp_rank, step)))
                optimizer.step()
                optimizer.zero_grad()
        issued.append([c for c in recorder.collectives if c[0] == "all_gather"])
    return {"issued": tuple(issued), "parameter_gap": _gaps(models)[1]}


def _cast_while_unsharded(dp_rank: int, dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> Results:
    """unshard(), then .to(float64): the shards (TP DTensors) are cast; then SGD steps."""
    models = _models(dp_mesh, tp_mesh)
    for model in models:
        assert isinstance(model, FSDPModule)
        model.unshard()
        model.to(torch.float64)
    dtypes = {
        (index, parameter.dtype, type(parameter).__name__)
        for index, model in enumerate(models)
        for parameter in model.parameters()
    }
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in models]
    for step in range(STEPS):
        for model in models:
            batch = mlp_batch(dp_rank, step).double()
            torch.autograd.backward(mlp_loss(model, batch))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return {"dtypes": dtypes, "parameter_gap": _gaps(models)[1]}


def _job(rank: int, world_size: int) -> Results:
    torch.use_deterministic_algorithms(True)
    dp_rank = rank // 2  # tp is the innermost dim
    cube = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    hsdp, tp = cube["replicate", "shard"], cube["tp"]
    square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return {
        "deferred": _deferred(dp_rank, hsdp, tp),
        "factor": _configured(dp_rank, hsdp, tp, _divide_by_3),
        "force_sum": _configured(dp_rank, hsdp, tp, _force_sum_clamped),
        "async_unshard": _async_unshard(dp_rank, square["dp"], square["tp"]),
        "cast": _cast_while_unsharded(dp_rank, square["dp"], square["tp"]),
    }


@pytest.fixture(scope="module")
def ranks() -> list[Results]:
    return run_distributed(_job, 4, timeout=300.0)


def test_hsdp_tp_all_reduce_off_defers_it_to_the_last_micro_batch_as_torch(
    ranks: list[Results],
) -> None:
    for found in ranks:
        deferred = found["deferred"]
        for ours, theirs in deferred["issued"]:
            assert ours == theirs
            assert len(ours) == 2  # one per block (the root holds none), the last micro-batch only
        assert deferred["unset"] == [True] * (2 * STEPS)  # ours and FSDP2's, each step
        assert deferred["gradient_gap"] <= TOLERANCE
        assert deferred["parameter_gap"] <= TOLERANCE


@pytest.mark.parametrize("key", ["factor", "force_sum"])
def test_hsdp_tp_divide_factor_and_force_sum_reduce_as_torch(
    ranks: list[Results], key: str
) -> None:
    for found in ranks:
        gradients, parameters = found[key]
        assert gradients <= TOLERANCE
        assert parameters <= TOLERANCE


def test_tp_async_unshard_serves_the_next_forward_as_torch(ranks: list[Results]) -> None:
    for found in ranks:
        ours, theirs = found["async_unshard"]["issued"]
        assert ours == theirs
        # a step: the two blocks' async unshards serve the forward, backward gathers again
        assert ours == [("all_gather", 39)] * (4 * STEPS)  # TP-local padded shards
        assert found["async_unshard"]["parameter_gap"] <= TOLERANCE


def test_tp_cast_while_unsharded_reaches_the_shards_as_torch(ranks: list[Results]) -> None:
    for found in ranks:
        cast = found["cast"]
        assert {dtype for _, dtype, _ in cast["dtypes"]} == {torch.float64}
        assert {kind for _, _, kind in cast["dtypes"]} == {"DTensor"}
        assert cast["parameter_gap"] <= TOLERANCE
