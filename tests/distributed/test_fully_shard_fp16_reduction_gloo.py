"""Gradients reduced in float16 (and float64) beside FSDP2, on 2 gloo ranks: where the sum divides.

In float32 and bfloat16 the collectives average. In other reduce dtypes FSDP2 sums,
dividing the inputs by a power of two near the square root of the divisor before
and the output by the rest after, so that a float16 sum of large gradients does not
overflow. Each rank's gradient here is about 40,000, so the plain sum of two ranks
(80,000) is past float16's largest value (65,504): summed first, every gradient is
``inf``. Each case runs both libraries on the same model and batch and compares
the gradient shards (and what an all-reduce hook sees) bitwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from fully_shard_models import needs_reference_fully_shard
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from torchcontract.apis import fully_shard
from torchcontract.testing import run_distributed

pytestmark = needs_reference_fully_shard

Configure = Callable[[Any, list[float]], None]


def _plain(model: Any, seen: list[float]) -> None:
    pass


def _factor(model: Any, seen: list[float]) -> None:
    model.set_gradient_divide_factor(4.0)


def _force_sum_hooked(model: Any, seen: list[float]) -> None:
    model.set_force_sum_reduction_for_comms(True)
    model.set_all_reduce_hook(lambda output: seen.append(output.abs().max().item()))


def _hooked(model: Any, seen: list[float]) -> None:
    model.set_all_reduce_hook(lambda output: seen.append(output.abs().max().item()))


#: name: (mesh shape, reduce dtype, configure)
CASES: dict[str, tuple[tuple[int, ...], torch.dtype, Configure]] = {
    "float16": ((2,), torch.float16, _plain),
    "float16, hook": ((2,), torch.float16, _hooked),
    "float16, factor 4": ((2,), torch.float16, _factor),
    "float16, force sum, hook": ((2,), torch.float16, _force_sum_hooked),
    "float16, HSDP 2 x 1": ((2, 1), torch.float16, _plain),
    "float16, HSDP 1 x 2": ((1, 2), torch.float16, _plain),
    "float64": ((2,), torch.float64, _plain),
}
#: The one difference: a divide factor on a shard group of one, which FSDP2 divides twice.
FACTOR_ON_ONE = ((2, 1), torch.float16, _factor)


def _gradients(
    rank: int,
    apply: Callable[..., Any],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    configure: Configure,
) -> dict[str, Any]:
    names = ("replicate", "shard") if len(shape) == 2 else None
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6, bias=False), nn.Linear(6, 3))
    apply(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=dtype))
    seen: list[float] = []
    configure(model, seen)
    inputs = torch.full((2, 6), 100.0 - rank)
    scale = 200.0 if dtype == torch.float16 else 1e30
    (model(inputs).sum() * scale).backward()
    grads = {
        name: cast(DTensor, parameter.grad).to_local().tolist()
        for name, parameter in model.named_parameters()
    }
    return {"grads": grads, "seen": seen}


def _job(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for case, (shape, dtype, configure) in [*CASES.items(), ("factor on one", FACTOR_ON_ONE)]:
        results[case] = [
            _gradients(rank, apply, shape, dtype, configure)
            for apply in (fully_shard, torch_fully_shard)
        ]
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_job, 2, timeout=120)


@pytest.mark.parametrize("case", CASES)
def test_reduction_divides_where_fsdp2_does(ranks: list[dict[str, Any]], case: str) -> None:
    for results in ranks:
        ours, theirs = results[case]
        assert ours == theirs
        flat = [value for grad in ours["grads"].values() for row in grad for value in _flat(row)]
        assert all(abs(value) < float("inf") for value in flat)
        assert max(abs(value) for value in flat) > 1000  # large enough to overflow if summed


def _flat(row: Any) -> list[float]:
    return row if isinstance(row, list) else [row]


def test_a_float16_hook_sees_the_sum_divided_before_only_as_in_fsdp2(
    ranks: list[dict[str, Any]],
) -> None:
    for results in ranks:
        ours, theirs = results["float16, hook"]
        assert ours["seen"] == theirs["seen"] != []


def test_a_factor_on_a_shard_group_of_one_divides_once(ranks: list[dict[str, Any]]) -> None:
    """FSDP2 divides by the factor at the copy that stands for the reduce-scatter, and again
    around the sum: its gradients are the factor (4) times smaller. Ours divide once."""
    for results in ranks:
        ours, theirs = results["factor on one"]
        for name, grad in ours["grads"].items():
            mine = torch.tensor(grad)
            assert torch.equal(mine / 4, torch.tensor(theirs["grads"][name])), name
