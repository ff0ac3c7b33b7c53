"""FSDP2's communication streams on an accelerator: all-gather, copy-in, reduce-scatter, all-reduce.

On a mesh of an accelerator (``torch.get_device_module(device_type)``), as FSDP2's
``FSDPCommContext``: the all-gather's copy-in runs on a stream of its own, the
collective on another, and the copy-out on the compute stream once it waits for the
all-gather's event; the reduce-scatter (and HSDP's all-reduce after it) runs on
streams of its own once they wait for the compute stream, and the end of backward
waits for the event recorded after the last reduction. So the communication of one
layer overlaps the compute of another in both directions.

Memory crosses streams as in FSDP2, by holding buffers until the stream that
allocated them is ordered after every use, then freeing them, so the caching
allocator reuses them in stream order, however far the CPU runs ahead: a gather's
buffers (allocated on the copy-in stream) until the copy-in and all-gather streams
wait for the event after their copy-out, one forward gather's kept until the next
copy-out (FSDP2's ``all_gather_state``); a reduction's input (allocated on the
compute stream) until the compute stream waits for its reduce-scatter, before the
next input is allocated (FSDP2's ``reduce_scatter_states``, one in flight). Only
what another stream reads after the owner is done with it is recorded on that stream
(``record_stream``): what a post-forward reshard kept, the reduced shards under
HSDP's all-reduce and the all-reduce hook.

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
        # FSDP2's all_gather_state: a forward gather's buffers, kept after their copy-out
        # until the gather streams wait for its event (the next forward copy-out).
        self._kept_gather: tuple[torch.Event, tuple[Tensor, ...]] | None = None
        # FSDP2's reduce_scatter_states: per group reduction, oldest first, its inputs (one
        # a dtype), each with the event after its reduce-scatter; at most
        # ``max_reduce_inputs`` reductions' inputs in flight.
        self._reduce_inputs: list[list[tuple[torch.Event, Tensor]]] = []
        self.max_reduce_inputs = 1

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

    def resharded_after_forward(self) -> torch.Event:
        """After a post-forward reshard on the compute stream: the event its gather waits for."""
        return self.backend.record_event(self.backend.current_stream())

    def gather_after_reshard(self, event: torch.Event) -> None:
        """Before a gather of what a post-forward reshard kept (written on the compute stream).

        FSDP2's ``_reshard_after_forward_event``: the gather streams wait for the
        reshard only, not for the backward compute queued since, so the gather can
        still run ahead of it.
        """
        self._gather_streams_wait(event)

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

    def copy_out_after(self, event: torch.Event) -> None:
        """Before the copy-out: the compute stream waits for the gather's ``event``."""
        self.backend.wait_event(self.backend.current_stream(), event)

    def copied_out(self, buffers: Iterable[Tensor], *, keep: bool) -> None:
        """After a copy-out from ``buffers``: when the gather streams may reuse their memory.

        As FSDP2's ``wait_for_unshard``: the copy-in and all-gather streams wait for the
        event recorded now, then the buffers are freed. ``keep`` (a forward's gather):
        they are kept, and the wait put off, until the next forward copy-out or the end
        of the root's forward (``release_kept_gather``), so that this copy-out overlaps
        the next all-gather; the kept ones before them go then.
        """
        event = self.backend.record_event(self.backend.current_stream())
        if keep:
            self.release_kept_gather()
            self._kept_gather = (event, tuple(buffers))
        else:
            self._gather_streams_wait(event)

    def release_kept_gather(self) -> None:
        """Free a forward gather's kept buffers: the gather streams wait for their copy-out."""
        kept, self._kept_gather = self._kept_gather, None
        if kept is not None:
            self._gather_streams_wait(kept[0])

    def drop_gather(self, event: torch.Event) -> None:
        """A gather dropped unused: its buffers go once the gather streams wait for ``event``.

        ``event``: the all-gather stream's, after the collective that writes them.
        """
        self._gather_streams_wait(event)

    def _gather_streams_wait(self, event: torch.Event) -> None:
        self.backend.wait_event(self.copy_in, event)
        self.backend.wait_event(self.all_gather, event)

    def before_reduce_inputs(self) -> None:
        """Before a group's reduction allocates its inputs on the compute stream: free the oldest.

        As FSDP2's ``post_backward``: while ``max_reduce_inputs`` reductions' inputs are
        in flight, the compute stream waits for the oldest one's reduce-scatters, and its
        inputs are freed (reused by the compute stream only after them).
        """
        current = self.backend.current_stream()
        while len(self._reduce_inputs) >= self.max_reduce_inputs:
            for event, _ in self._reduce_inputs.pop(0):
                self.backend.wait_event(current, event)
        self._reduce_inputs.append([])

    def reduce_scattered(self, flat: Tensor) -> None:
        """Right after the reduce-scatter of ``flat``, on its stream: its last use of ``flat``.

        ``flat`` is held until the compute stream waits for the event recorded now.
        """
        event = self.backend.record_event(self.backend.current_stream())
        self._reduce_inputs[-1].append((event, flat))

    @contextmanager
    def reducing(self) -> Generator[None]:
        """A reduction (its input copied in on the compute stream): on the reduce-scatter stream."""
        self.backend.wait_stream(self.reduce_scatter, self.backend.current_stream())
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
        """At the end of backward: the compute stream waits for every group's reduction.

        The reductions' inputs still held are freed then: their reduce-scatters are done
        before the compute stream goes on.
        """
        current = self.backend.current_stream()
        for event in events:
            self.backend.wait_event(current, event)
        inputs, self._reduce_inputs = self._reduce_inputs, []
        for event, _ in (held for reduction in inputs for held in reduction):
            self.backend.wait_event(current, event)


def streams_for(device_type: str) -> CommStreams | None:
    """The communication streams for a mesh of ``device_type``; None on the CPU."""
    if device_type in {"cpu", "meta"}:
        return None
    module = torch.get_device_module(device_type)
    if not all(hasattr(module, name) for name in ("Stream", "stream", "current_stream")):
        return None  # an accelerator without a stream API: its collectives run in order
    return CommStreams(DeviceBackend(device_type))
