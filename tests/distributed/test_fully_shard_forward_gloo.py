"""What a forward sees and leaves under fully_shard, against FSDP2 with the same calls, 2 ranks.

Cases whose numbers can hide a difference: the inputs' dtype a module sees without
``cast_forward_inputs`` (a module that casts them itself gives the same output);
the all-gathers backward issues when a block runs twice in one forward (gathering
the wrong group early changes nothing but the order, recorded by
``fully_shard_recorder``); and a cast while the root holds its unsharded parameters
after a forward without gradients, with the optimizer built after it (FSDP2
reshards before a cast, so that optimizer holds the shards).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import pytest
import torch
from fully_shard_models import (
    GPT,
    batch,
    full_parameters,
    gpt,
    largest_gap,
    loss_on,
    needs_reference_fully_shard,
)
from fully_shard_recorder import Collective, Recorder
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from torchcontract.apis import fully_shard
from torchcontract.testing import run_distributed

pytestmark = needs_reference_fully_shard

TOLERANCE: Final = 1e-6
APIS: Final = (fully_shard, torch_fully_shard)
Results = dict[str, Any]
Apply = Callable[..., Any]


class Probe(nn.Module):
    """A linear layer that notes the dtype of its inputs and casts them to its weight's."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seen: list[str] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(str(x.dtype))
        out: Tensor = self.linear(x.to(self.linear.weight.dtype))
        return out


def _input_dtypes(rank: int, mesh: DeviceMesh, cast_inputs: bool) -> tuple[list[Any], float]:
    """float64 parameters, float32 inputs: the dtypes each probe saw, and the gradient gap."""
    policy = MixedPrecisionPolicy(param_dtype=torch.float64, cast_forward_inputs=cast_inputs)
    seen: list[Any] = []
    gradients: list[dict[str, Tensor]] = []
    for apply in APIS:
        torch.manual_seed(0)
        model = nn.Sequential(Probe(), Probe())
        for probe in model:
            apply(probe, mesh=mesh, mp_policy=policy)
        apply(model, mesh=mesh, mp_policy=policy)
        inputs = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
        torch.autograd.backward(model(inputs).sum())
        seen.append([probe.seen for probe in model if isinstance(probe, Probe)])
        gradients.append(
            {
                name: p.grad.full_tensor()
                for name, p in model.named_parameters()
                if isinstance(p.grad, DTensor)
            }
        )
    return seen, largest_gap(*gradients)


class Sandwich(GPT):
    """The first block runs before and after the second: blocks 0, 1, 0 per forward."""

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for index in (0, 1, 0):
            x = self.blocks[index](x)
        out: Tensor = self.head(self.norm(x))
        return out


def _backward_gathers(rank: int, mesh: DeviceMesh, apply: Apply) -> list[Collective]:
    """The first block runs twice per forward: the all-gathers of one backward, in order.

    Its backward for the second call prefetches the block whose forward ran before
    that call (its latest post-forward, as FSDP2's), not before the first.
    """
    torch.manual_seed(0)
    model = Sandwich()
    for block in model.blocks:
        apply(block, mesh=mesh)
    apply(model, mesh=mesh)
    loss = loss_on(model, *batch(rank, 0))
    recorder = Recorder()
    with recorder.recording():
        torch.autograd.backward(loss)
    return [c for c in recorder.collectives if c[0] == "all_gather"]


def _cast_while_unsharded(
    rank: int, mesh: DeviceMesh, apply: Apply, cast: Callable[[nn.Module], object]
) -> tuple[list[str], dict[str, Tensor]]:
    """A forward without gradients, the cast, then the optimizer, 3 AdamW steps."""
    model: GPT = gpt()
    for block in model.blocks:
        apply(block, mesh=mesh)
    apply(model, mesh=mesh)
    with torch.no_grad():
        model(batch(rank, 9)[0])  # the root keeps its parameters unsharded
    cast(model)
    unsharded = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        torch.autograd.backward(loss_on(model, *batch(rank, step)))
        optimizer.step()
        optimizer.zero_grad()
    return unsharded, full_parameters(model)


def _job(rank: int, world_size: int) -> Results:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.use_deterministic_algorithms(True)
    found: Results = {
        "cast_inputs": _input_dtypes(rank, mesh, cast_inputs=True),
        "keep_inputs": _input_dtypes(rank, mesh, cast_inputs=False),
        "twice": [_backward_gathers(rank, mesh, apply) for apply in APIS],
    }
    for name, cast in (("float", nn.Module.float), ("cpu", lambda m: m.to("cpu"))):
        (ours, mine), (theirs, reference) = (
            _cast_while_unsharded(rank, mesh, apply, cast) for apply in APIS
        )
        found[f"cast_{name}"] = ([ours, theirs], largest_gap(mine, reference))
    return found


@pytest.fixture(scope="module")
def ranks() -> list[Results]:
    return run_distributed(_job, 2, timeout=180.0)


@pytest.mark.parametrize("key", ["cast_inputs", "keep_inputs"])
def test_modules_see_the_input_dtype_torch_gives_them(ranks: list[Results], key: str) -> None:
    first = "torch.float64" if key == "cast_inputs" else "torch.float32"
    for found in ranks:
        (ours, theirs), gap = found[key]
        assert ours == theirs == [[first], ["torch.float64"]]
        assert gap <= TOLERANCE


def test_a_block_run_twice_is_gathered_in_backward_as_torch(ranks: list[Results]) -> None:
    for found in ranks:
        ours, theirs = found["twice"]
        assert ours == theirs
        assert len(theirs) == 3  # block 0, block 1 (prefetched), block 0 again


@pytest.mark.parametrize("key", ["cast_float", "cast_cpu"])
def test_a_cast_while_the_root_is_unsharded_reshards_first_as_torch(
    ranks: list[Results], key: str
) -> None:
    for found in ranks:
        (ours, theirs), gap = found[key]
        assert ours == theirs == []
        assert gap <= TOLERANCE
