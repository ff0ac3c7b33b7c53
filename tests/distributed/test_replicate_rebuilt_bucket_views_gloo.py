"""``gradient_as_bucket_view`` with rebuilt buckets, against DDP's on 2 gloo ranks.

With ``find_unused_parameters=False`` and a cap of a few KiB, both
sides rebuild their buckets after the first step in the order gradients arrived,
at the next forward, and the rebuilt buckets differ from the first ones. Until
then the gradients live in the first bucket buffer, on both sides alike; from
then on every gradient is a view of its new bucket, before the next backward:
no gradient is left in a bucket buffer of the first assignment.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import pytest
import torch
from replicate_hook_recorder import CAP_MB, seeded_net
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from torchcontract.apis import replicate
from torchcontract.testing import run_distributed

#: The parameters' FQNs grouped by the storage their gradients live in, as sorted tuples.
Groups = list[tuple[str, ...]]


def _groups(raw: nn.Module) -> Groups:
    by_storage: dict[int, list[str]] = {}
    for name, parameter in raw.named_parameters():
        assert parameter.grad is not None
        by_storage.setdefault(parameter.grad.untyped_storage().data_ptr(), []).append(name)
    return _sorted(by_storage.values())


def _sorted(groups: Iterable[Iterable[str]]) -> Groups:
    return sorted(tuple(sorted(names)) for names in groups)


@attrs.frozen
class Report:
    #: Ours: the record's buckets after the second forward and before the first
    #: backward, and the gradients' storages after the first backward and after the
    #: second forward.
    ours_buckets: Groups
    ours_first: Groups
    ours_after_backward: Groups
    ours: Groups
    #: DDP's gradients' storages after the first backward, and after the second forward.
    theirs_first: Groups
    theirs: Groups


def _step(model: nn.Module, rank: int, step: int) -> Tensor:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * rank + step))
    loss: Tensor = model(x, True).pow(2).mean()
    return loss


def _job(rank: int, world_size: int) -> Report:
    mine = replicate(
        seeded_net(),
        bucket_cap_mb=CAP_MB,
        find_unused_parameters=False,
        gradient_as_bucket_view=True,
    )
    ours_first = _sorted(replicate.state(mine).buckets)
    torch.autograd.backward(_step(mine, rank, 0))
    ours_after_backward = _groups(mine)
    loss = _step(mine, rank, 1)  # the rebuild, as DDP's
    ours = _groups(mine)
    buckets = _sorted(replicate.state(mine).buckets)
    torch.autograd.backward(loss)
    raw = seeded_net()
    ddp = DistributedDataParallel(
        raw, bucket_cap_mb=CAP_MB, find_unused_parameters=False, gradient_as_bucket_view=True
    )
    torch.autograd.backward(_step(ddp, rank, 0))
    theirs_first = _groups(raw)
    loss = _step(ddp, rank, 1)  # DDP rebuilds its buckets at this forward
    theirs = _groups(raw)
    torch.autograd.backward(loss)
    return Report(buckets, ours_first, ours_after_backward, ours, theirs_first, theirs)


@pytest.fixture(scope="module")
def reports() -> list[Report]:
    return run_distributed(_job, 2, timeout=120)


def test_rebuilt_buckets_differ_from_the_first_ones(reports: list[Report]) -> None:
    for report in reports:
        assert report.ours_buckets != report.ours_first
        assert report.theirs != report.theirs_first


def test_after_a_rebuild_each_gradient_is_a_view_of_its_new_bucket_as_ddps(
    reports: list[Report],
) -> None:
    for report in reports:
        assert report.ours == report.ours_buckets
        assert report.ours == report.theirs


def test_until_the_rebuild_the_gradients_live_in_the_first_bucket_as_ddps(
    reports: list[Report],
) -> None:
    for report in reports:
        assert report.ours_after_backward == report.theirs_first == report.ours_first
