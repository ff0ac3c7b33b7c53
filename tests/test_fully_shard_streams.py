"""The accelerator's stream orderings, as FSDP2's, on a fake stream API that logs them.

``_streams.CommStreams`` is what ``fully_shard`` does with streams on an accelerator;
here it runs over ``FakeBackend``, which records each wait, event and stream switch
instead of queueing them, on a fake process group of 2 CPU ranks. The order of that
log is FSDP2's design: copy-in on its stream, the collective on the all-gather stream
after it, the copy-out on the compute stream after the gather's event; the
reduce-scatter on its stream after the compute stream, and the end of backward
waiting for it. The real streams run under ``tests/distributed/test_cuda_streams.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from fake_streams import FakeBackend, use_fake_streams
from fake_world import fake_mesh
from torch import Tensor, nn

from torchcontract.apis import fully_shard


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return cast(Tensor, self.second(self.first(x)))


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> FakeBackend:
    return use_fake_streams(monkeypatch)


def _sharded() -> Any:
    torch.manual_seed(0)
    model = Model()
    fully_shard(model.first)
    fully_shard(model.second)
    fully_shard(model)
    return model


def _step(model: Any, backend: FakeBackend) -> list[str]:
    """The log of one forward and backward."""
    backend.log.clear()
    model(torch.ones(2, 4)).sum().backward()
    return list(backend.log)


def test_forward_copy_in_waits_for_compute_once_per_iteration(backend: FakeBackend) -> None:
    with fake_mesh((2,)):
        log = _step(_sharded(), backend)
    assert log[:2] == ["copy_in waits compute", "all_gather waits compute"]
    assert log.count("copy_in waits compute") == 1


def test_all_gather_copy_in_then_collective_then_copy_out_after_event(
    backend: FakeBackend,
) -> None:
    with fake_mesh((2,)):
        log = _step(_sharded(), backend)
    start = log.index("enter copy_in")
    assert log[start : start + 6] == [
        "enter copy_in",
        "leave copy_in",
        "all_gather waits copy_in",
        "enter all_gather",
        "record event1@all_gather",
        "leave all_gather",
    ]
    # The copy-out waits for that event on the compute stream and holds the output there.
    waited = log.index("compute waits event1@all_gather")
    assert log[waited + 1] == "record_stream compute"
    # 2 groups gather in forward and again in backward (the root has no parameters).
    assert log.count("enter all_gather") == 4


def test_reduce_scatter_on_its_stream_and_backward_end_waits_for_it(
    backend: FakeBackend,
) -> None:
    with fake_mesh((2,)):
        log = _step(_sharded(), backend)
    reductions = [i for i, entry in enumerate(log) if entry == "reduce_scatter waits compute"]
    assert len(reductions) == 2
    for index in reductions:
        assert log[index + 1 : index + 3] == [
            "record_stream reduce_scatter",
            "enter reduce_scatter",
        ]
    events = [entry.split()[1] for entry in log if entry.startswith("record event")]
    reduce_events = [event for event in events if event.endswith("@reduce_scatter")]
    assert len(reduce_events) == 2
    # The end of backward: the compute stream waits for every reduction, after the last.
    assert sorted(log[-2:]) == sorted(f"compute waits {event}" for event in reduce_events)


def test_hsdp_all_reduce_on_its_stream_after_the_reduce_scatter(backend: FakeBackend) -> None:
    with fake_mesh((2, 2), ("replicate", "shard")) as mesh:
        torch.manual_seed(0)
        model: Any = Model()
        for module in (model.first, model.second, model):
            fully_shard(module, mesh=mesh)
        log = _step(model, backend)
    assert log.count("all_reduce waits reduce_scatter") == 2
    index = log.index("all_reduce waits reduce_scatter")
    # Its buffer, from the reduce-scatter stream, is not reused before the all-reduce is done.
    assert log[index + 1 : index + 3] == ["record_stream all_reduce", "enter all_reduce"]
    expected = [f"compute waits event{n}@all_reduce" for n in _events(log, "all_reduce")]
    assert sorted(log[-2:]) == sorted(expected)


def _events(log: list[str], stream: str) -> list[int]:
    return [int(event.split("event")[1].split("@")[0]) for event in _recorded(log, stream)]


def test_post_optim_event_replaces_the_wait_for_compute(backend: FakeBackend) -> None:
    with fake_mesh((2,)):
        model = _sharded()
        _step(model, backend)
        model.set_post_optim_event(cast(torch.Event, "optimizer-event"))
        log = _step(model, backend)
        after = _step(model, backend)
    assert log[:2] == ["copy_in waits optimizer-event", "all_gather waits optimizer-event"]
    assert "copy_in waits compute" not in log
    assert after[0] == "copy_in waits compute"  # for one iteration only, as FSDP2's


def test_user_unshard_runs_on_the_callers_stream(backend: FakeBackend) -> None:
    """As FSDP2's: outside a forward or backward, the copy-in streams are not used."""
    with fake_mesh((2,)):
        model = _sharded()
        _step(model, backend)
        backend.log.clear()
        model.first.unshard()
        model.first.reshard()
    assert "enter copy_in" not in backend.log
    assert "enter all_gather" not in backend.log


def _post_forward_step(backend: FakeBackend) -> list[str]:
    """The log of a step whose layers reshard to 2 ranks of 4 after forward (an int)."""
    with fake_mesh((4,)) as flat:
        torch.manual_seed(0)
        model: Any = Model()
        for module in (model.first, model.second):
            fully_shard(module, mesh=flat, reshard_after_forward=2)
        fully_shard(model, mesh=flat)
        return _step(model, backend)


def test_post_forward_gather_waits_for_what_the_forward_kept(backend: FakeBackend) -> None:
    """An int reshard_after_forward: backward's copy-in reads what forward kept, on compute."""
    log = _post_forward_step(backend)
    gathers = [index for index, entry in enumerate(log) if entry == "enter copy_in"]
    assert len(gathers) == 4  # 2 in forward, 2 in backward
    for index in gathers[:2]:  # the shards: the copy-in waited once, at the root's forward
        assert log[index - 1] != "copy_in waits compute"
    for index in gathers[2:]:  # what forward kept, written on the compute stream
        assert log[index - 1] == "copy_in waits compute"
        # and handed to the copy-in (weight and bias): not reused before it has read them
        assert log[index + 1 : index + 4] == [
            "record_stream copy_in",
            "record_stream copy_in",
            "leave copy_in",
        ]


def test_a_gather_input_of_its_own_is_held_by_the_compute_stream_too(
    backend: FakeBackend,
) -> None:
    """The batched input is a view of the output; a post-forward gather's is not (FSDP2's
    discipline: no copy-in may reuse an input the all-gather stream is still reading)."""
    log = _post_forward_step(backend)
    waits = [
        index
        for index, entry in enumerate(log)
        if entry.startswith("compute waits event") and entry.endswith("@all_gather")
    ]
    held = [log[index + 1 : index + 3].count("record_stream compute") for index in waits]
    assert held == [1, 1, 2, 2]  # forward: the output alone; backward: output and input


def _between(log: list[str], first: str, last: str) -> list[str]:
    start = log.index(first)
    return log[start : log.index(last, start) + 1]


def test_all_reduce_hook_on_its_stream_after_the_reduction(backend: FakeBackend) -> None:
    """As FSDP2's: the hook's stream waits for the reduce-scatter and holds its output; the
    store runs there after the hook, and the end of backward waits for that stream."""
    with fake_mesh((2,)):
        model = _sharded()
        hook_stream: Any = "hook_stream"
        model.second.set_all_reduce_hook(
            lambda output: backend.log.append("hook"), stream=hook_stream
        )
        log = _step(model, backend)
    assert _between(log, "hook_stream waits reduce_scatter", "leave reduce_scatter") == [
        "hook_stream waits reduce_scatter",
        "record_stream hook_stream",
        "enter hook_stream",
        "hook",
        "leave hook_stream",
        "record event5@hook_stream",
        "leave reduce_scatter",
    ]
    assert "compute waits event5@hook_stream" in log[-2:]


def test_all_reduce_hook_without_a_stream_runs_on_the_all_reduce_stream(
    backend: FakeBackend,
) -> None:
    with fake_mesh((2,)):
        model = _sharded()
        model.second.set_all_reduce_hook(lambda output: backend.log.append("hook"))
        log = _step(model, backend)
    hooked = _between(log, "all_reduce waits reduce_scatter", "leave reduce_scatter")
    assert hooked[:5] == [
        "all_reduce waits reduce_scatter",
        "record_stream all_reduce",
        "enter all_reduce",
        "hook",
        "leave all_reduce",
    ]
    event = hooked[5].removeprefix("record ")
    assert event.endswith("@all_reduce")
    assert f"compute waits {event}" in log[-2:]


def _recorded(log: list[str], stream: str) -> list[str]:
    """The events recorded on ``stream``, in order."""
    return [
        entry.removeprefix("record ")
        for entry in log
        if entry.startswith("record event") and entry.endswith(f"@{stream}")
    ]


def _gathers_and_waits(log: list[str]) -> tuple[list[str], list[str]]:
    """The all-gather events recorded, and those the compute stream waited for."""
    recorded = _recorded(log, "all_gather")
    waited = [
        entry.removeprefix("compute waits ")
        for entry in log
        if entry.startswith("compute waits event") and entry.endswith("@all_gather")
    ]
    return recorded, waited


def test_a_dropped_prefetch_is_waited_for_before_its_buffers_go(backend: FakeBackend) -> None:
    """``set_unshard_in_backward(False)``: the gather prefetched for backward goes unused and
    is dropped; the compute stream still waits for it and holds its buffers (as FSDP2's
    wait on the all-gather event), so no copy-in reuses them while the gather writes."""
    with fake_mesh((2,)):
        model = _sharded()
        model.first.set_unshard_in_backward(False)
        log = _step(model, backend)
    recorded, waited = _gathers_and_waits(log)
    assert len(recorded) == 4  # both in forward, and both in backward (the first one dropped)
    assert waited == recorded
    for event in recorded:
        index = log.index(f"compute waits {event}")
        assert log[index + 1] == "record_stream compute"


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        raise RuntimeError("boom")


class FailingModel(Model):
    """``Model`` whose backward raises between the two layers, after ``second``'s reduction."""

    def forward(self, x: Tensor) -> Tensor:
        boom = cast(Callable[[Tensor], Tensor], _Boom.apply)
        hidden = boom(self.first(x))
        return cast(Tensor, self.second(hidden))


def test_after_a_failed_backward_the_next_forward_waits_for_its_reductions(
    backend: FakeBackend,
) -> None:
    """As FSDP2's reset: a reduce-scatter of the failed backward may still write ``.grad``."""
    with fake_mesh((2,)):
        torch.manual_seed(0)
        model: Any = FailingModel()
        for module in (model.first, model.second, model):
            fully_shard(module)
        with pytest.raises(RuntimeError, match="boom"):
            _step(model, backend)
        reduced = _recorded(backend.log, "reduce_scatter")
        assert len(reduced) == 1  # second's, before the failure
        backend.log.clear()
        model(torch.ones(2, 4))
    assert backend.log[:3] == [
        f"compute waits {reduced[0]}",
        "copy_in waits compute",
        "all_gather waits compute",
    ]
