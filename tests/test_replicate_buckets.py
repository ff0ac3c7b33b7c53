"""Bucket assignment: every parameter once, one kind per bucket, DDP's caps, launch order.

The last tests hold the rules docs/replicate.md and docs/how-it-works.md state, on one
gloo rank beside ``DistributedDataParallel``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn
from torch._C._distributed_c10d import _compute_bucket_assignment_by_size
from torch.nn.parallel import DistributedDataParallel

from torchcontract.apis import replicate
from torchcontract.apis.replicate._buckets import assign_buckets, assign_buckets_as_ddp

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


@given(tensors, st.data(), st.integers(1, 200), st.integers(1, 400))
def test_buckets_partition_the_order_by_kind_within_caps(
    members: list[Tensor], data: st.DataObject, first_cap: int, cap: int
) -> None:
    order = data.draw(st.permutations(range(len(members))))
    buckets = assign_buckets(members, order, first_cap, cap)
    flat = [index for bucket in buckets for index in bucket]
    assert sorted(flat) == list(range(len(members)))
    seen_kinds: set[torch.dtype] = set()
    for bucket in buckets:
        kinds = {members[index].dtype for index in bucket}
        assert len(kinds) == 1
        (kind,) = kinds
        limit = cap if kind in seen_kinds else first_cap
        seen_kinds.add(kind)
        if len(bucket) > 1:
            assert sum(_bytes(members[index]) for index in bucket) <= limit
        # Within a bucket, indices keep the order they were given in.
        positions = [order.index(index) for index in bucket]
        assert positions == sorted(positions)


def test_first_bucket_is_small_and_the_rest_fill_to_the_cap() -> None:
    members = [torch.empty(256) for _ in range(8)]  # 1 KiB each
    buckets = assign_buckets(members, range(8), first_cap=1024, cap=4096)
    assert buckets == [[0], [1, 2, 3, 4], [5, 6, 7]]


def test_a_tensor_larger_than_the_cap_gets_a_bucket_of_its_own() -> None:
    members = [torch.empty(4), torch.empty(1000), torch.empty(4)]
    assert assign_buckets(members, [2, 1, 0], 64, 64) == [[2], [1], [0]]


def test_buckets_launch_in_the_order_their_first_member_comes() -> None:
    members = [torch.empty(4), torch.empty(4, dtype=torch.float64), torch.empty(4)]
    assert assign_buckets(members, [1, 0, 2], 1024, 1024) == [[1], [0, 2]]


# ----------------------------------------------------------------- DDP's own assignment


@given(tensors, st.lists(st.integers(1, 400), min_size=1, max_size=3))
def test_the_reducers_assignment_is_ddps_own(members: list[Tensor], limits: list[int]) -> None:
    """``assign_buckets_as_ddp`` gives the buckets of DDP's C++ function, on any kinds and caps."""
    ours = assign_buckets_as_ddp(members, range(len(members)), limits)
    theirs, _ = _compute_bucket_assignment_by_size(members, limits)
    assert sorted(ours, key=min) == theirs


def test_a_bucket_closes_once_it_reaches_its_cap_as_ddps() -> None:
    """Not before it would exceed it: 600 + 600 bytes close a 1,000-byte bucket."""
    members = [torch.empty(150) for _ in range(3)]  # 600 bytes each
    assert assign_buckets_as_ddp(members, range(3), [1000]) == [[0, 1], [2]]


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
