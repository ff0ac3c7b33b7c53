"""When one of these APIs' collectives returns, gloo's thread holds none of its tensors.

Gloo's thread drops a finished collective's tensors when it next runs, often after
``wait()`` has returned (about one time in ten here). A tensor whose Python object
died first is then freed on that thread, which must take the GIL; while the
interpreter exits it cannot, and the process aborts. So every collective of
``_torch`` hands gloo aliases and returns once gloo has let go of them: here, on two
ranks, hundreds of times in a row, nothing else holds an alias when the call returns,
and the result is in the caller's tensor. Where gloo's thread is not involved (the
fake group, one written in Python), or an alias would not do (a sparse tensor, works
torch keeps after their end), the caller's tensors are handed over; a wait that runs
out warns once and stops waiting.
"""

from __future__ import annotations

import atexit
import gc
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Final, cast

import pytest
import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist
from python_group import PythonGroup
from torch import Tensor
from torch.distributed._functional_collectives import allow_inflight_collective_as_graph_input_ctx

from torchcontract.apis import _backends, _let_go, _torch
from torchcontract.testing import free_port, run_distributed

#: Calls in a row of each collective, of which gloo holds about one in ten past its end.
ROUNDS: Final = 300
CPU: Final = torch.device("cpu")

#: ``call(rank, group)``: run one collective; the tensor holding its result, and the
#: values expected there on 2 ranks.
_Call = Callable[[int, dist.ProcessGroup], tuple[Tensor, list[float]]]


def _mine(rank: int) -> Tensor:
    return torch.arange(4.0) + 10 * rank


def _all_reduce(rank: int, group: dist.ProcessGroup) -> tuple[Tensor, list[float]]:
    tensor = _mine(rank)
    _torch.all_reduce(tensor, group).wait()
    return tensor, [10.0, 12.0, 14.0, 16.0]


def _all_reduce_max(rank: int, group: dist.ProcessGroup) -> tuple[Tensor, list[float]]:
    tensor = _mine(rank)
    _torch.all_reduce_max(tensor, group)
    return tensor, [10.0, 11.0, 12.0, 13.0]


def _all_reduce_average(rank: int, group: dist.ProcessGroup) -> tuple[Tensor, list[float]]:
    tensor = _mine(rank)
    _torch.all_reduce_average(tensor, group)
    return tensor, [5.0, 6.0, 7.0, 8.0]


def _all_reduce_blocking(rank: int, _: dist.ProcessGroup) -> tuple[Tensor, list[float]]:
    tensor = _mine(rank)
    _torch.all_reduce_blocking(tensor)
    return tensor, [10.0, 12.0, 14.0, 16.0]


def _broadcast(rank: int, group: dist.ProcessGroup) -> tuple[Tensor, list[float]]:
    tensor = _mine(rank)
    _torch.broadcast(tensor, 1, group)
    return tensor, [10.0, 11.0, 12.0, 13.0]


def _all_gather_into(rank: int, group: dist.ProcessGroup) -> tuple[Tensor, list[float]]:
    gathered = torch.empty(8)
    _torch.all_gather_into(gathered, _mine(rank), group)
    return gathered, [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]


def _all_gather_into_async(rank: int, group: dist.ProcessGroup) -> tuple[Tensor, list[float]]:
    gathered = torch.empty(8)
    _torch.all_gather_into_async(gathered, _mine(rank), group).wait()
    return gathered, [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]


def _reduce_scatter_sum(rank: int, group: dist.ProcessGroup) -> tuple[Tensor, list[float]]:
    mine = torch.empty(2)
    _torch.reduce_scatter_sum(mine, _mine(rank), group)
    return mine, [[10.0, 12.0], [14.0, 16.0]][rank]


def _reduce_scatter_average(rank: int, group: dist.ProcessGroup) -> tuple[Tensor, list[float]]:
    mine = torch.empty(2)
    _torch.reduce_scatter_average(mine, _mine(rank), group)
    return mine, [[5.0, 6.0], [7.0, 8.0]][rank]


CALLS: Final[dict[str, _Call]] = {
    call.__name__.lstrip("_"): call
    for call in (
        _all_reduce,
        _all_reduce_max,
        _all_reduce_average,
        _all_reduce_blocking,
        _broadcast,
        _all_gather_into,
        _all_gather_into_async,
        _reduce_scatter_sum,
        _reduce_scatter_average,
    )
}


@contextmanager
def _recording(handed: list[tuple[Tensor, ...]]) -> Iterator[None]:
    """Append every tuple of aliases ``_torch`` hands a collective to ``handed``."""
    hand_over: Callable[..., tuple[Tensor, ...] | None] = vars(_torch)["hand_over"]

    def recorded(group: dist.ProcessGroup, *tensors: Tensor) -> tuple[Tensor, ...] | None:
        aliases = hand_over(group, *tensors)
        if aliases is not None:
            handed.append(aliases)
        return aliases

    vars(_torch)["hand_over"] = recorded
    try:
        yield
    finally:
        vars(_torch)["hand_over"] = hand_over


_use_count: Final[Callable[[Tensor], int]] = getattr(Tensor, "_use_count")  # noqa: B009


def _held_elsewhere(aliases: tuple[Tensor, ...]) -> list[int]:
    """How many references other than its own object each alias has (C++ ones: gloo's)."""
    return [_use_count(alias) - 1 for alias in aliases]


def _each_call_ends_let_go(rank: int, world_size: int) -> dict[str, tuple[int, int]]:
    """Per call: the rounds whose aliases gloo still held on return, and wrong results."""
    group = dist.group.WORLD
    assert group is not None
    assert world_size == 2
    found: dict[str, tuple[int, int]] = {}
    for name, call in CALLS.items():
        handed: list[tuple[Tensor, ...]] = []
        held = wrong = 0
        with _recording(handed):
            for round_ in range(ROUNDS):
                result, expected = call(rank, group)
                assert len(handed) == round_ + 1, name
                held += any(_held_elsewhere(handed[-1]))
                wrong += result.tolist() != expected
        found[name] = (held, wrong)
    return found


def test_gloo_holds_no_tensor_of_a_collective_that_returned() -> None:
    """On 2 ranks, each call of each collective: no alias held, the result in place."""
    for found in run_distributed(_each_call_ends_let_go, 2, timeout=120.0):
        assert found == dict.fromkeys(CALLS, (0, 0))


@pytest.mark.parametrize("default_group", ["gloo"], indirect=True)
def test_an_alias_is_a_tensor_of_its_own_on_the_callers_memory(
    default_group: dist.ProcessGroup,
) -> None:
    tensor = torch.arange(4.0)[1:]
    aliases = _let_go.hand_over(default_group, tensor)
    assert aliases is not None
    (alias,) = aliases
    assert alias is not tensor
    assert (alias.data_ptr(), alias.shape, alias.stride()) == (
        tensor.data_ptr(),
        tensor.shape,
        tensor.stride(),
    )
    assert _use_count(alias) == 1  # nothing else holds it; the caller's tensor neither


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


@pytest.mark.parametrize("default_group", ["gloo"], indirect=True)
def test_a_sparse_tensor_is_handed_over_itself(default_group: dist.ProcessGroup) -> None:
    """Gloo's sparse all-reduce replaces the members of the tensor it is given."""
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[0]]), torch.tensor([1.0]), (4,), check_invariants=True
    )
    assert _let_go.hand_over(default_group, torch.ones(2), sparse) is None


@pytest.mark.parametrize("default_group", ["gloo"], indirect=True)
def test_works_torch_keeps_after_their_end_are_not_waited_for(
    default_group: dist.ProcessGroup,
) -> None:
    """Collectives as graph inputs: torch keeps each work, and its tensors, until waited."""
    with allow_inflight_collective_as_graph_input_ctx():
        assert _let_go.hand_over(default_group, torch.ones(2)) is None
    assert _let_go.hand_over(default_group, torch.ones(2)) is not None


@pytest.mark.parametrize("default_group", ["gloo"], indirect=True)
def test_a_wait_that_runs_out_warns_once_and_waits_no_more(
    default_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_let_go, "LET_GO_SECONDS", 0.01)
    monkeypatch.setattr(_let_go._Waiting, "enabled", True)
    tensor = torch.ones(4)
    view = tensor[:2]  # holds ``tensor``: its count stays above one
    message = (
        "torchcontract: gloo still held a collective's tensors 0.01 s after it ended, so "
        "fully_shard and replicate no longer wait for gloo's thread in this process; a "
        "script that ends right after a gloo collective may now abort at exit"
    )
    with pytest.warns(RuntimeWarning) as warned:
        _let_go.let_go((tensor,))
    assert [str(warning.message) for warning in warned] == [message]
    assert _let_go.hand_over(default_group, torch.ones(2)) is None
    del view


@pytest.mark.parametrize("default_group", ["gloo", "fake"], indirect=True)
def test_the_first_collective_on_gloo_registers_the_exit_grace_once(
    default_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At exit, gloo's threads get the GIL to free what PyTorch's collectives left them."""
    registered: list[tuple[object, ...]] = []

    def register(*call: object) -> None:
        registered.append(call)

    monkeypatch.setattr(_let_go._ExitGrace, "registered", False)
    monkeypatch.setattr(atexit, "register", register)
    for _ in range(2):
        _torch.all_reduce(torch.ones(2), default_group).wait()
    if dist.get_backend(default_group) == "gloo":
        assert registered == [(time.sleep, _let_go.EXIT_GRACE_SECONDS)]
    else:
        assert registered == []


@pytest.fixture
def detail_debug_level() -> Iterator[None]:
    """``TORCH_DISTRIBUTED_DEBUG=DETAIL``: c10d wraps each backend in a checking wrapper."""
    level = c10d.get_debug_level()
    c10d.set_debug_level(c10d.DebugLevel.DETAIL)
    try:
        yield
    finally:
        c10d.set_debug_level(level)


@pytest.mark.usefixtures("detail_debug_level")
def test_gloo_wrapped_for_debugging_is_gloo() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group("gloo", init_method=address, rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert group is not None
        wrapper = vars(dist.distributed_c10d)["_ProcessGroupWrapper"]
        assert isinstance(group._get_backend(CPU), wrapper)
        assert _backends.serving_backend(group, CPU) == _backends.ServingBackend("gloo", True)
    finally:
        dist.destroy_process_group()


def test_a_gloo_backend_used_as_a_group_is_served_by_gloos_threads() -> None:
    """A backend built from a store, as DDP's and replicate's broadcasts take one."""
    backend = cast(
        dist.ProcessGroup, dist.ProcessGroupGloo(c10d.HashStore(), 0, 1, timedelta(seconds=60))
    )
    assert _backends.serving_backend(backend, CPU) == _backends.ServingBackend("gloo", True)
    tensor = torch.arange(3.0)
    _torch.broadcast(tensor, 0, backend)
    assert tensor.tolist() == [0.0, 1.0, 2.0]


class _Mirror(PythonGroup):
    backend = "mirror"


def test_the_backends_answer_keeps_no_group_alive() -> None:
    group = _Mirror(0, 2)
    assert _backends.serving_backend(group, CPU) == _backends.ServingBackend("mirror", False)
    assert _backends.serving_backend(group, CPU) is _backends.serving_backend(group, CPU)
    dead = weakref.ref(group)
    del group
    gc.collect()
    assert dead() is None
