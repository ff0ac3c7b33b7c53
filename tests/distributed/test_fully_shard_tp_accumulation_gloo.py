"""Micro-batches accumulated under tensor parallelism in bf16, against FSDP2, on 4 gloo ranks.

A ``(dp, tp)`` mesh of 2 x 2; two pre-norm MLP blocks whose RMSNorms are
sequence-parallel, so their weights' gradients are ``Partial`` sums over the
tensor-parallel ranks. Parameters gathered in bf16, gradients reduced in float32;
each step runs three micro-batches, the first two without gradient sync. FSDP2
casts each micro-batch's ``Partial`` gradient to float32 and adds it, still
``Partial``, and sums it over the tensor-parallel ranks once, at the reduction: ours
must give its parameters to the bit, with as many collectives. The same job runs
the pipelined case, pp 2 x tp 2 with a data-parallel mesh of one rank: one block per
stage under ``Schedule1F1B``, which keeps the micro-batches without sync itself.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from fully_shard_models import full_gradients, full_parameters, needs_reference_fully_shard
from tensor_parallel_models import (
    IN,
    SEQUENCE_PARALLEL_PLAN,
    NormMLP,
    mlp_loss,
    sequence_batch,
    sequence_parallel_mlp,
)
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

from torchcontract.apis import fully_shard
from torchcontract.testing import run_distributed

Results = dict[str, Any]
STEPS, MICROBATCHES = 2, 3
POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

pytestmark = needs_reference_fully_shard


def _step(model: nn.Module, mesh: DeviceMesh, step: int) -> Counter[str]:
    """One optimizer step's micro-batches, the last one synced; the collectives they issued."""
    assert isinstance(model, FSDPModule)
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    issued: Counter[str] = Counter()
    for microbatch in range(MICROBATCHES):
        model.set_requires_gradient_sync(microbatch == MICROBATCHES - 1)
        batch = sequence_batch(dp_rank, tp_rank, MICROBATCHES * step + microbatch)
        with CommDebugMode() as comms:  # type: ignore[no-untyped-call]
            torch.autograd.backward(mlp_loss(model, batch))
        issued.update({str(kind): count for kind, count in comms.get_comm_counts().items()})
    return issued


def _equal(mine: dict[str, Tensor], theirs: dict[str, Tensor]) -> list[str]:
    """The names whose tensors differ in any bit (both must have the same names)."""
    assert mine.keys() == theirs.keys()
    return sorted(name for name in mine if not torch.equal(mine[name], theirs[name]))


def _pipelined_stage(shard: Any, mesh: DeviceMesh) -> nn.Module:
    """This ``pp`` rank's stage: one ``NormMLP`` block, sequence-parallel, sharded over ``dp``."""
    torch.manual_seed(mesh.get_local_rank("pp"))
    stage = NormMLP(nn.RMSNorm)
    parallelize_module(stage, mesh["tp"], SEQUENCE_PARALLEL_PLAN)
    shard(stage, mesh=mesh["dp"], mp_policy=POLICY)
    return stage


def _squared_error(output: Tensor, target: Tensor) -> Tensor:
    return ((output.float() - target) ** 2).mean()


def _pipelined(mesh: DeviceMesh) -> Results:
    """pp 2 x tp 2 (dp of 1): ``Schedule1F1B`` accumulates micro-batches as FSDP2."""
    pp_rank, tp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("tp")
    stages = [_pipelined_stage(shard, mesh) for shard in (fully_shard, torch_fully_shard)]
    optimizers = [torch.optim.AdamW(stage.parameters(), lr=1e-2) for stage in stages]
    schedules = [
        Schedule1F1B(
            PipelineStage(stage, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group()),
            n_microbatches=MICROBATCHES,
            loss_fn=_squared_error,
        )
        for stage in stages
    ]
    results: Results = {"unequal_gradients": [], "unequal_parameters": []}
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        # (batch, sequence, features), two samples per micro-batch: this tp rank's sequence half.
        inputs, target = torch.randn(2, 2 * MICROBATCHES, 4, IN, generator=generator)
        inputs, target = inputs.chunk(2, dim=1)[tp_rank], target.chunk(2, dim=1)[tp_rank]
        for schedule in schedules:
            if pp_rank == 0:
                schedule.step(inputs)
            else:
                schedule.step(target=target)
        gradients = [full_gradients(stage) for stage in stages]
        results["unequal_gradients"].append(_equal(*gradients))
        results["gradient_names"] = sorted(gradients[0])
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        results["unequal_parameters"].append(
            _equal(full_parameters(stages[0]), full_parameters(stages[1]))
        )
    return results


def _job(rank: int, world_size: int) -> Results:
    pipelined = _pipelined(init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp")))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    models = [
        sequence_parallel_mlp(shard, mesh["dp"], mesh["tp"], norm=nn.RMSNorm, mp_policy=POLICY)
        for shard in (fully_shard, torch_fully_shard)
    ]
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in models]
    results: Results = {
        "unequal_gradients": [],
        "unequal_parameters": [],
        "issued": [],
        "pipelined": pipelined,
    }
    for step in range(STEPS):
        issued = [_step(model, mesh, step) for model in models]
        results["issued"].append(issued)
        gradients = [full_gradients(model) for model in models]
        results["unequal_gradients"].append(_equal(*gradients))
        results["gradient_names"] = sorted(gradients[0])
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        results["unequal_parameters"].append(
            _equal(full_parameters(models[0]), full_parameters(models[1]))
        )
    return results


@pytest.fixture(scope="module")
def ranks() -> list[Results]:
    return run_distributed(_job, 4, timeout=180.0)


def test_tp_partial_gradients_accumulate_in_float32_as_fsdp2_to_the_bit(
    ranks: list[Results],
) -> None:
    for result in ranks:
        assert "0.norm.weight" in result["gradient_names"]  # the Partial ones, compared
        assert result["unequal_gradients"] == [[]] * STEPS
        assert result["unequal_parameters"] == [[]] * STEPS


def test_tp_partial_gradients_are_summed_once_per_step_as_fsdp2(ranks: list[Results]) -> None:
    for result in ranks:
        for mine, theirs in result["issued"]:
            assert mine == theirs
            # DTensor's all-reduces over tp: the two norms' weights, once each per step
            # (one per micro-batch, six, before the sum moved to the reduction).
            assert mine["c10d_functional.all_reduce"] == 2


def test_pipelined_tp_stages_accumulate_micro_batches_as_fsdp2_to_the_bit(
    ranks: list[Results],
) -> None:
    """pp 2 x tp 2 (a dp of one rank): the schedule keeps micro-batches without sync."""
    for result in ranks:
        pipelined = result["pipelined"]
        assert "norm.weight" in pipelined["gradient_names"]
        assert pipelined["unequal_gradients"] == [[]] * STEPS
        assert pipelined["unequal_parameters"] == [[]] * STEPS
