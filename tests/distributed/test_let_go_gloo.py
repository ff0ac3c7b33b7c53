"""When one of these APIs' collectives returns, gloo's thread holds none of its tensors.

Gloo's thread drops a finished collective's tensors when it next runs, often after
``wait()`` has returned (about one time in ten here). A tensor whose Python object
died first is then freed on that thread, which must take the GIL; while the
interpreter exits it cannot, and the process aborts. So every collective of
``_torch`` hands gloo aliases and returns once gloo has let go of them: here, hundreds
of times in a row, nothing else holds an alias when the call returns. Groups that run
no collective on threads of their own (the fake group, one written in Python) are
handed the caller's tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import pytest
import torch
import torch.distributed as dist
from python_group import PythonGroup
from torch import Tensor

from torchcontract.apis import _let_go, _torch

#: Calls in a row, each of which would leave gloo holding an alias about one time in ten.
ROUNDS: Final = 1000

_Call = Callable[[Tensor, dist.ProcessGroup], object]

CALLS: Final[dict[str, _Call]] = {
    "all_reduce": lambda tensor, group: _torch.all_reduce(tensor, group).wait(),
    "all_reduce_max": _torch.all_reduce_max,
    "all_reduce_average": _torch.all_reduce_average,
    "all_reduce_blocking": lambda tensor, _: _torch.all_reduce_blocking(tensor),
    "broadcast": lambda tensor, group: _torch.broadcast(tensor, 0, group),
    "all_gather_into": lambda tensor, group: _torch.all_gather_into(
        torch.empty_like(tensor), tensor, group
    ),
    "all_gather_into_async": lambda tensor, group: _torch.all_gather_into_async(
        torch.empty_like(tensor), tensor, group
    ).wait(),
    "reduce_scatter_sum": lambda tensor, group: _torch.reduce_scatter_sum(
        torch.empty_like(tensor), tensor, group
    ),
    "reduce_scatter_average": lambda tensor, group: _torch.reduce_scatter_average(
        torch.empty_like(tensor), tensor, group
    ),
}


@pytest.fixture
def handed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Tensor, ...]]:
    """Every tuple of aliases ``_torch`` hands a collective, in order."""
    handed: list[tuple[Tensor, ...]] = []

    def recorded(group: dist.ProcessGroup, *tensors: Tensor) -> tuple[Tensor, ...] | None:
        aliases = _let_go.hand_over(group, *tensors)
        if aliases is not None:
            handed.append(aliases)
        return aliases

    monkeypatch.setattr(_torch, "hand_over", recorded)
    return handed


def _held_elsewhere(aliases: tuple[Tensor, ...]) -> list[int]:
    """How many references other than its own object each alias has (C++ ones: gloo's)."""
    use_count: Callable[[Tensor], int] = getattr(Tensor, "_use_count")  # noqa: B009
    return [use_count(alias) - 1 for alias in aliases]


@pytest.mark.parametrize("default_group", ["gloo"], indirect=True)
@pytest.mark.parametrize("name", CALLS)
def test_gloo_holds_no_tensor_of_a_collective_that_returned(
    name: str, handed: list[tuple[Tensor, ...]], default_group: dist.ProcessGroup
) -> None:
    group = default_group
    for round_ in range(ROUNDS):
        tensor = torch.arange(8.0)
        CALLS[name](tensor, group)
        assert len(handed) == round_ + 1
        assert _held_elsewhere(handed[-1]) == [0] * len(handed[-1])


@pytest.mark.parametrize("default_group", ["gloo"], indirect=True)
def test_gloo_writes_into_the_callers_tensor_through_its_alias(
    default_group: dist.ProcessGroup,
) -> None:
    group = default_group
    tensor = torch.arange(4.0)
    aliases = _let_go.hand_over(group, tensor)
    assert aliases is not None
    (alias,) = aliases
    assert alias is not tensor
    assert alias.data_ptr() == tensor.data_ptr()
    gathered = torch.empty(4)
    _torch.all_gather_into(gathered, tensor, group)
    assert gathered.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("default_group", ["fake"], indirect=True)
def test_the_fake_group_is_handed_the_callers_tensors(default_group: dist.ProcessGroup) -> None:
    assert _let_go.hand_over(default_group, torch.ones(2)) is None


class _NamedGloo(PythonGroup):
    backend = "gloo"  # named so, yet it runs its collectives as it likes


def test_a_group_written_in_python_is_handed_the_callers_tensors() -> None:
    assert _let_go.hand_over(_NamedGloo(0, 2), torch.ones(2)) is None


@pytest.mark.parametrize("default_group", ["gloo"], indirect=True)
def test_a_handle_waits_once_and_then_returns_at_once(default_group: dist.ProcessGroup) -> None:
    group = default_group
    tensor = torch.ones(3)
    handle = _torch.all_reduce(tensor, group)
    handle.wait()
    handle.wait()
    assert tensor.tolist() == [1.0, 1.0, 1.0]
