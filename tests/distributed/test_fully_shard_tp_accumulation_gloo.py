"""Micro-batches accumulated under tensor parallelism in bf16, against FSDP2, on 4 gloo ranks.

A ``(dp, tp)`` mesh of 2 x 2; two pre-norm MLP blocks whose RMSNorms are
sequence-parallel, so their weights' gradients are ``Partial`` sums over the
tensor-parallel ranks. Parameters gathered in bf16, gradients reduced in float32;
each step runs three micro-batches, the first two without gradient sync. FSDP2
casts each micro-batch's ``Partial`` gradient to float32 and adds it, still
``Partial``, and sums it over the tensor-parallel ranks once, at the reduction: ours
must give its parameters to the bit, with as many collectives.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from fully_shard_models import full_gradients, full_parameters, needs_reference_fully_shard
from tensor_parallel_models import mlp_loss, sequence_batch, sequence_parallel_mlp
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor.debug import CommDebugMode

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


def _job(rank: int, world_size: int) -> Results:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    models = [
        sequence_parallel_mlp(shard, mesh["dp"], mesh["tp"], norm=nn.RMSNorm, mp_policy=POLICY)
        for shard in (fully_shard, torch_fully_shard)
    ]
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in models]
    results: Results = {"unequal_gradients": [], "unequal_parameters": [], "issued": []}
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
