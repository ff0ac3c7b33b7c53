"""A fake accelerator stream API that logs, in order, what fully_shard asks of it.

``fully_shard`` drives its communication streams through ``_streams.StreamBackend``;
``use_fake_streams`` gives every root made after it a ``FakeBackend`` instead of
``None`` (the CPU's answer), so a test on CPU meshes reads the order of its waits,
events, stream switches and ``record_stream`` calls as FSDP2's design prescribes.
``watch`` adds a buffer's allocation and its freeing (its last reference gone) to
the log, so a test reads when the caching allocator could reuse its memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Generator
from contextlib import contextmanager
from typing import cast

import pytest
import torch
from torch import Tensor

from torchcontract.apis.fully_shard import _hooks
from torchcontract.apis.fully_shard._sharding import ManagedParameter
from torchcontract.apis.fully_shard._streams import CommStreams

__all__ = ["FakeBackend", "assert_waits_for_the_reshard", "use_fake_streams"]


class FakeBackend:
    """A stream API that logs what it is asked to do, in order; streams are names."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.names = iter(["copy_in", "all_gather", "reduce_scatter", "all_reduce"])
        self.stack = ["compute"]
        self.events = 0

    def current_stream(self) -> torch.Stream:
        return cast(torch.Stream, self.stack[-1])

    def new_stream(self, priority: int) -> torch.Stream:
        return cast(torch.Stream, next(self.names))

    @contextmanager
    def use(self, stream: torch.Stream) -> Generator[object]:
        self.stack.append(cast(str, stream))
        self.log.append(f"enter {stream}")
        try:
            yield stream
        finally:
            self.stack.pop()
            self.log.append(f"leave {stream}")

    def wait_stream(self, waiter: torch.Stream, waited: torch.Stream) -> None:
        self.log.append(f"{waiter} waits {waited}")

    def wait_event(self, waiter: torch.Stream, event: torch.Event) -> None:
        self.log.append(f"{waiter} waits {event}")

    def record_event(self, stream: torch.Stream) -> torch.Event:
        self.events += 1
        event = f"event{self.events}@{stream}"
        self.log.append(f"record {event}")
        return cast(torch.Event, event)

    def record_stream(self, tensor: Tensor, stream: torch.Stream) -> None:
        self.log.append(f"record_stream {stream}")

    def watch(self, tensor: Tensor, name: str) -> None:
        """Log ``alloc <name>`` now and ``free <name>`` once ``tensor``'s memory is freed.

        The storage is watched, not the tensor: a view that outlives the tensor holds it.
        """
        self.log.append(f"alloc {name}")
        weakref.finalize(tensor.untyped_storage(), self.log.append, f"free {name}")


def use_fake_streams(monkeypatch: pytest.MonkeyPatch) -> FakeBackend:
    """Give the roots fully_shard initializes from now on a logging ``FakeBackend``."""
    fake = FakeBackend()
    monkeypatch.setattr(_hooks, "streams_for", lambda device_type: CommStreams(fake))
    reshard = ManagedParameter.reshard_post_forward

    def logged_reshard(parameter: ManagedParameter) -> None:
        reshard(parameter)
        fake.log.append("reshard post-forward")

    monkeypatch.setattr(ManagedParameter, "reshard_post_forward", logged_reshard)
    return fake


def assert_waits_for_the_reshard(log: list[str], gather: int, backward: int) -> None:
    """Before the copy-in entered at ``log[gather]``, both gather streams wait for an event
    recorded on the compute stream before ``log[backward]`` (at the post-forward reshard),
    not for the compute stream itself (FSDP2's ``_reshard_after_forward_event``)."""
    event = log[gather - 1].removeprefix("all_gather waits ")
    assert log[gather - 2] == f"copy_in waits {event}"
    assert event.endswith("@compute")
    recorded = log.index(f"record {event}")
    assert recorded < backward
    assert log[recorded - 1] == "reshard post-forward"  # after the writes it orders
