"""Per-step fault tolerance with torchft: replicate and fully_shard beside torch's paths.

One torchft Lighthouse on 127.0.0.1, two replica groups, gloo, a tiny model (see
``torchft_replicas``). ``replicate`` over torchft's ``ProcessGroupDummy(0, 1)``
with the hook torchft's ``DistributedDataParallel`` registers equals
``torchft.DistributedDataParallel``; ``fully_shard`` in torchft's HSDP pattern
(each group's own mesh, ``set_all_reduce_hook`` through ``manager.allreduce``)
equals FSDP2: the same losses, committed steps and final parameters. With one
replica group SIGKILLed after two committed steps and started again, it recovers
live from its peer (over the manager's group, ``PGTransport``), and the run ends
where the run without a failure ends, for ours and for torch's path alike.

The managers quorum synchronously (``use_async_quorum=False``): the recovering
group then loads its peer's state before its forward and takes part in that step,
so the numbers do not depend on timing. (Under the default asynchronous quorum,
torchft reads and writes the state dict on its quorum thread while the main thread
runs forward and backward; see docs/fault-tolerance.md.)
"""

from __future__ import annotations

import functools
from typing import Final

import pytest
from torchft_replicas import Plan, RankReport, run_replica_groups

pytest.importorskip(
    "torchft",
    reason="torchft is not installed: requirements-torchft.txt pins it (wheels for CPython "
    "3.11 on manylinux x86_64)",
)

KILL_AT: Final = 2


@functools.cache
def _run(kind: str, killed: bool) -> tuple[RankReport, ...]:
    ranks = 2 if kind in {"fully_shard", "fsdp2"} else 1
    plan = Plan(kind, ranks_per_group=ranks, kill_group=1 if killed else None, kill_at=KILL_AT)
    return tuple(run_replica_groups(plan))


def _assert_same_run(mine: tuple[RankReport, ...], theirs: tuple[RankReport, ...]) -> None:
    """Every rank of every group: the same losses, steps and parameters, exactly."""
    assert [(r.group, r.rank, r.attempt) for r in mine] == [
        (r.group, r.rank, r.attempt) for r in theirs
    ]
    for ours, torchs in zip(mine, theirs, strict=True):
        assert ours.losses == torchs.losses
        assert (ours.step, ours.batches_committed) == (torchs.step, torchs.batches_committed)
        assert ours.parameters == torchs.parameters


def _assert_recovered(killed: tuple[RankReport, ...], healthy: tuple[RankReport, ...]) -> None:
    """The killed group restarted, recovered at the step it died, and ended as without a kill."""
    steps = Plan("").steps
    for report in killed:
        assert report.step == steps
        assert report.batches_committed == 2 * steps  # two groups in every committed step
        if report.group == 1:
            assert report.attempt == 1
            assert sorted(report.losses) == list(range(KILL_AT, steps))
        else:
            assert report.attempt == 0
            assert sorted(report.losses) == list(range(steps))
    # Every group holds the same model (the same shards, rank by rank) ...
    by_rank: dict[int, list[float]] = {}
    for report in killed:
        assert by_rank.setdefault(report.rank, report.parameters) == report.parameters
    # ... the one the run without a failure ends with, losses of every step included.
    for after_kill, without in zip(killed, healthy, strict=True):
        assert after_kill.parameters == without.parameters
        assert after_kill.losses.items() <= without.losses.items()


def test_replicate_under_torchft_equals_torchft_ddp() -> None:
    mine, theirs = _run("replicate", False), _run("ddp", False)
    _assert_same_run(mine, theirs)
    assert mine[0].parameters == mine[1].parameters
    assert [r.step for r in mine] == [Plan("").steps] * 2


def test_a_killed_replicate_group_recovers_live_from_its_peer() -> None:
    mine, theirs = _run("replicate", True), _run("ddp", True)
    _assert_recovered(mine, _run("replicate", False))
    _assert_same_run(mine, theirs)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fully_shard_hsdp_under_torchft_equals_fsdp2() -> None:
    mine, theirs = _run("fully_shard", False), _run("fsdp2", False)
    _assert_same_run(mine, theirs)
    assert [r.step for r in mine] == [Plan("").steps] * 4


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_fully_shard_group_recovers_live_from_its_peer() -> None:
    mine, theirs = _run("fully_shard", True), _run("fsdp2", True)
    _assert_recovered(mine, _run("fully_shard", False))
    _assert_same_run(mine, theirs)
