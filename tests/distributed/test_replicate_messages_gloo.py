"""Every collective replicate sends after apply equals DistributedDataParallel's, on 2 gloo ranks.

Both sides run on a process group written in Python that records each collective
(``recording_group``): c10d calls it for DDP's collectives too, those its reducer
issues in C++ (the buckets, the map of used parameters, the rebuilt buckets'
broadcasts), so both are seen the same way. For each scenario (DDP's keywords, a
parameter unused on one rank or on every rank, a communication hook, buffers, a
``no_sync`` step), the collectives of each forward and of each backward, in order,
with their sizes and dtypes, equal DDP's: nothing more is sent, nothing less, and
nothing at another moment. At apply the two check the ranks' models differently
(one all-gather of a digest here; DDP all-gathers and broadcasts shapes): there the
broadcasts of the model's values are compared. Under ``Join`` with uneven inputs the
same holds, on the rank that joins too, but for one message: after each forward,
whether a synchronizing backward follows is two flags here (whether buffers are
broadcast next, and whether an output armed a backward), where DDP sends one and
the joined rank then waits for a backward an output without gradients never starts.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Final, cast

import attrs
import pytest
import torch
from recording_group import Message, recording_group
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from torchcontract.apis import no_sync, replicate
from torchcontract.apis.replicate import ReplicateModule
from torchcontract.testing import run_distributed

STEPS: Final = 4


class Net(nn.Module):
    """Three layers and a branch ``side``; ``norm`` adds buffers where asked."""

    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.side = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.norm = nn.BatchNorm1d(8) if norm else None

    def forward(self, x: Tensor, use_side: bool) -> Tensor:
        h = torch.relu(self.first(x))
        if self.norm is not None:
            h = self.norm(h)
        if use_side:
            h = h + self.side(h)
        out: Tensor = self.head(h)
        return out


@attrs.frozen
class Scenario:
    """Keywords on both sides, and how each step runs."""

    keywords: Callable[[], dict[str, Any]] = dict
    #: Whether ``side`` takes part, by rank and step.
    uses_side: Callable[[int, int], bool] = lambda rank, step: True
    norm: bool = False
    hook: bool = False
    #: The steps that run under ``no_sync``.
    local_steps: tuple[int, ...] = ()


#: A bucket cap small enough that every parameter gets a bucket of its own.
TINY_CAP_MB: Final = 1e-4

SCENARIOS: Final[dict[str, Scenario]] = {
    "no keyword": Scenario(),
    "bucket_cap_mb, a bucket per parameter": Scenario(lambda: {"bucket_cap_mb": TINY_CAP_MB}),
    "find_unused_parameters": Scenario(lambda: {"find_unused_parameters": True}),
    "find_unused_parameters, side unused on rank 1": Scenario(
        lambda: {"find_unused_parameters": True}, lambda rank, step: rank == 0
    ),
    "find_unused_parameters, side unused everywhere": Scenario(
        lambda: {"find_unused_parameters": True}, lambda rank, step: False
    ),
    "static_graph": Scenario(lambda: {"static_graph": True}),
    "static_graph, side unused on rank 1": Scenario(
        lambda: {"static_graph": True}, lambda rank, step: rank == 0
    ),
    "static_graph, side unused everywhere": Scenario(
        lambda: {"static_graph": True}, lambda rank, step: False
    ),
    "static_graph, small buckets": Scenario(
        lambda: {"static_graph": True, "bucket_cap_mb": TINY_CAP_MB}, lambda rank, step: rank == 0
    ),
    "gradient_as_bucket_view": Scenario(
        lambda: {"gradient_as_bucket_view": True, "bucket_cap_mb": TINY_CAP_MB}
    ),
    "comm hook, find_unused_parameters": Scenario(
        lambda: {"find_unused_parameters": True}, lambda rank, step: rank == 0, hook=True
    ),
    "comm hook, static_graph": Scenario(
        lambda: {"static_graph": True}, lambda rank, step: rank == 0, hook=True
    ),
    # Buffers of 8 floats each, more than the cap: broadcast in one chunk all the same.
    "buffers, small buckets": Scenario(lambda: {"bucket_cap_mb": TINY_CAP_MB}, norm=True),
    "buffers, broadcast_buffers=False": Scenario(lambda: {"broadcast_buffers": False}, norm=True),
    "no_sync steps": Scenario(lambda: {"find_unused_parameters": True}, local_steps=(0, 2)),
}

#: Per step: the collectives of the forward, then those of the backward.
Steps = list[tuple[list[Message], list[Message]]]


@attrs.frozen
class Sent:
    """What one side sent: its broadcasts at apply, then each step's collectives."""

    init_broadcasts: list[Message]
    steps: Steps


def _float_broadcasts(messages: list[Message]) -> list[Message]:
    return [m for m in messages if m.kind == "broadcast" and "float" in m.tensors[0][1]]


def _run(scenario: Scenario, rank: int, theirs: bool) -> Sent:
    """``STEPS`` training steps of one side, recording its collectives."""
    group = recording_group()
    torch.manual_seed(0)
    raw = Net(scenario.norm)
    keywords = {"process_group": group, **scenario.keywords()}
    model: nn.Module
    local: Callable[[], contextlib.AbstractContextManager[None]]
    register: Callable[[object, Callable[..., Any]], None]
    if theirs:
        ddp = DistributedDataParallel(raw, **keywords)
        model, local, register = ddp, ddp.no_sync, ddp.register_comm_hook
    else:
        mine = replicate(raw, **keywords)
        model, local, register = mine, _local(raw), cast(Any, mine).register_comm_hook
    if scenario.hook:
        register(group, default_hooks.allreduce_hook)
    init = _float_broadcasts(group.take())
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
    steps: Steps = []
    for step in range(STEPS):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * rank + step))
        block = local() if step in scenario.local_steps else contextlib.nullcontext()
        with block:
            loss = model(x, scenario.uses_side(rank, step)).square().mean()
            forward = group.take()
            loss.backward()
            backward = group.take()
        steps.append((forward, backward))
        if step not in scenario.local_steps:
            optimizer.step()
            optimizer.zero_grad()
    return Sent(init, steps)


def _local(module: nn.Module) -> Callable[[], contextlib.AbstractContextManager[None]]:
    def block() -> Iterator[None]:
        with no_sync(module):
            yield

    return contextlib.contextmanager(block)


#: Batches per rank under Join: rank 1 joins after two steps, rank 0 runs four.
JOIN_BATCHES: Final = (4, 2)


def _run_joined(rank: int, theirs: bool, detached: int | None = None) -> list[list[Message]]:
    """Training under Join with uneven inputs: each step's collectives, then the end's.

    At step ``detached`` (rank 0 only) no parameter requires a gradient during the
    forward: its output needs none, and no backward follows.
    """
    group = recording_group()
    torch.manual_seed(0)
    raw = Net(norm=True)
    joinable: DistributedDataParallel | ReplicateModule
    forward: nn.Module
    if theirs:
        joinable = forward = DistributedDataParallel(raw, process_group=group)
    else:
        joinable, forward = cast(ReplicateModule, replicate(raw, process_group=group)), raw
    group.take()
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
    steps: list[list[Message]] = []
    with joinable.join():
        for step in range(JOIN_BATCHES[rank]):
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * rank + step))
            if step == detached:
                raw.requires_grad_(False)
                forward(x, True)  # grad enabled, but no output needs a gradient
                raw.requires_grad_(True)
            else:
                forward(x, True).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            steps.append(group.take())
    steps.append(group.take())  # the joined rank's shadowing, and the last sync
    return steps


def _joined_before_a_static_graph_settled(rank: int) -> tuple[list[list[Message]], list[float]]:
    """Rank 1 joins at once under a static graph, then both train on: collectives, parameters.

    The joined rank meets the others' first synchronizing backward, which settles the
    graph, without one of its own: its own first backward after Join tells which of its
    parameters arrive.
    """
    group = recording_group()
    torch.manual_seed(0)
    raw = Net()
    model = cast(ReplicateModule, replicate(raw, process_group=group, static_graph=True))
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))
    with model.join():
        for _ in range(2 if rank == 0 else 0):
            raw(x, True).square().mean().backward()
    group.take()
    steps: list[list[Message]] = []
    for _ in range(2):  # the next epoch, even
        raw(x, rank == 0).square().mean().backward()
        steps.append(group.take())
    return steps, [float(v) for p in raw.parameters() for v in p.detach().flatten()]


def _job(rank: int, world_size: int) -> tuple[dict[str, tuple[Sent, Sent]], list[Any]]:
    with warnings.catch_warnings():  # broadcast_buffers' deprecation, DDP's notes
        warnings.simplefilter("ignore")
        by_scenario = {
            name: (_run(scenario, rank, False), _run(scenario, rank, True))
            for name, scenario in SCENARIOS.items()
        }
        joined = [
            _run_joined(rank, False),
            _run_joined(rank, True),
            _run_joined(rank, False, 3),
            _joined_before_a_static_graph_settled(rank),
        ]
    return by_scenario, joined


@pytest.fixture(scope="module")
def ranks() -> list[tuple[dict[str, tuple[Sent, Sent]], list[Any]]]:
    return run_distributed(_job, 2, timeout=180)


@pytest.fixture(scope="module")
def sent(
    ranks: list[tuple[dict[str, tuple[Sent, Sent]], list[Any]]],
) -> list[dict[str, tuple[Sent, Sent]]]:
    return [by_scenario for by_scenario, _ in ranks]


#: After each forward under Join: the two flags sent here, the one DDP sends.
OURS_JOIN_FLAGS: Final = Message("all_reduce", ((2, "torch.float32"),))
DDPS_JOIN_FLAG: Final = Message("all_reduce", ((1, "torch.float32"),))


def test_under_join_every_step_sends_what_ddps_sends_but_its_one_flag(
    ranks: list[tuple[dict[str, tuple[Sent, Sent]], list[Any]]],
) -> None:
    for rank, (_, (ours, theirs, _, _)) in enumerate(ranks):
        assert len(ours) == len(theirs) == JOIN_BATCHES[rank] + 1
        assert OURS_JOIN_FLAGS in ours[0]
        for step, (mine, ddps) in enumerate(zip(ours, theirs, strict=True)):
            as_ddps = [DDPS_JOIN_FLAG if m == OURS_JOIN_FLAGS else m for m in mine]
            assert as_ddps == ddps, f"rank {rank}, step {step}"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_forward_and_backward_sends_what_ddps_sends(
    sent: list[dict[str, tuple[Sent, Sent]]], name: str
) -> None:
    for rank, by_scenario in enumerate(sent):
        ours, theirs = by_scenario[name]
        for step, (mine, ddps) in enumerate(zip(ours.steps, theirs.steps, strict=True)):
            assert mine == ddps, f"rank {rank}, step {step}: (forward, backward)"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_apply_broadcasts_the_models_values_as_ddp(
    sent: list[dict[str, tuple[Sent, Sent]]], name: str
) -> None:
    for by_scenario in sent:
        ours, theirs = by_scenario[name]
        assert ours.init_broadcasts == theirs.init_broadcasts != []


def test_a_static_graph_sends_its_map_of_used_parameters_once_before_the_buckets(
    sent: list[dict[str, tuple[Sent, Sent]]],
) -> None:
    """DDP's delay_all_reduce: the map (int32, one per parameter) first, then every bucket."""
    parameters = len(list(Net().parameters()))
    for by_scenario in sent:
        ours, _ = by_scenario["static_graph, side unused on rank 1"]
        maps = [
            [m for m in backward if m.tensors == ((parameters, "torch.int32"),)]
            for _, backward in ours.steps
        ]
        assert [len(found) for found in maps] == [1, 0, 0, 0]
        first_backward = ours.steps[0][1]
        assert first_backward[0] == maps[0][0]
        assert all(m.tensors[0][1] == "torch.float32" for m in first_backward[1:])


def test_buckets_are_rebuilt_at_the_next_forward_with_two_broadcasts_as_ddp(
    sent: list[dict[str, tuple[Sent, Sent]]],
) -> None:
    """DDP's sync_bucket_indices: every index and the count, then the buckets' lengths."""
    parameters = len(list(Net().parameters()))
    for by_scenario in sent:
        ours, _ = by_scenario["bucket_cap_mb, a bucket per parameter"]
        forwards = [forward for forward, _ in ours.steps]
        assert forwards[0] == forwards[2] == forwards[3] == []
        # Three buckets, in arrival order, each closed once it holds 104 bytes: head's
        # bias, weight and side's bias; side's weight; first's bias and weight.
        assert forwards[1] == [
            Message("broadcast", ((parameters + 1, "torch.int32"),)),
            Message("broadcast", ((3, "torch.int32"),)),
        ]


def test_the_recording_group_sees_every_collective_of_a_backward(
    sent: list[dict[str, tuple[Sent, Sent]]],
) -> None:
    """The scenarios record something: one bucket of 6 parameters' gradients per backward."""
    floats = sum(p.numel() for p in Net().parameters())
    for by_scenario in sent:
        ours, theirs = by_scenario["no keyword"]
        for side in (ours, theirs):
            assert [backward for _, backward in side.steps] == [
                [Message("all_reduce", ((floats, "torch.float32"),))]
            ] * STEPS


def test_under_join_a_forward_whose_output_needs_no_gradient_is_not_shadowed(
    ranks: list[tuple[dict[str, tuple[Sent, Sent]], list[Any]]],
) -> None:
    """Why two flags: no backward follows that forward, and the joined rank sends no bucket.

    With DDP's one flag (a synchronizing forward) the joined rank would all-reduce its
    buckets against the next forward's collectives of the others.
    """
    floats = sum(p.numel() for p in Net(norm=True).parameters())
    bucket = Message("all_reduce", ((floats, "torch.float32"),))
    (_, (_, _, rank_0, _)), (_, (plain, _, rank_1, _)) = ranks
    assert [bucket in step for step in rank_0] == [True, True, True, False, False]
    # Rank 1 joined after its two steps: at its end it shadows rank 0's last two steps,
    # meeting one backward here (step 2's), two where every step has one.
    assert plain[-1].count(bucket) == 2
    assert rank_1[-1].count(bucket) == 1


def test_a_rank_that_joined_before_a_static_graph_settled_trains_on_with_the_others(
    ranks: list[tuple[dict[str, tuple[Sent, Sent]], list[Any]]],
) -> None:
    """No map after the first backward, on either rank, and the same parameters after.

    (Join's own collectives go on after it, as under DDP: torch leaves the joinables'
    Join configuration enabled.)
    """
    (_, (*_, (steps_0, parameters_0))), (_, (*_, (steps_1, parameters_1))) = ranks
    parameters = len(list(Net().parameters()))
    used_map = Message("all_reduce", ((parameters, "torch.int32"),))
    assert steps_0 == steps_1
    assert all(used_map not in step for step in steps_0)
    assert parameters_0 == parameters_1
