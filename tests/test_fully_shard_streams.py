"""The accelerator's stream orderings, as FSDP2's, on a fake stream API that logs them.

``_streams.CommStreams`` is what ``fully_shard`` does with streams on an accelerator;
here it runs over ``FakeBackend``, which records each wait, event and stream switch
instead of queueing them, on a fake process group of 2 CPU ranks. The order of that
log is FSDP2's design: copy-in on its stream, the collective on the all-gather stream
after it, the copy-out on the compute stream after the gather's event; the
reduce-scatter on its stream after the compute stream, and the end of backward
waiting for it. And FSDP2's memory discipline: each buffer freed only once the stream
that allocated it waits for the last use on another stream, so the caching allocator
reuses it in stream order, and only so many in flight (the log shows each watched
buffer's allocation and freeing). The real streams run under
``tests/distributed/test_cuda_streams.py``.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from fake_streams import FakeBackend, assert_waits_for_the_reshard, use_fake_streams
from fake_world import fake_mesh
from torch import Tensor, nn

from torchcontract.apis import fully_shard
from torchcontract.apis.fully_shard import _copies


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return cast(Tensor, self.second(self.first(x)))


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> FakeBackend:
    """The fake stream API; it also watches each batched gather's and reduction's buffer,
    and logs each store of reduced gradients with the watched input it reads, if any."""
    fake = use_fake_streams(monkeypatch)
    counts = {"gathered": 0, "reduce input": 0}
    inputs: dict[int, str] = {}  # the storage of each reduction input alive, by address

    def watched(kind: str, tensor: Tensor) -> Tensor:
        counts[kind] += 1
        name = f"{kind} {counts[kind]}"
        fake.watch(tensor, name)
        if kind == "reduce input":
            address = tensor.untyped_storage().data_ptr()
            inputs[address] = name
            weakref.finalize(tensor.untyped_storage(), inputs.pop, address, None)
        return tensor

    copy_in, gradient_input = _copies.copy_in, _copies.gradient_input
    shard_gradients = _copies.shard_gradients

    def logged_shard_gradients(parameters: Any, reduced: Tensor) -> None:
        read = inputs.get(reduced.untyped_storage().data_ptr(), "its own buffer")
        fake.log.append(f"store from {read} on {fake.current_stream()}")
        shard_gradients(parameters, reduced)

    def watched_copy_in(*args: Any) -> tuple[Tensor, Tensor]:
        flat, gathered = copy_in(*args)
        return flat, watched("gathered", gathered)

    def watched_gradient_input(*args: Any) -> Tensor:
        return watched("reduce input", gradient_input(*args))

    monkeypatch.setattr(_copies, "copy_in", watched_copy_in)
    monkeypatch.setattr(_copies, "gradient_input", watched_gradient_input)
    monkeypatch.setattr(_copies, "shard_gradients", logged_shard_gradients)
    return fake


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
    _assert_freed_in_stream_order(log)
    log = _streams_only(log)
    start = log.index("enter copy_in")
    assert log[start : start + 6] == [
        "enter copy_in",
        "leave copy_in",
        "all_gather waits copy_in",
        "enter all_gather",
        "record event1@all_gather",
        "leave all_gather",
    ]
    # The copy-out waits for that event on the compute stream; an event after it follows.
    waited = log.index("compute waits event1@all_gather")
    assert log[waited + 1] == "record event2@compute"
    # 2 groups gather in forward and again in backward (the root has no parameters).
    assert log.count("enter all_gather") == 4


def _streams_only(log: list[str]) -> list[str]:
    """``log`` without the watched buffers' allocations and frees."""
    return [entry for entry in log if not entry.startswith(("alloc ", "free "))]


def _after(log: list[str], start: int, prefix: str, suffix: str) -> tuple[int, str]:
    """The first entry from ``start`` on with ``prefix`` and ``suffix``, and its index."""
    found = [
        i for i in range(start, len(log)) if log[i].startswith(prefix) and log[i].endswith(suffix)
    ]
    assert found, f"no {prefix}...{suffix} after {log[start]!r}"
    return found[0], log[found[0]]


def _assert_freed_in_stream_order(
    log: list[str], *, in_flight: int = 3, inputs: int = 1
) -> dict[str, int]:
    """Each watched buffer is freed only after its allocating stream waited for its last use.

    A gather's output (allocated on the copy-in stream): once the copy-in and all-gather
    streams waited for the event recorded after its copy-out on the compute stream (or,
    dropped unused, after its collective). A reduction's input (allocated on the compute
    stream): once the compute stream waited for the event after its reduce-scatter. At
    most ``in_flight`` gathers' outputs (the one kept after its copy-out, the one in use
    and a prefetch) and ``inputs`` reductions' inputs are alive at once, as FSDP2's.
    Returns the most of each alive at once.
    """
    alive: dict[str, int] = {"gathered": 0, "reduce input": 0}
    most = dict(alive)
    for index, entry in enumerate(log):
        if not entry.startswith(("alloc ", "free ")):
            continue
        action, name = entry.split(" ", 1)
        kind = name.rsplit(" ", 1)[0]
        alive[kind] += 1 if action == "alloc" else -1
        most[kind] = max(most[kind], alive[kind])
        assert alive["gathered"] <= in_flight, log[: index + 1]
        assert alive["reduce input"] <= inputs, log[: index + 1]
        if action == "alloc":
            continue
        start = log.index(f"alloc {name}")
        if kind == "reduce input":
            recorded, event = _after(log, start, "record event", "@reduce_scatter")
            assert f"compute waits {event.removeprefix('record ')}" in log[start:index], name
            # its last read on another stream comes before that event
            assert not any(name in entry for entry in log[recorded:index]), name
            continue
        position, event = _after(log, start, "record event", "@all_gather")
        gathered = event.removeprefix("record ")
        if f"compute waits {gathered}" in log[position:index]:  # copied out: the event after
            waited = log.index(f"compute waits {gathered}", position)
            _, copied = _after(log, waited, "record event", "@compute")
            gathered = copied.removeprefix("record ")
        for stream in ("copy_in", "all_gather"):
            assert f"{stream} waits {gathered}" in log[position:index], (name, stream)
    return most


def _sharded_linears(count: int) -> Any:
    """``count`` seeded ``Linear(4, 4)`` in a Sequential: each layer, then the root, sharded."""
    torch.manual_seed(0)
    model: Any = nn.Sequential(*(nn.Linear(4, 4) for _ in range(count)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _four_blocks(backend: FakeBackend, *, max_inputs: int | None = None) -> list[str]:
    """The log of three steps of four blocks, each prefetching the next in forward and
    backward; ``max_inputs``: ``set_reduce_scatter_max_input_buffers`` on the root."""
    with fake_mesh((2,)):
        model = _sharded_linears(4)
        for current, following in itertools.pairwise(model):
            current.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([current])
        if max_inputs is not None:
            model.set_reduce_scatter_max_input_buffers(max_inputs)
        backend.log.clear()
        for _ in range(3):
            model(torch.ones(2, 4)).sum().backward()
    return list(backend.log)


def test_a_shard_group_of_one_stores_from_a_buffer_of_the_reduce_scatter_stream(
    backend: FakeBackend,
) -> None:
    """As FSDP2's: the input (the compute stream's) is copied into the reduce-scatter stream's
    buffer, whose views become the gradients: the input is done with at the event after."""
    with fake_mesh((1,)):
        model = _sharded()
        backend.log.clear()
        for _ in range(2):  # the second accumulates into the first's .grad
            model(torch.ones(2, 4)).sum().backward()
    log = backend.log
    stores = [entry for entry in log if entry.startswith("store from")]
    assert stores == ["store from its own buffer on reduce_scatter"] * 4
    _assert_freed_in_stream_order(log)


class TwoDtypes(nn.Module):
    """A float32 and a float64 layer: one application reduces them in two collectives."""

    def __init__(self) -> None:
        super().__init__()
        self.single = nn.Linear(4, 4)
        self.wide = nn.Linear(4, 4).double()

    def forward(self, x: Tensor) -> Tensor:
        return cast(Tensor, self.single(x)) + cast(Tensor, self.wide(x.double())).float()


def test_a_reduction_of_two_dtypes_counts_as_one_in_flight(backend: FakeBackend) -> None:
    """Its two inputs are allocated without the compute stream waiting between them (it
    would wait for a reduce-scatter just queued); the next reduction frees both."""
    with fake_mesh((2,)):
        torch.manual_seed(0)
        model: Any = nn.Sequential(TwoDtypes(), TwoDtypes())
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        log = _step(model, backend)
    first, second = log.index("alloc reduce input 1"), log.index("alloc reduce input 2")
    assert not any(entry.startswith("compute waits") for entry in log[first:second])
    third = log.index("alloc reduce input 3")
    assert log[third - 4 : third].count("free reduce input 1") == 1
    assert log[third - 4 : third].count("free reduce input 2") == 1
    most = _assert_freed_in_stream_order(log, in_flight=6, inputs=2)  # 2 buffers a gather
    assert most["reduce input"] == 2


def test_reduce_scatter_max_input_buffers_keeps_that_many_in_flight(
    backend: FakeBackend,
) -> None:
    """Two: each backward's first two inputs are allocated without a wait, then each
    allocation waits for the oldest reduce-scatter only."""
    log = _four_blocks(backend, max_inputs=2)
    most = _assert_freed_in_stream_order(log, in_flight=6, inputs=2)  # 2 buffers a gather
    assert most["reduce input"] == 2
    second = log.index("alloc reduce input 2")
    assert not any(entry.endswith("@reduce_scatter") for entry in log[second - 2 : second])
    first_event = _after(log, log.index("alloc reduce input 1"), "record event", "@reduce_scatter")
    third = log.index("alloc reduce input 3")
    assert log[third - 2 : third] == [
        f"compute waits {first_event[1].removeprefix('record ')}",
        "free reduce input 1",
    ]


def test_reduce_scatter_max_input_buffers_is_read_at_the_first_forward(
    backend: FakeBackend,
) -> None:
    """As FSDP2's lazy init: a value set after the root's first forward changes nothing."""
    with fake_mesh((2,)):
        model = _sharded_linears(3)
        model(torch.ones(2, 4)).sum().backward()
        model.set_reduce_scatter_max_input_buffers(2)
        log = _step(model, backend)
    assert _assert_freed_in_stream_order(log)["reduce input"] == 1


def test_memory_is_freed_in_stream_order_over_steps_with_prefetch(
    backend: FakeBackend,
) -> None:
    log = _four_blocks(backend)
    assert _assert_freed_in_stream_order(log)["reduce input"] == 1
    # 4 gathers in each forward and backward, 4 reductions in each backward: all freed by
    # the end of the last backward.
    assert sum(entry.startswith("alloc gathered") for entry in log) == 24
    assert sum(entry.startswith("free gathered") for entry in log) == 24
    assert sum(entry.startswith("alloc reduce input") for entry in log) == 12
    assert sum(entry.startswith("free reduce input") for entry in log) == 12


def test_reduce_scatter_on_its_stream_and_backward_end_waits_for_it(
    backend: FakeBackend,
) -> None:
    with fake_mesh((2,)):
        log = _step(_sharded(), backend)
    reductions = [i for i, entry in enumerate(log) if entry == "reduce_scatter waits compute"]
    assert len(reductions) == 2
    for index in reductions:
        assert log[index + 1] == "enter reduce_scatter"
    # Each reduction records the event after its reduce-scatter (its input's), then the one
    # after its last work (here the same stream).
    reduce_events = _recorded(log, "reduce_scatter")
    assert len(reduce_events) == 4
    # The second reduction's input is allocated once the compute stream waited for the
    # first one's reduce-scatter, which frees the first input.
    assert log.index(f"compute waits {reduce_events[0]}") < log.index("alloc reduce input 2")
    # The end of backward: the compute stream waits for every reduction, and for the input
    # still in flight.
    ends = [f"compute waits {event}" for event in reduce_events[1::2]]
    assert sorted(log[-4:-2]) == sorted(ends)
    assert log[-2:] == [f"compute waits {reduce_events[2]}", "free reduce input 2"]
    _assert_freed_in_stream_order(log)


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
    assert sorted(log[-4:-2]) == sorted(expected)
    _assert_freed_in_stream_order(log)


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
        assert_waits_for_the_reshard(log, index, gathers[2])
        # and handed to the copy-in (weight and bias): not reused before it has read them
        assert log[index + 1 : index + 4] == [
            "record_stream copy_in",
            "record_stream copy_in",
            "leave copy_in",
        ]


def test_every_copy_out_is_waited_for_by_the_gather_streams(backend: FakeBackend) -> None:
    """Forward's copy-outs when the next one is done (the last at the root's forward end),
    backward's at once: then no copy-in reuses a buffer the compute stream still reads.
    Backward's gathers here (after a post-forward reshard) have inputs of their own."""
    log = _post_forward_step(backend)
    waits = [
        index
        for index, entry in enumerate(log)
        if entry.startswith("compute waits event") and entry.endswith("@all_gather")
    ]
    assert len(waits) == 4
    copied = [log[index + 1].removeprefix("record ") for index in waits]
    assert all(event.endswith("@compute") for event in copied)
    # Where the copy-in and then the all-gather stream wait for each copy-out's event.
    released = [log.index(f"copy_in waits {event}") for event in copied]
    assert [log.index(f"all_gather waits {event}") for event in copied] == [
        index + 1 for index in released
    ]
    assert waits[1] < released[0] < released[1] < waits[2]  # forward: kept until the next
    assert released[2:] == [waits[2] + 2, waits[3] + 2]  # backward: at once


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
    hooked = _between(log, "hook_stream waits reduce_scatter", "leave reduce_scatter")
    event = hooked[6].removeprefix("record ")
    assert hooked == [
        "hook_stream waits reduce_scatter",
        "record_stream hook_stream",
        "enter hook_stream",
        "hook",
        "store from its own buffer on hook_stream",
        "leave hook_stream",
        f"record {event}",
        "leave reduce_scatter",
    ]
    assert event.endswith("@hook_stream")
    assert f"compute waits {event}" in log[-3:]


def test_all_reduce_hook_without_a_stream_runs_on_the_all_reduce_stream(
    backend: FakeBackend,
) -> None:
    with fake_mesh((2,)):
        model = _sharded()
        model.second.set_all_reduce_hook(lambda output: backend.log.append("hook"))
        log = _step(model, backend)
    hooked = _between(log, "all_reduce waits reduce_scatter", "leave reduce_scatter")
    assert hooked[:6] == [
        "all_reduce waits reduce_scatter",
        "record_stream all_reduce",
        "enter all_reduce",
        "hook",
        "store from its own buffer on all_reduce",
        "leave all_reduce",
    ]
    event = hooked[6].removeprefix("record ")
    assert event.endswith("@all_reduce")
    assert f"compute waits {event}" in log[-3:]


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
    is dropped; the gather streams wait for its collective before its buffers go, so no
    copy-in reuses them while the gather writes."""
    with fake_mesh((2,)):
        model = _sharded()
        model.first.set_unshard_in_backward(False)
        log = _step(model, backend)
    recorded, waited = _gathers_and_waits(log)
    assert len(recorded) == 4  # both in forward, and both in backward (the first one dropped)
    assert waited == recorded[:3]  # the dropped one is never copied out
    freed = log.index("free gathered 4")
    assert log[freed - 2 : freed] == [
        f"copy_in waits {recorded[3]}",
        f"all_gather waits {recorded[3]}",
    ]
    _assert_freed_in_stream_order(log)


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
        assert len(reduced) == 2  # second's (its input's, its end's), before the failure
        backend.log.clear()
        model(torch.ones(2, 4))
    assert backend.log[:5] == [
        f"compute waits {reduced[1]}",
        f"compute waits {reduced[0]}",
        "free reduce input 1",
        "copy_in waits compute",
        "all_gather waits compute",
    ]
