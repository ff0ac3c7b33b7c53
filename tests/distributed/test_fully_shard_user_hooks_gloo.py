"""What users hang on a sharded model, against FSDP2 on 2 gloo ranks, the same calls on both.

- Post-accumulate-grad hooks on the shards (an optimizer stepping in backward): FSDP2
  runs them once it wrote each shard's ``.grad``; without them the step never happens
  and the parameters silently stay as they were.
- Forward pre-hooks registered before sharding: FSDP2's pre-hook runs first, so they
  see the gathered parameters (``weight_norm``'s hook computes the weight from them).
- A parameter under a nested application that the nested application does not manage
  (ignored there, or registered after it): FSDP2's outer application does not enter the
  nested one's modules, so the parameter stays a plain, unaveraged tensor.
- All-reduce hooks, one per application: called in FSDP2's order, the groups whose
  backward hooks never ran (inputs that need no gradient) reduced root first at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, cast

import pytest
import torch
from fully_shard_models import (
    GPT,
    batch,
    full_gradients,
    full_parameters,
    largest_gap,
    loss_on,
    needs_reference_fully_shard,
    sharded_gpt,
)
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from torchcontract.apis import _torch, fully_shard
from torchcontract.testing import run_distributed

pytestmark = needs_reference_fully_shard

Results = dict[str, Any]
Apply = Callable[..., Any]
APPLIES: Final[dict[str, Apply]] = {"ours": fully_shard, "FSDP2": torch_fully_shard}
STEPS: Final = 2


def _optimizer_in_backward(rank: int, mesh: DeviceMesh) -> Results:
    """SGD stepped by a post-accumulate-grad hook on each shard: hooks run, parameters move."""
    found: Results = {}
    models = []
    for name, apply in APPLIES.items():
        model = sharded_gpt(apply, mesh)
        calls = [0]

        def step(parameter: Tensor, calls: list[int] = calls) -> None:
            calls[0] += 1
            assert parameter.grad is not None
            with torch.no_grad():
                parameter.sub_(parameter.grad, alpha=0.1)
            parameter.grad = None

        for parameter in model.parameters():
            _torch.register_post_accumulate_grad_hook(parameter, step)
        before = full_parameters(model)
        for index in range(STEPS):
            torch.autograd.backward(loss_on(model, *batch(rank, index)))
        found[name] = (calls[0], largest_gap(before, full_parameters(model)))
        models.append(model)
    found["gap"] = largest_gap(*(full_parameters(model) for model in models))
    return found


class Scaled(nn.Module):
    """A layer whose input a pre-hook registered before sharding scales by ``gain``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.full((8,), 0.5))
        self.seen: list[str] = []
        self.register_forward_pre_hook(self._scale)

    def _scale(self, module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor]:
        self.seen.append(type(self.gain).__name__)
        return (args[0] * self.gain,)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.layer(x)
        return out


def _pre_hooks_see_gathered_parameters(rank: int, mesh: DeviceMesh) -> Results:
    """A scaling pre-hook and ``weight_norm``, both registered before sharding."""
    found: Results = {}
    grads = []
    for name, apply in APPLIES.items():
        torch.manual_seed(0)
        model = nn.Sequential(Scaled(), nn.Linear(8, 4))
        nn.utils.parametrizations.weight_norm(model[1])
        apply(model[0], mesh=mesh)
        apply(model, mesh=mesh)
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
        for _ in range(STEPS):
            torch.autograd.backward(model(x).pow(2).sum())
        found[name] = model[0].seen
        grads.append(full_gradients(model))
    found["gap"] = largest_gap(*grads)
    return found


class Adapted(nn.Module):
    """A block, and a module inside it that receives a parameter after it was sharded."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.inner = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.inner(self.norm(x))
        bias: Tensor | None = getattr(self.inner, "adapter", None)
        return out if bias is None else out + bias


def _nested_applications_unmanaged_parameters(rank: int, mesh: DeviceMesh) -> Results:
    """One parameter ignored by the inner application only, one added after it."""
    found: Results = {}
    grads = []
    for name, apply in APPLIES.items():
        torch.manual_seed(0)
        block = Adapted()
        model = nn.Sequential(block, nn.Linear(8, 4))
        apply(block, mesh=mesh, ignored_params={block.norm.weight})
        adapter = nn.Parameter(torch.zeros(8))
        block.inner.register_parameter("adapter", adapter)
        apply(model, mesh=mesh)
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
        for _ in range(STEPS):
            torch.autograd.backward(model(x).pow(2).sum())
        found[name] = [
            isinstance(parameter, DTensor)
            for parameter in (block.norm.weight, block.inner.get_parameter("adapter"))
        ]
        grads.append(full_gradients(model))
    found["gap"] = largest_gap(*grads)
    # This rank's own gradient of the adapter: the ranks' must differ.
    found["own"] = grads[0]["0.inner.adapter"].tolist()
    return found


def _appending(order: list[str], label: str) -> Callable[[Tensor], None]:
    return lambda output: order.append(label)


def _reduction_order(rank: int, mesh: DeviceMesh) -> list[list[str]]:
    """Per implementation, the order its groups' all-reduce hooks ran in, over 2 steps.

    Three layers, the first two sharded each and the root: the input needs no gradient,
    so the first layer's backward hook never runs and it reduces at the end, beside
    the root.
    """
    orders = []
    for apply in APPLIES.values():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
        apply(model[0], mesh=mesh)
        apply(model[1], mesh=mesh)
        apply(model, mesh=mesh)
        order: list[str] = []
        for name, module in model.named_modules():
            if fully_shard.is_applied(module) or hasattr(module, "set_all_reduce_hook"):
                label = name or "root"
                cast(Any, module).set_all_reduce_hook(_appending(order, label))
        for index in range(STEPS):
            x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank + index))
            torch.autograd.backward(model(x).pow(2).sum())
            order.append("step")
        orders.append(order)
    return orders


def _job(rank: int, world_size: int) -> Results:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.use_deterministic_algorithms(True)
    return {
        "optimizer_in_backward": _optimizer_in_backward(rank, mesh),
        "pre_hooks": _pre_hooks_see_gathered_parameters(rank, mesh),
        "nested": _nested_applications_unmanaged_parameters(rank, mesh),
        "order": _reduction_order(rank, mesh),
    }


@pytest.fixture(scope="module")
def ranks() -> list[Results]:
    return run_distributed(_job, 2, timeout=120.0)


def test_post_accumulate_grad_hooks_on_the_shards_run_as_fsdp2s(ranks: list[Results]) -> None:
    parameters = len(list(GPT(blocks=2).parameters()))
    for rank in ranks:
        found = rank["optimizer_in_backward"]
        assert found["ours"][0] == found["FSDP2"][0] == parameters * STEPS
        assert found["ours"][1] > 0.01  # the hooks' steps moved the parameters
        assert found["gap"] == 0.0


def test_pre_hooks_registered_before_sharding_see_the_gathered_parameters(
    ranks: list[Results],
) -> None:
    for rank in ranks:
        found = rank["pre_hooks"]
        assert found["ours"] == found["FSDP2"] == ["Parameter"] * STEPS
        assert found["gap"] == 0.0


def test_a_nested_applications_unmanaged_parameters_stay_as_fsdp2_leaves_them(
    ranks: list[Results],
) -> None:
    for rank in ranks:
        found = rank["nested"]
        assert found["ours"] == found["FSDP2"] == [False, False]
        assert found["gap"] == 0.0
    assert ranks[0]["nested"]["own"] != ranks[1]["nested"]["own"]


def test_the_groups_reduce_in_fsdp2s_order(ranks: list[Results]) -> None:
    for rank in ranks:
        ours, theirs = rank["order"]
        assert ours == theirs
        assert ours[:3] == ["1", "root", "0"]
