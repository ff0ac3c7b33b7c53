"""How fully_shard reduces gradients, against FSDP2 with the same calls, on 2 gloo ranks.

Cases a symmetric 2 x 2 HSDP mesh cannot tell apart: on it a replica all-reduce
divided by the shard group's size, or a divide factor that leaves the replicas out,
give the right numbers. Here HSDP runs on (2, 1) and (1, 2) meshes, with and
without ``set_gradient_divide_factor``. Also: ``set_force_sum_reduction_for_comms``
under an all-reduce hook that is not linear (a clamp sees sums, not averages), and
``set_requires_gradient_sync(False, recurse=False)``, whose reduce-scatters are
recorded (``fully_shard_recorder``): which groups still reduce is not in the numbers
of the step that follows. And the one difference: force-sum with a factor on a
shard group of one, which FSDP2 divides by the factor twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import pytest
import torch
from fully_shard_models import (
    batch,
    fsdp_modules,
    full_gradients,
    full_parameters,
    largest_gap,
    loss_on,
    needs_reference_fully_shard,
    sharded_gpt,
)
from fully_shard_recorder import Collective, Recorder
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from torchcontract.apis import fully_shard
from torchcontract.testing import run_distributed

pytestmark = needs_reference_fully_shard

TOLERANCE: Final = 1e-6
CLAMP: Final = 0.02
Results = dict[str, Any]
Configure = Callable[[nn.Module], None]


def _side_by_side(rank: int, mesh: DeviceMesh, configure: Configure) -> tuple[float, float]:
    """Both configured alike, 3 AdamW steps: the largest gradient and parameter gaps."""
    models = [sharded_gpt(apply, mesh) for apply in (fully_shard, torch_fully_shard)]
    for model in models:
        configure(model)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in models]
    gradients = 0.0
    for step in range(3):
        for model in models:
            torch.autograd.backward(loss_on(model, *batch(rank, step)))
        gradients = max(gradients, largest_gap(*(full_gradients(model) for model in models)))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return gradients, largest_gap(*(full_parameters(model) for model in models))


def _clamp(output: Tensor) -> None:
    output.clamp_(-CLAMP, CLAMP)


def _force_sum(hooked: bool) -> Configure:
    def configure(model: nn.Module) -> None:
        for module in fsdp_modules(model):
            module.set_force_sum_reduction_for_comms(True)
            if hooked:
                module.set_all_reduce_hook(_clamp)

    return configure


def _clamped(model: nn.Module) -> None:
    for module in fsdp_modules(model):
        module.set_all_reduce_hook(_clamp)


def _divide_by(factor: float) -> Configure:
    def configure(model: nn.Module) -> None:
        for module in fsdp_modules(model):
            module.set_gradient_divide_factor(factor)

    return configure


def _gradients_with(
    rank: int, mesh: DeviceMesh, configure: Configure, apply: Callable[..., Any] = fully_shard
) -> dict[str, Tensor]:
    model = sharded_gpt(apply, mesh)
    configure(model)
    torch.autograd.backward(loss_on(model, *batch(rank, 0)))
    return full_gradients(model)


def _root_not_synced(rank: int, mesh: DeviceMesh, apply: Callable[..., Any]) -> Results:
    """The root alone not synchronized for one backward: the reduce-scatters of each backward."""
    model = sharded_gpt(apply, mesh)
    root = model
    assert isinstance(root, FSDPModule)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = Recorder()
    issued: list[list[Collective]] = []
    with recorder.recording():
        for step, sync in enumerate((False, True)):
            root.set_requires_gradient_sync(sync, recurse=False)
            torch.autograd.backward(loss_on(model, *batch(rank, step)))
            issued.append([c for c in recorder.collectives if c[0] == "reduce_scatter"])
            recorder.collectives.clear()
    optimizer.step()
    return {"issued": issued, "parameters": full_parameters(model)}


def _job(rank: int, world_size: int) -> Results:
    torch.use_deterministic_algorithms(True)
    flat = init_device_mesh("cpu", (world_size,))
    found: Results = {
        "force_sum_hooked": _side_by_side(rank, flat, _force_sum(hooked=True)),
        "force_sum": _side_by_side(rank, flat, _force_sum(hooked=False)),
        # the clamp sees other numbers with sums: ours must differ from ours without
        "force_sum_changes": largest_gap(
            _gradients_with(rank, flat, _force_sum(hooked=True)),
            _gradients_with(rank, flat, _clamped),
        ),
    }
    ours, theirs = (
        _root_not_synced(rank, flat, apply) for apply in (fully_shard, torch_fully_shard)
    )
    found["root_not_synced"] = (ours["issued"], theirs["issued"])
    found["root_not_synced_gap"] = largest_gap(ours["parameters"], theirs["parameters"])
    for shape in ((2, 1), (1, 2)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        name = f"{shape[0]}x{shape[1]}"
        found[f"hsdp_{name}"] = _side_by_side(rank, mesh, lambda model: None)
        # FSDP2 on gloo: no PREMUL_SUM, so a factor that is the shard size (an average)
        # on (1, 2), and any factor on (2, 1) (no reduce-scatter, a division, a sum)
        factor = 3.0 if shape == (2, 1) else 2.0
        found[f"hsdp_{name}_factor"] = _side_by_side(rank, mesh, _divide_by(factor))
        found[f"hsdp_{name}_force_sum"] = _side_by_side(rank, mesh, _force_sum(hooked=True))
    found["force_sum_factor_ratios"] = _force_sum_factor_ratios(rank)
    found["deferred_then_unused"] = _deferred_then_unused(rank)
    return found


class _Branches(nn.Module):
    """``sometimes`` takes part in the forward only when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.sometimes = nn.Linear(4, 4)

    def forward(self, x: Tensor, both: bool) -> Tensor:
        out: Tensor = self.used(x)
        return out + self.sometimes(x) if both else out


def _deferred_then_unused(rank: int) -> float:
    """HSDP (2, 1): the all-reduce deferred from a micro-batch using ``sometimes`` to one not.

    Ours defers; FSDP2 all-reduces every micro-batch (its deferral cannot take a
    parameter that the last micro-batch leaves unused). Both sums must be the same,
    for both steps: the kept shard reaches this step's ``.grad``, never a later one.
    """
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    models: list[nn.Module] = []
    for apply in (fully_shard, torch_fully_shard):
        torch.manual_seed(0)
        branches = _Branches()
        apply(branches, mesh=mesh)
        models.append(branches)
    deferring = models[0]
    assert isinstance(deferring, FSDPModule)
    gap = 0.0
    for step in range(2):
        for micro, both in enumerate((True, False)):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + micro + step))
            deferring.set_requires_all_reduce(micro == 1)
            for model in models:
                model(x, both).pow(2).sum().backward()
        gap = max(gap, largest_gap(*(full_gradients(model) for model in models)))
        for model in models:
            model.zero_grad()
    return gap


def _force_sum_and_factor(model: nn.Module) -> None:
    _force_sum(hooked=False)(model)
    _divide_by(3.0)(model)


def _force_sum_factor_ratios(rank: int) -> set[float]:
    """Force-sum with a factor of 3 on a shard group of one: our gradients over FSDP2's.

    FSDP2 (its single-rank path) divides by the factor before the sum as well as
    after it; here the sum is divided once, as on every other mesh.
    """
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    ours, theirs = (
        _gradients_with(rank, mesh, _force_sum_and_factor, apply)
        for apply in (fully_shard, torch_fully_shard)
    )
    return {
        round(float((ours[name] / theirs[name])[theirs[name].abs() > 1e-6].mean()), 4)
        for name in ours
    }


@pytest.fixture(scope="module")
def ranks() -> list[Results]:
    return run_distributed(_job, 2, timeout=240.0)


@pytest.mark.parametrize("key", ["force_sum", "force_sum_hooked"])
def test_force_sum_reduction_hands_the_hook_sums_as_torch(ranks: list[Results], key: str) -> None:
    for found in ranks:
        gradients, parameters = found[key]
        assert gradients <= TOLERANCE
        assert parameters <= TOLERANCE
        assert found["force_sum_changes"] > 1e-3


@pytest.mark.parametrize("shape", ["2x1", "1x2"])
@pytest.mark.parametrize("variant", ["", "_factor", "_force_sum"])
def test_hsdp_on_an_asymmetric_mesh_matches_torch(
    ranks: list[Results], shape: str, variant: str
) -> None:
    for found in ranks:
        gradients, parameters = found[f"hsdp_{shape}{variant}"]
        assert gradients <= TOLERANCE
        assert parameters <= TOLERANCE


def test_gradient_sync_off_without_recursion_leaves_the_blocks_reducing_as_torch(
    ranks: list[Results],
) -> None:
    for found in ranks:
        ours, theirs = found["root_not_synced"]
        assert ours == theirs
        assert [len(issued) for issued in ours] == [2, 3]  # the blocks; then every group
        assert found["root_not_synced_gap"] <= TOLERANCE


def test_force_sum_with_a_factor_on_a_shard_group_of_one_divides_once(
    ranks: list[Results],
) -> None:
    """Not FSDP2's: it divides by the factor twice there (ours is its result times 3)."""
    for found in ranks:
        assert found["force_sum_factor_ratios"] == {3.0}


def test_a_deferred_all_reduce_reaches_a_parameter_the_last_micro_batch_leaves_unused(
    ranks: list[Results],
) -> None:
    for found in ranks:
        assert found["deferred_then_unused"] <= TOLERANCE
