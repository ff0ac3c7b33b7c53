"""The all-gather of shards with FSDP2's extension hooks, on an accelerator's streams, as FSDP2's.

FSDP2's ``foreach_all_gather`` runs the pre-all-gather hooks and the copy-in on the
copy-in stream, the collective on the all-gather stream, and the copy-out (and the
post-all-gather) on the compute stream after the gather's event. Here the stream API
is ``fake_streams.FakeBackend``, which logs each step, on a fake process group of CPU
ranks; the weights are ``extension_tensors.ScaledInt8Weight`` (int8 data and a float32
scale: the inputs are sent as bytes), whose pre-all-gather writes to the same log.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from extension_tensors import ScaledInt8Weight
from fake_streams import FakeBackend, assert_waits_for_the_reshard, use_fake_streams
from fake_world import fake_mesh
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from torchcontract.apis import fully_shard

#: Where the pre-all-gathers write: the fake backend's log while a test runs.
LOG: list[list[str]] = []


class LoggedInt8Weight(ScaledInt8Weight):
    """``ScaledInt8Weight`` whose pre-all-gather also writes to the stream log."""

    def fsdp_pre_all_gather(
        self,
        mesh: DeviceMesh,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: MixedPrecisionPolicy,
    ) -> tuple[tuple[Tensor, ...], Any]:
        LOG[-1].append("pre-all-gather")
        return super().fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeBackend]:
    fake = use_fake_streams(monkeypatch)
    LOG.append(fake.log)
    yield fake
    LOG.pop()


def _model(mesh: DeviceMesh, reshard_after_forward: bool | int = True) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)]
    model = nn.Sequential(*layers)
    for layer in layers:
        layer.weight = nn.Parameter(LoggedInt8Weight(layer.weight.detach().clone()))
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh)
    return model


def _step(model: nn.Module, backend: FakeBackend) -> list[str]:
    backend.log.clear()
    model(torch.ones(2, 8)).sum().backward()
    return list(backend.log)


def test_hooks_and_copy_in_on_the_copy_in_stream_then_collective_then_copy_out(
    backend: FakeBackend,
) -> None:
    with fake_mesh((2,)) as mesh:
        log = _step(_model(mesh), backend)
    starts = [index for index, entry in enumerate(log) if entry == "enter copy_in"]
    assert len(starts) == 4  # each layer in forward and again in backward
    for start in starts:
        event = log[start + 5].removeprefix("record ")
        assert log[start : start + 7] == [
            "enter copy_in",
            "pre-all-gather",
            "leave copy_in",
            "all_gather waits copy_in",
            "enter all_gather",
            f"record {event}",
            "leave all_gather",
        ]
        # The copy-out: the compute stream waits for the gather; the gather streams wait
        # for the event after it before either buffer goes (forward's at the next copy-out,
        # backward's at once).
        waited = log.index(f"compute waits {event}")
        copied = log[waited + 1].removeprefix("record ")
        assert copied.endswith("@compute")
        released = log.index(f"copy_in waits {copied}")
        assert log[released + 1] == f"all_gather waits {copied}"
        if start < starts[2]:  # forward: kept until the next copy-out
            assert released > waited + 2
        else:  # backward: at once
            assert released == waited + 2
    assert log.count("pre-all-gather") == 4


def test_post_forward_gather_holds_the_kept_outputs_for_the_copy_in(
    backend: FakeBackend,
) -> None:
    """An int reshard_after_forward: backward sends what forward kept, without the hook."""
    with fake_mesh((4,)) as mesh:
        log = _step(_model(mesh, reshard_after_forward=2), backend)
    starts = [index for index, entry in enumerate(log) if entry == "enter copy_in"]
    assert len(starts) == 4
    for start in starts[:2]:  # forward: the hook makes the inputs
        assert log[start + 1] == "pre-all-gather"
    for start in starts[2:]:  # backward: the kept int8 data and scale, written on compute
        assert_waits_for_the_reshard(log, start, starts[2])
        assert log[start + 1 : start + 4] == [
            "record_stream copy_in",
            "record_stream copy_in",
            "leave copy_in",
        ]
    assert log.count("pre-all-gather") == 2
