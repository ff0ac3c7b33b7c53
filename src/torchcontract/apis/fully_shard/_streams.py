"""FSDP2's communication streams on an accelerator: all-gather, copy-in, reduce-scatter, all-reduce.

On a mesh of an accelerator (``torch.get_device_module(device_type)``), as FSDP2's
``FSDPCommContext``: the all-gather's copy-in runs on a stream of its own, the
collective on another, and the copy-out on the compute stream once it waits for the
all-gather's event; the reduce-scatter (and HSDP's all-reduce after it) runs on
streams of its own once they wait for the compute stream, and the end of backward
waits for the event recorded after the last reduction. So the communication of one
layer overlaps the compute of another in both directions.

Memory crosses streams with ``record_stream``: the all-gather's output (allocated on
the copy-in stream) is recorded on the compute stream that copies out of it, and the
reduce-scatter's input (allocated on the compute stream) on the stream that sends it;
the caching allocator then reuses neither before those streams are past them.

On the CPU (gloo) there is no stream: ``streams_for`` gives None and every
collective runs on the caller's thread, as before. ``StreamBackend`` is what this
needs of a device module; a test passes a fake one that records the order of the
waits and events (``tests/test_fully_shard_streams.py``).
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol, cast

import torch
from torch import Tensor

__all__ = ["CommStreams", "DeviceBackend", "StreamBackend", "streams_for"]


class StreamBackend(Protocol):
    """What the communication streams need of a device: ``torch``'s stream API, or a fake."""

    def current_stream(self) -> torch.Stream: ...

    def new_stream(self, priority: int) -> torch.Stream: ...

    def use(self, stream: torch.Stream) -> AbstractContextManager[object]: ...

    def wait_stream(self, waiter: torch.Stream, waited: torch.Stream) -> None: ...

    def wait_event(self, waiter: torch.Stream, event: torch.Event) -> None: ...

    def record_event(self, stream: torch.Stream) -> torch.Event: ...

    def record_stream(self, tensor: Tensor, stream: torch.Stream) -> None: ...


class DeviceBackend:
    """``StreamBackend`` on a real accelerator, through ``torch.get_device_module``."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.module = torch.get_device_module(device_type)

    def current_stream(self) -> torch.Stream:
        stream: torch.Stream = self.module.current_stream()
        return stream

    def new_stream(self, priority: int) -> torch.Stream:
        stream: torch.Stream = self.module.Stream(priority=priority)
        return stream

    def use(self, stream: torch.Stream) -> AbstractContextManager[object]:
        context: AbstractContextManager[object] = self.module.stream(stream)
        return context

    def wait_stream(self, waiter: torch.Stream, waited: torch.Stream) -> None:
        waiter.wait_stream(waited)

    def wait_event(self, waiter: torch.Stream, event: torch.Event) -> None:
        waiter.wait_event(event)

    def record_event(self, stream: torch.Stream) -> torch.Event:
        return stream.record_event()

    def record_stream(self, tensor: Tensor, stream: torch.Stream) -> None:
        tensor.record_stream(stream)


class CommStreams:
    """The streams of one root's groups, and the orderings FSDP2 puts between them.

    Made at the root's first forward (FSDP2's lazy init); high priority for the
    all-gather and reduce-scatter streams, as FSDP2's, so they are not starved.
    """

    def __init__(self, backend: StreamBackend) -> None:
        self.backend = backend
        self.copy_in = backend.new_stream(-1)
        self.all_gather = backend.new_stream(-1)
        self.reduce_scatter = backend.new_stream(-1)
        self.all_reduce = backend.new_stream(0)
        self.post_optim_event: torch.Event | None = None

    def start_iteration(self) -> None:
        """At the root's forward: the copy-in waits for the optimizer step (its event, if set).

        Only here, as FSDP2's root pre-forward: a copy-in reads the shards, which only
        the optimizer writes, so a prefetch's copy-in need not wait for the compute
        queued since.
        """
        event, self.post_optim_event = self.post_optim_event, None
        if event is not None:
            self.backend.wait_event(self.copy_in, event)
            self.backend.wait_event(self.all_gather, event)
        else:
            current = self.backend.current_stream()
            self.backend.wait_stream(self.copy_in, current)
            self.backend.wait_stream(self.all_gather, current)

    def copy_in_waits_compute(self) -> None:
        """Before a gather of what a post-forward reshard kept: written on the compute stream.

        FSDP2's ``_reshard_after_forward_event``, waited for by the all-gather streams.
        """
        self.backend.wait_stream(self.copy_in, self.backend.current_stream())

    def hold_for_copy_in(self, tensors: Iterable[Tensor]) -> None:
        """Inputs handed to the copy-in that were written on the compute stream.

        What a post-forward reshard kept: the copy-in owns them once taken, so their
        memory is reused only once the copy-in stream is past them.
        """
        for tensor in tensors:
            self.backend.record_stream(tensor, self.copy_in)

    def copying_in(self) -> AbstractContextManager[object]:
        """The all-gather's copy-in: on its own stream."""
        return self.backend.use(self.copy_in)

    @contextmanager
    def gathering(self) -> Generator[None]:
        """The all-gather collective: on its stream, after the copy-in."""
        self.backend.wait_stream(self.all_gather, self.copy_in)
        with self.backend.use(self.all_gather):
            yield

    def gathered(self) -> torch.Event:
        """The event the copy-out waits for: recorded on the all-gather stream."""
        return self.backend.record_event(self.all_gather)

    def copy_out_after(self, event: torch.Event, *tensors: Tensor) -> None:
        """Before the copy-out: the compute stream waits for the gather, and holds ``tensors``.

        ``tensors``: the gather's output, and its input where that is not a view of it;
        their memory is reused only once the compute stream, and so the gather, is past them.
        """
        current = self.backend.current_stream()
        self.backend.wait_event(current, event)
        for tensor in tensors:
            self.backend.record_stream(tensor, current)

    @contextmanager
    def reducing(self, flat: Tensor) -> Generator[None]:
        """The reduce-scatter of ``flat`` (copied in on the compute stream): on its stream."""
        current = self.backend.current_stream()
        self.backend.wait_stream(self.reduce_scatter, current)
        self.backend.record_stream(flat, self.reduce_scatter)
        with self.backend.use(self.reduce_scatter):
            yield

    @contextmanager
    def all_reducing(self, reduced: Tensor) -> Generator[None]:
        """HSDP's all-reduce of ``reduced``, after the reduce-scatter: on its own stream.

        ``reduced`` (allocated on the reduce-scatter stream) is recorded on the
        all-reduce stream: the next reduce-scatter reuses its memory only after the
        all-reduce is done with it (FSDP2 keeps a reference for that, PR #140044).
        """
        self.backend.wait_stream(self.all_reduce, self.reduce_scatter)
        self.backend.record_stream(reduced, self.all_reduce)
        with self.backend.use(self.all_reduce):
            yield

    @contextmanager
    def hooking(self, reduced: Tensor, stream: object | None) -> Generator[torch.Stream]:
        """The all-reduce hook on ``reduced``, and the store after it, as FSDP2's.

        On ``stream`` (``set_all_reduce_hook``'s), or the all-reduce stream if None,
        once it waits for the reduction; ``reduced`` is recorded there, so its memory
        is reused only once the hook and the store are done with it. Yields that
        stream: the end of backward waits for its event.
        """
        hook_stream = self.all_reduce if stream is None else cast(torch.Stream, stream)
        self.backend.wait_stream(hook_stream, self.backend.current_stream())
        self.backend.record_stream(reduced, hook_stream)
        with self.backend.use(hook_stream):
            yield hook_stream

    def reduced(self, last: torch.Stream) -> torch.Event:
        """The event the end of backward waits for: after the last stream of a reduction."""
        return self.backend.record_event(last)

    def finish_backward(self, events: list[torch.Event]) -> None:
        """At the end of backward: the compute stream waits for every group's reduction."""
        current = self.backend.current_stream()
        for event in events:
            self.backend.wait_event(current, event)


def streams_for(device_type: str) -> CommStreams | None:
    """The communication streams for a mesh of ``device_type``; None on the CPU."""
    if device_type in {"cpu", "meta"}:
        return None
    module = torch.get_device_module(device_type)
    if not all(hasattr(module, name) for name in ("Stream", "stream", "current_stream")):
        return None  # an accelerator without a stream API: its collectives run in order
    return CommStreams(DeviceBackend(device_type))
