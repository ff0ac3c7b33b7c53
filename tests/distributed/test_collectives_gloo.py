"""The collectives replicate issues, in order with their sizes, beside DDP's, on 2 gloo ranks.

Gradients do not show how they were reduced: buckets launched in another order, a
first bucket that is not capped, buffers broadcast although ``broadcast_buffers``
is False, or a collective in a backward that should stay on its rank, all give the
same numbers. Here every all-reduce and broadcast replicate issues goes through a
recording wrapper (the functions in ``apis._torch``, replaced inside the rank), and
DDP's are seen through a comm hook that records each bucket and through its buffer
broadcast. One job runs every scenario (starting ranks is the slow part); each test
asserts one behaviour on what it measured.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Final

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._C._distributed_c10d import GradBucket
from torch.nn.parallel import DistributedDataParallel

from torchcontract.apis import _torch, no_sync, rank_local, replicate
from torchcontract.apis._let_go import Collective as Handle
from torchcontract.testing import run_distributed

WORLD_SIZE: Final = 2
LAYERS: Final = 8
WIDTH: Final = 512  # a 512 x 512 float32 weight: 1 MiB
MIB: Final = 1024 * 1024
Results = dict[str, Any]
#: One collective: (kind, elements), in the order issued.
Collective = tuple[str, int]


class Recorder:
    """The all-reduces and broadcasts replicate issues, while ``recording``."""

    def __init__(self) -> None:
        self.collectives: list[Collective] = []

    def take(self) -> list[Collective]:
        taken, self.collectives = self.collectives, []
        return taken

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        all_reduce, broadcast = _torch.all_reduce, _torch.broadcast

        def recorded_all_reduce(tensor: Tensor, group: dist.ProcessGroup) -> Handle:
            self.collectives.append(("all_reduce", tensor.numel()))
            return all_reduce(tensor, group)

        def recorded_broadcast(tensor: Tensor, source: int, group: dist.ProcessGroup) -> None:
            self.collectives.append(("broadcast", tensor.numel()))
            broadcast(tensor, source, group)

        _torch.all_reduce, _torch.broadcast = recorded_all_reduce, recorded_broadcast
        try:
            yield
        finally:
            _torch.all_reduce, _torch.broadcast = all_reduce, broadcast


class DDPRecorder:
    """DDP's buckets as its comm hook sees them (FQNs, elements), and its buffer broadcasts."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.buckets: list[tuple[tuple[str, ...], int]] = []
        self.broadcasts = 0
        self._names = {id(parameter): name for name, parameter in ddp.module.named_parameters()}
        ddp.register_comm_hook(self, _recording_hook)

    def record(self, bucket: GradBucket) -> None:
        names = tuple(sorted(self._names[id(parameter)] for parameter in bucket.parameters()))
        self.buckets.append((names, bucket.buffer().numel()))

    @contextlib.contextmanager
    def counting_broadcasts(self) -> Iterator[None]:
        coalesced: Callable[..., None] = getattr(dist, "_broadcast_coalesced")  # noqa: B009

        def counted(*args: Any, **kwargs: Any) -> None:
            self.broadcasts += 1
            coalesced(*args, **kwargs)

        setattr(dist, "_broadcast_coalesced", counted)  # noqa: B010 (private to mypy)
        try:
            yield
        finally:
            setattr(dist, "_broadcast_coalesced", coalesced)  # noqa: B010

    def take(self) -> list[tuple[tuple[str, ...], int]]:
        taken, self.buckets = self.buckets, []
        return taken


def _recording_hook(state: DDPRecorder, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    """DDP's default all-reduce hook (an average), recording the bucket first."""
    state.record(bucket)
    buffer = bucket.buffer().div_(WORLD_SIZE)
    work = dist.all_reduce(buffer, async_op=True)
    assert work is not None
    future: torch.futures.Future[list[Tensor]] = work.get_future()
    return future.then(lambda done: done.value()[0])


# DDP checks the hook's annotations as objects; this module's are strings (PEP 563).
_recording_hook.__annotations__.update(
    bucket=GradBucket, state=DDPRecorder, **{"return": torch.futures.Future[Tensor]}
)


def _deep() -> nn.Sequential:
    """Eight 1 MiB layers: buckets of 1, 2, 2, 2 and 1 MiB with ``bucket_cap_mb=2``."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))


def _numel(model: nn.Module, names: tuple[str, ...]) -> int:
    return sum(model.get_parameter(name).numel() for name in names)


def _buckets(rank: int, bucket_cap_mb: float | None, find_unused: bool) -> Results:
    """Three steps of ours and DDP's with the same keywords: buckets and collectives."""
    mine, raw = _deep(), _deep()
    keywords: dict[str, Any] = {"find_unused_parameters": find_unused}
    if bucket_cap_mb is not None:
        keywords["bucket_cap_mb"] = bucket_cap_mb
    replicate(mine, **keywords)
    ddp = DistributedDataParallel(raw, **keywords)
    theirs = DDPRecorder(ddp)
    recorder = Recorder()
    steps: list[tuple[Any, ...]] = []
    for step in range(3):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * rank + step))
        with recorder.recording():
            loss = mine(x).square().mean()
            buckets = replicate.state(mine).buckets  # those this backward launches
            torch.autograd.backward(loss)
        torch.autograd.backward(ddp(x).square().mean())
        sent = recorder.take()
        steps.append(
            (
                sent,
                [(names, _numel(mine, names)) for names in buckets],
                theirs.take(),
                [_numel(mine, names) * 4 // MIB for names in buckets],
            )
        )
    return {"steps": steps, "find_unused": find_unused}


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.norm(self.linear(x))
        return out


def _normed() -> Normed:
    torch.manual_seed(0)
    return Normed()


def _buffer_broadcasts(rank: int, broadcast_buffers: bool) -> tuple[list[bool], list[bool]]:
    """Per forward of three steps: whether ours and DDP's broadcast buffers before it."""
    mine, raw = _normed(), _normed()
    replicate(mine, find_unused_parameters=True, broadcast_buffers=broadcast_buffers)
    ddp = DistributedDataParallel(
        raw, find_unused_parameters=True, broadcast_buffers=broadcast_buffers
    )
    theirs = DDPRecorder(ddp)
    recorder = Recorder()
    mine_counts: list[bool] = []
    their_counts: list[bool] = []
    for step in range(3):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(10 * rank + step))
        with recorder.recording():
            out = mine(x)
        mine_counts.append(any(kind == "broadcast" for kind, _ in recorder.take()))
        before = theirs.broadcasts
        with theirs.counting_broadcasts():
            reference = ddp(x)
        their_counts.append(theirs.broadcasts > before)
        torch.autograd.backward(out.square().mean())
        torch.autograd.backward(reference.square().mean())
    return mine_counts, their_counts


def _local_backwards(rank: int) -> dict[str, tuple[int, int, int]]:
    """Collectives of the forward and of the backward under ``rank_local`` and ``no_sync``.

    Each is followed by a synchronizing step, whose collectives are counted too. (A
    forward under ``no_sync`` may broadcast buffers, as DDP's does: only the
    backward stays on the rank.)
    """
    mine, raw = _normed(), _normed()
    replicate(mine, find_unused_parameters=True)
    ddp = DistributedDataParallel(raw, find_unused_parameters=True)
    theirs = DDPRecorder(ddp)
    recorder = Recorder()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(rank))
    torch.autograd.backward(mine(x).square().mean())  # the first forward broadcasts
    torch.autograd.backward(ddp(x).square().mean())
    theirs.take()
    seen: dict[str, tuple[int, int, int]] = {}
    for name, block in (("rank_local", rank_local), ("no_sync", no_sync)):
        with recorder.recording():
            with block(mine):
                loss = mine(x).square().mean()
                forward = len(recorder.take())
                torch.autograd.backward(loss)
                backward = len(recorder.take())
            torch.autograd.backward(mine(x).square().mean())
            synchronizing = len(recorder.take())
        seen[name] = (forward, backward, synchronizing)
    with ddp.no_sync():
        torch.autograd.backward(ddp(x).square().mean())
    local = len(theirs.take())
    torch.autograd.backward(ddp(x).square().mean())
    seen["ddp_no_sync"] = (0, local, len(theirs.take()))
    return seen


def _job(rank: int, world_size: int) -> Results:
    return {
        "buckets": _buckets(rank, 2, find_unused=True),
        "default_buckets": _buckets(rank, None, find_unused=True),
        "ddp_default_buckets": _buckets(rank, None, find_unused=False),
        "ddp_default_capped": _buckets(rank, 2, find_unused=False),
        "broadcasts": _buffer_broadcasts(rank, broadcast_buffers=True),
        "no_broadcasts": _buffer_broadcasts(rank, broadcast_buffers=False),
        "local": _local_backwards(rank),
    }


@pytest.fixture(scope="module")
def ranks() -> list[Results]:
    return run_distributed(_job, WORLD_SIZE, timeout=120.0)


# ----------------------------------------------------------------- buckets


#: The bucket scenarios: (bucket_cap_mb, find_unused_parameters) on both sides.
BUCKETS: Final = ("buckets", "default_buckets", "ddp_default_buckets", "ddp_default_capped")


def test_a_given_cap_holds_for_every_bucket_the_first_included_as_ddps(
    ranks: list[Results],
) -> None:
    for rank in ranks:
        for _, _, _, mebibytes in rank["buckets"]["steps"]:
            assert mebibytes == [2, 2, 2, 2]


def test_a_given_cap_holds_once_rebuilt_without_unused_parameters_as_ddps(
    ranks: list[Results],
) -> None:
    """DDP's default find_unused_parameters=False: one bucket, then rebuilt at the cap."""
    for rank in ranks:
        steps = rank["ddp_default_capped"]["steps"]
        assert [mebibytes for _, _, _, mebibytes in steps] == [[8], [2, 2, 2, 2], [2, 2, 2, 2]]


def test_under_the_default_cap_the_bucket_launched_last_holds_one_mib_as_ddps(
    ranks: list[Results],
) -> None:
    """The parameters defined first; the others share one bucket of up to 25 MiB."""
    for rank in ranks:
        for _, _, ddp_buckets, mebibytes in rank["default_buckets"]["steps"]:
            assert mebibytes == [7, 1]
            assert ddp_buckets[-1] == (("0.weight",), MIB // 4)


def test_under_ddps_defaults_the_rebuilt_bucket_launched_first_holds_one_mib_as_ddps(
    ranks: list[Results],
) -> None:
    """Rebuilt in arrival order, the 1 MiB bucket takes the last layer, launched first."""
    for rank in ranks:
        steps = rank["ddp_default_buckets"]["steps"]
        assert [mebibytes for _, _, _, mebibytes in steps] == [[8], [1, 7], [1, 7]]
        for _, _, ddp_buckets, _ in steps[1:]:
            assert ddp_buckets[0] == ((f"{LAYERS - 1}.weight",), MIB // 4)


@pytest.mark.parametrize("scenario", BUCKETS)
def test_each_backward_all_reduces_the_buckets_in_launch_order(
    ranks: list[Results], scenario: str
) -> None:
    """What is sent is each bucket's gradients, in order, and with find_unused_parameters
    the map of used parameters; where DDP rebuilds (find_unused_parameters=False), the
    second forward first broadcasts rank 0's buckets (their indices, then lengths)."""
    for rank in ranks:
        find_unused = rank[scenario]["find_unused"]
        used_map = [("all_reduce", LAYERS)] if find_unused else []
        for step, (sent, buckets, _, _) in enumerate(rank[scenario]["steps"]):
            rebuild = (
                [("broadcast", LAYERS + 1), ("broadcast", len(buckets))]
                if step == 1 and not find_unused
                else []
            )
            assert sent == rebuild + [("all_reduce", size) for _, size in buckets] + used_map


@pytest.mark.parametrize("scenario", BUCKETS)
def test_buckets_and_their_order_equal_ddps_in_every_backward(
    ranks: list[Results], scenario: str
) -> None:
    for rank in ranks:
        for _, buckets, ddp_buckets, _ in rank[scenario]["steps"]:
            assert [(tuple(sorted(names)), size) for names, size in buckets] == ddp_buckets


# ----------------------------------------------------------------- buffers, local backwards


def test_buffers_are_broadcast_before_each_forward_as_ddp(ranks: list[Results]) -> None:
    for rank in ranks:
        mine, theirs = rank["broadcasts"]
        assert mine == theirs == [True] * 3


def test_broadcast_buffers_false_broadcasts_nothing_as_ddp(ranks: list[Results]) -> None:
    for rank in ranks:
        mine, theirs = rank["no_broadcasts"]
        assert mine == theirs == [False] * 3


@pytest.mark.parametrize("block", ["rank_local", "no_sync", "ddp_no_sync"])
def test_a_local_backward_issues_no_collective(ranks: list[Results], block: str) -> None:
    for rank in ranks:
        _, backward, synchronizing = rank["local"][block]
        assert backward == 0
        assert synchronizing > 0


def test_a_rank_local_forward_issues_no_collective(ranks: list[Results]) -> None:
    for rank in ranks:
        forward, _, _ = rank["local"]["rank_local"]
        assert forward == 0
