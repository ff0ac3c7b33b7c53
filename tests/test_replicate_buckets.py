"""Bucket assignment: every parameter once, one kind per bucket, DDP's caps, launch order.

The last tests hold the rules docs/replicate.md and docs/how-it-works.md state, on one
gloo rank beside ``DistributedDataParallel``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn
from torch._C._distributed_c10d import GradBucket, _compute_bucket_assignment_by_size
from torch.nn.parallel import DistributedDataParallel

from torchcontract.apis import _torch, replicate
from torchcontract.apis.replicate._buckets import (
    BROADCAST_BUCKET_BYTES,
    assign_buckets_as_ddp,
    broadcast_chunks,
)

DTYPES = (torch.float32, torch.float64, torch.bfloat16)

tensors = st.lists(
    st.tuples(st.integers(1, 64), st.sampled_from(DTYPES)).map(
        lambda spec: torch.empty(spec[0], dtype=spec[1])
    ),
    min_size=1,
    max_size=30,
)


def _bytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# ----------------------------------------------------------------- DDP's own assignment


class Mixed(nn.Module):
    """Layers in float32 and float64: a bucket per dtype, rebuilt in arrival order."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 30)
        self.b = nn.Linear(30, 30).double()
        self.c = nn.Linear(30, 20)
        self.d = nn.Linear(20, 6).double()

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x)).double())).float()
        out: Tensor = self.d(torch.tanh(self.c(h)).double()).float()
        return out


def _buckets_seen(wrap: Callable[..., nn.Module], **keywords: object) -> list[object]:
    """Per step, what a communication hook is handed: index, size, dtype, whether last."""
    torch.manual_seed(0)
    model = wrap(Mixed(), **keywords)
    seen: list[object] = []

    def record(state: object, bucket: GradBucket) -> torch.futures.Future[Tensor]:
        buffer = bucket.buffer()
        seen.append((bucket.index(), buffer.numel(), buffer.dtype, bucket.is_last()))
        future = torch.futures.Future[Tensor]()
        future.set_result(buffer)
        return future

    # DDP compares the annotation itself with GradBucket: not the string this module makes.
    record.__annotations__.update({"bucket": GradBucket, "return": torch.futures.Future[Tensor]})
    cast(Any, model).register_comm_hook(None, record)
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).sum().backward()
        seen.append("end of step")
    return seen


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("cap", [None, 0.004])
def test_buckets_of_several_dtypes_reach_a_hook_in_ddps_order_before_and_after_the_rebuild(
    cap: float | None,
) -> None:
    keywords = {} if cap is None else {"bucket_cap_mb": cap}
    assert _buckets_seen(replicate, **keywords) == _buckets_seen(
        DistributedDataParallel, **keywords
    )


def test_a_bucket_closes_once_it_reaches_its_cap_as_ddps() -> None:
    """Not before it would exceed it: 600 + 600 bytes close a 1,000-byte bucket."""
    members = [torch.empty(150) for _ in range(3)]  # 600 bytes each
    assert assign_buckets_as_ddp(members, None, [1000]) == [[0, 1], [2]]


@given(tensors, st.integers(1, 400))
def test_broadcasts_go_in_ddps_chunks(members: list[Tensor], cap: int) -> None:
    """Those of ``dist._broadcast_coalesced``, which DDP sends parameters and buffers in."""
    theirs, _ = _compute_bucket_assignment_by_size(members, [cap])
    assert broadcast_chunks(members, cap) == theirs


def test_two_parameters_of_150_mib_are_broadcast_in_one_chunk_as_ddps() -> None:
    """DDP's 250 MiB chunk closes once it holds 300 MiB: one broadcast, whatever the cap."""
    members = [torch.empty(150 * 1024 * 1024 // 4, device="meta") for _ in range(2)]
    theirs, _ = _compute_bucket_assignment_by_size(members, [BROADCAST_BUCKET_BYTES])
    assert broadcast_chunks(members) == theirs == [[0, 1]]


# ------------------------------------------------------ the rules the pages state, beside DDP

#: 20 KiB: a bucket holds about one of the model's 16 KiB weights.
CAP_MB = 0.02


def _six_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(64, 64) for _ in range(6)))


def _sizes(model: nn.Module) -> list[int]:
    """The bytes of each bucket of ``replicate``'s record, in launch order."""
    parameters = dict(model.named_parameters())
    buckets = replicate.state(model).buckets
    return [sum(_bytes(parameters[name]) for name in bucket) for bucket in buckets]


def _ddp_sizes(find_unused_parameters: bool) -> list[int]:
    """The bytes of each of DDP's first buckets, in launch order, on the same model."""
    ddp = DistributedDataParallel(
        _six_layers(), bucket_cap_mb=CAP_MB, find_unused_parameters=find_unused_parameters
    )
    logging_data: Callable[[], dict[str, object]] = ddp._get_ddp_logging_data
    logged = logging_data()["bucket_sizes"]
    assert isinstance(logged, str)
    return [int(size) for size in logged.split(", ")]


def _step(model: nn.Module) -> None:
    model(torch.randn(2, 64)).sum().backward()


@pytest.mark.usefixtures("one_rank_group")
def test_by_default_the_first_backward_reduces_every_parameter_in_one_bucket_as_ddp() -> None:
    model = replicate(_six_layers(), bucket_cap_mb=CAP_MB)
    everything = tuple(name for name, _ in model.named_parameters())
    assert replicate.state(model).buckets == (everything,)
    assert _sizes(model) == _ddp_sizes(find_unused_parameters=False)


@pytest.mark.usefixtures("one_rank_group")
def test_by_default_the_buckets_take_the_cap_once_rebuilt_at_the_second_forward() -> None:
    """As DDP's: the first backward tells the order; the next forward with grad rebuilds."""
    model = replicate(_six_layers(), bucket_cap_mb=CAP_MB)
    _step(model)
    assert len(_sizes(model)) == 1
    with torch.no_grad():
        model(torch.randn(2, 64))  # no rebuild without grad, as DDP's
    assert len(_sizes(model)) == 1
    loss = model(torch.randn(2, 64)).sum()
    sizes = _sizes(model)
    assert len(sizes) > 1
    assert sum(sizes) == sum(_bytes(parameter) for parameter in model.parameters())
    loss.backward()


@pytest.mark.usefixtures("one_rank_group")
def test_with_find_unused_parameters_the_caps_hold_from_the_start_and_stay() -> None:
    model = replicate(_six_layers(), bucket_cap_mb=CAP_MB, find_unused_parameters=True)
    first = _sizes(model)
    assert len(first) > 1
    assert first == _ddp_sizes(find_unused_parameters=True)
    _step(model)
    assert _sizes(model) == first


@pytest.mark.usefixtures("one_rank_group")
def test_a_failed_first_static_backward_leaves_no_trace_in_the_rebuilt_buckets() -> None:
    """It sent nothing, so training goes on, as DDP's (any other backward that failed
    midway is an error at the next forward): its arrivals are forgotten, and the rebuild
    lists every parameter once, from the later ones."""
    model = replicate(_six_layers(), bucket_cap_mb=CAP_MB, static_graph=True)

    failing = True

    def fail(grad: Tensor) -> Tensor:
        raise ValueError("a hook failed")

    def arm(module: nn.Module, args: object, output: Tensor) -> None:
        if failing:  # raises once the last three layers' gradients arrived
            _torch.register_tensor_hook(output, fail)

    model[2].register_forward_hook(arm)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="a hook failed"):
        model(x).sum().backward()
    failing = False
    _step(model)  # the static graph's first whole synchronizing backward
    _step(model)  # the second: the arrival order the buckets are rebuilt from
    loss = model(x).sum()  # the rebuild
    names = [name for bucket in replicate.state(model).buckets for name in bucket]
    assert sorted(names) == sorted(name for name, _ in model.named_parameters())
    loss.backward()


def _conv_gradient(wrap: Callable[..., nn.Module]) -> Tensor:
    torch.manual_seed(0)
    raw = nn.Conv2d(3, 4, 3)
    with torch.no_grad():
        raw.weight.data = raw.weight.contiguous(memory_format=torch.channels_last)
    model = wrap(raw, gradient_as_bucket_view=True)
    model(torch.randn(2, 3, 6, 6)).sum().backward()
    assert raw.weight.grad is not None
    return raw.weight.grad


@pytest.mark.usefixtures("one_rank_group")
def test_a_channels_last_weights_gradient_keeps_its_layout_in_the_bucket_as_ddps() -> None:
    mine, theirs = _conv_gradient(replicate), _conv_gradient(DistributedDataParallel)
    assert mine.stride() == theirs.stride() == (27, 1, 9, 3)
    assert torch.equal(mine, theirs)
