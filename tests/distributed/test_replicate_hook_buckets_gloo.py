"""The buckets of every backward equal DDP's, for every combination of DDP's bucket keywords.

``static_graph``, ``find_unused_parameters``, the cap (DDP's default, one given,
a list of caps) and ``gradient_as_bucket_view``, on 2 gloo ranks, side by side
with ``DistributedDataParallel`` called with the same keywords. With a hook that
records each bucket it is given (index, size, parameters, last or not), both
hooks see the same calls in every backward (in a static graph's first one,
DDP hands every bucket as index 0); without a hook, the buckets each
backward launches (ours from the record, DDP's from its reducer after the
forward, where it rebuilds them) are the same. The model is a few MiB, so the
default cap's 1 MiB bucket and a given cap of 1.5 MiB both split it; a
synchronizing backward follows a ``no_sync`` one, and the numbers after every
step are DDP's too. A second model holds parameters no forward uses (one layer
defined between used ones, one after them), under ``static_graph`` and
``find_unused_parameters``: DDP's rebuild puts them after those that arrived, in
the order they are defined, and ours must too.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Final

import attrs
import pytest
import torch
from replicate_hook_recorder import all_reduce_mean, annotate_for_ddp
from torch import Tensor, nn
from torch._C._distributed_c10d import GradBucket
from torch.nn.parallel import DistributedDataParallel

from torchcontract.apis import no_sync, replicate
from torchcontract.apis._compat import DDP_KEYWORDS
from torchcontract.apis.replicate import ReplicateModule
from torchcontract.testing import run_distributed

STEPS: Final = 4
WIDTH: Final = 512  # a 512 x 512 float32 weight: 1 MiB

#: What a hook saw of one bucket: (index, last, elements, parameter names).
Seen = tuple[int, bool, int, tuple[str, ...]]


class Recorder:
    """The hook's state: every bucket given, by backward, with parameter names."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {id(parameter): name for name, parameter in model.named_parameters()}
        self.backwards: list[list[Seen]] = []

    def record(self, bucket: GradBucket) -> None:
        names = tuple(self.names[id(parameter)] for parameter in bucket.parameters())
        seen = (bucket.index(), bucket.is_last(), bucket.buffer().numel(), names)
        self.backwards[-1].append(seen)


def recording_hook(state: Recorder, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    """Record the bucket, then average it as DDP's default hook does."""
    state.record(bucket)
    return all_reduce_mean(bucket.buffer())


annotate_for_ddp(recording_hook, Recorder)


class Net(nn.Module):
    """Three 1 MiB layers, then a small head: about 3 MiB of float32 gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = nn.Linear(WIDTH, WIDTH)
        self.third = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: Tensor) -> Tensor:
        # The layers run in another order than they are defined: a rebuild shows.
        h = torch.relu(self.second(torch.relu(self.first(x))))
        out: Tensor = self.head(h + self.third(x))
        return out


class NetWithUnused(Net):
    """Net with two layers no forward uses: one defined between used ones, one last."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(WIDTH, WIDTH)
        self.tail = nn.Linear(WIDTH, 8)


def _net(unused: bool = False) -> Net:
    torch.manual_seed(0)
    return NetWithUnused() if unused else Net()


#: The caps: DDP's default, one given (1.5 MiB), and a list (where DDP takes one).
CAPS: Final[dict[str, dict[str, Any]]] = {
    "default cap": {},
    "bucket_cap_mb=1.5": {"bucket_cap_mb": 1.5},
}
if "bucket_cap_mb_list" in DDP_KEYWORDS:  # DDP 2.13 on; ours refuses it elsewhere
    CAPS["bucket_cap_mb_list"] = {"bucket_cap_mb_list": [0.5, 1.5]}


Combination = tuple[bool, bool, str, bool]


def _keywords(combination: Combination) -> dict[str, Any]:
    static_graph, find_unused, cap, views = combination
    return {
        "static_graph": static_graph,
        "find_unused_parameters": find_unused,
        "gradient_as_bucket_view": views,
        **CAPS[cap],
    }


COMBINATIONS: Final = list(itertools.product((False, True), (False, True), CAPS, (False, True)))


#: With parameters never used: a static graph or find_unused_parameters (DDP refuses the
#: model otherwise), every cap.
UNUSED_COMBINATIONS: Final = [
    (static_graph, find_unused, cap, False)
    for static_graph, find_unused in ((True, False), (True, True), (False, True))
    for cap in CAPS
]


def _name(combination: Combination) -> str:
    static_graph, find_unused, cap, views = combination
    return (
        f"static_graph={static_graph}, find_unused_parameters={find_unused}, {cap}, "
        f"gradient_as_bucket_view={views}"
    )


def _ddp_buckets(ddp: DistributedDataParallel, names: dict[int, str]) -> list[tuple[str, ...]]:
    """DDP's buckets now, in launch order, as parameter names."""
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    return [tuple(names[id(parameter)] for parameter in bucket.parameters()) for bucket in buckets]


def _steps(
    model: nn.Module,
    raw: Net,
    rank: int,
    *,
    launched: Callable[[], list[tuple[str, ...]]],
    local: Callable[[], AbstractContextManager[Any]],
    hook: Recorder | None,
) -> tuple[list[list[tuple[str, ...]]], list[float]]:
    """Train; the buckets each synchronizing backward launched, then every parameter."""
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.01)
    buckets: list[list[tuple[str, ...]]] = []
    for step in range(STEPS):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * rank + step))
        if step == 2:
            with local():  # a no_sync backward before the synchronizing one
                model(x).square().mean().backward()
        if hook is not None:
            hook.backwards.append([])
        loss = model(x).square().mean()
        buckets.append(launched())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return buckets, torch.cat([p.detach().flatten() for p in raw.parameters()]).tolist()


@attrs.frozen
class Outcome:
    """One combination on one rank: ours and DDP's, with the hook and without."""

    ours_seen: list[list[Seen]]
    theirs_seen: list[list[Seen]]
    ours_launched: list[list[tuple[str, ...]]]
    theirs_launched: list[list[tuple[str, ...]]]
    ours_launched_with_hook: list[list[tuple[str, ...]]]
    gap: float


def _ours(
    keywords: dict[str, Any], rank: int, with_hook: bool, unused: bool
) -> tuple[list[list[tuple[str, ...]]], list[float], list[list[Seen]]]:
    """Our side: the buckets each backward launched, the parameters, what the hook saw."""
    mine = replicate(_net(unused), **keywords)
    assert isinstance(mine, ReplicateModule)
    hook = Recorder(mine) if with_hook else None
    if hook is not None:
        mine.register_comm_hook(hook, recording_hook)

    def launched() -> list[tuple[str, ...]]:
        return [tuple(names) for names in replicate.state(mine).buckets]

    buckets, parameters = _steps(
        mine, mine, rank, launched=launched, local=lambda: no_sync(mine), hook=hook
    )
    return buckets, parameters, [] if hook is None else hook.backwards


def _theirs(
    keywords: dict[str, Any], rank: int, with_hook: bool, unused: bool
) -> tuple[list[list[tuple[str, ...]]], list[float], list[list[Seen]]]:
    """DDP's side, the same."""
    raw = _net(unused)
    ddp = DistributedDataParallel(raw, **keywords)
    hook = Recorder(raw) if with_hook else None
    if hook is not None:
        ddp.register_comm_hook(hook, recording_hook)
    names = {id(parameter): name for name, parameter in raw.named_parameters()}
    buckets, parameters = _steps(
        ddp, raw, rank, launched=lambda: _ddp_buckets(ddp, names), local=ddp.no_sync, hook=hook
    )
    return buckets, parameters, [] if hook is None else hook.backwards


def _gap(first: list[float], second: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(first, second, strict=True))


def _combination(combination: Combination, rank: int, unused: bool = False) -> Outcome:
    keywords = _keywords(combination)
    ours_launched, ours_parameters, _ = _ours(keywords, rank, False, unused)
    theirs_launched, theirs_parameters, _ = _theirs(keywords, rank, False, unused)
    hooked_launched, hooked_parameters, ours_seen = _ours(keywords, rank, True, unused)
    _, theirs_hooked_parameters, theirs_seen = _theirs(keywords, rank, True, unused)
    return Outcome(
        ours_seen,
        theirs_seen,
        ours_launched,
        theirs_launched,
        hooked_launched,
        max(
            _gap(ours_parameters, theirs_parameters),
            _gap(hooked_parameters, theirs_hooked_parameters),
        ),
    )


def _job(rank: int, world_size: int) -> dict[str, Outcome]:
    outcomes = {_name(combination): _combination(combination, rank) for combination in COMBINATIONS}
    for combination in UNUSED_COMBINATIONS:
        outcomes["unused, " + _name(combination)] = _combination(combination, rank, unused=True)
    return outcomes


@pytest.fixture(scope="module")
def results() -> list[dict[str, Outcome]]:
    return run_distributed(_job, 2, timeout=300)


NAMES: Final = [_name(combination) for combination in COMBINATIONS] + [
    "unused, " + _name(combination) for combination in UNUSED_COMBINATIONS
]


@pytest.mark.parametrize("name", NAMES)
def test_a_hook_is_given_ddps_buckets_in_every_backward(
    results: list[dict[str, Outcome]], name: str
) -> None:
    for by_name in results:
        outcome = by_name[name]
        assert len(outcome.theirs_seen) == STEPS
        for step, (ours, theirs) in enumerate(
            zip(outcome.ours_seen, outcome.theirs_seen, strict=True)
        ):
            assert ours == theirs, f"backward {step + 1}"


@pytest.mark.parametrize("name", NAMES)
def test_without_a_hook_each_backward_launches_ddps_buckets(
    results: list[dict[str, Outcome]], name: str
) -> None:
    for by_name in results:
        outcome = by_name[name]
        for step, (ours, theirs) in enumerate(
            zip(outcome.ours_launched, outcome.theirs_launched, strict=True)
        ):
            assert ours == theirs, f"backward {step + 1}"
        assert outcome.ours_launched_with_hook == outcome.ours_launched


@pytest.mark.parametrize("name", NAMES)
def test_the_parameters_equal_ddps(results: list[dict[str, Outcome]], name: str) -> None:
    for by_name in results:
        assert by_name[name].gap <= 1e-6


def test_the_default_cap_gives_a_one_mib_bucket_and_a_given_cap_holds(
    results: list[dict[str, Outcome]],
) -> None:
    """Several buckets where DDP makes them, or the comparisons above would test little."""
    for by_name in results:
        default = by_name[_name((False, True, "default cap", False))]
        # find_unused_parameters=True: DDP's first assignment, kept; 1 MiB for first.weight.
        assert len(default.theirs_seen[0]) == 2
        assert default.theirs_seen[0][-1][3] == ("first.weight",)
        capped = by_name[_name((False, False, "bucket_cap_mb=1.5", False))]
        # find_unused_parameters=False: one bucket, then rebuilt at the cap in arrival order.
        assert len(capped.theirs_seen[0]) == 1
        assert len(capped.theirs_seen[1]) >= 2


def test_a_static_graph_rebuild_puts_the_unused_parameters_last_in_definition_order(
    results: list[dict[str, Outcome]],
) -> None:
    """The case the comparisons above rest on: DDP's rebuilt buckets hold the unused ones."""
    for by_name in results:
        static = by_name["unused, " + _name((True, False, "default cap", False))]
        names = [name for bucket in static.theirs_launched[-1] for name in bucket]
        unused = ["spare.weight", "spare.bias", "tail.weight", "tail.bias"]
        assert [name for name in names if name in unused] == unused
