"""run_distributed's choice of root cause, for each kind of failure it tells apart.

A failure is a cause (an exception from the rank's function, a rank that died) or a
consequence (a ``torch.distributed.DistError``, gloo's connection errors, a failure
outside the function). In each scenario the consequence reaches the parent first,
so a classification that took it for a cause would raise it instead.
"""

from __future__ import annotations

import os
import re
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped

from torchcontract.testing import RankFailedError, free_port, run_distributed

# ----------------------------------------------------------------- rank functions


def _wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.005)


def _dist_error_waiting_for_the_peer(rank: int, port: int, marker: Path) -> None:
    """On rank 0: the DistError torch raises when a peer never gives what it waits for.

    A store-based exchange (what object collectives and group creation use) with a
    peer that stays away: ``DistStoreError: wait timeout after 1000ms, keys: ...``,
    no connection words in it.
    """
    store = TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=30))
    if rank == 1:
        _wait_for(marker)
        time.sleep(0.2)  # rank 0's report reaches the parent first
        return
    store.set_timeout(timedelta(seconds=1))
    try:
        store.wait(["rank 1's share"])
    except dist.DistError:
        marker.touch()
        raise
    raise AssertionError("rank 1 never sets its share")


def _raise_after_a_peers_dist_error(rank: int, world_size: int, port: int, directory: str) -> None:
    dist.barrier()  # both ranks are in the group before anything fails
    _dist_error_waiting_for_the_peer(rank, port, Path(directory, "rank0-failed"))
    raise ValueError("rank one's own failure")


def _exit_after_a_peers_dist_error(rank: int, world_size: int, port: int, directory: str) -> None:
    dist.barrier()
    _dist_error_waiting_for_the_peer(rank, port, Path(directory, "rank0-failed"))
    os._exit(3)


def _fail_waiting_in_a_collective_for_a_peer_that_raised(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one fails before the collective")
    dist.all_reduce(torch.ones(1))  # fails when rank 1 leaves: a connection error


# ----------------------------------------------------------------- tests


def test_an_exception_from_the_function_is_raised_over_a_peers_earlier_dist_error(
    tmp_path: Path,
) -> None:
    with pytest.raises(ValueError, match="rank one's own failure") as caught:
        run_distributed(_raise_after_a_peers_dist_error, 2, args=(free_port(), str(tmp_path)))
    # Rank 0's failure is a DistError that only its type marks as a consequence.
    (note,) = [note for note in caught.value.__notes__ if note.startswith("then rank 0")]
    assert note.startswith("then rank 0 failed: DistStoreError: wait timeout after 1000ms")
    assert not any(word in note for word in ("onnection", "roken pipe", "imed out"))


def test_a_rank_exiting_is_raised_over_a_peers_earlier_dist_error(tmp_path: Path) -> None:
    with pytest.raises(RankFailedError, match="rank 1 of 2 exited with code 3") as caught:
        run_distributed(_exit_after_a_peers_dist_error, 2, args=(free_port(), str(tmp_path)))
    assert "then rank 0 failed: DistStoreError" in "".join(caught.value.__notes__)


def test_a_peers_connection_error_in_a_collective_is_a_consequence() -> None:
    with pytest.raises(ValueError, match="rank one fails before the collective") as caught:
        run_distributed(_fail_waiting_in_a_collective_for_a_peer_that_raised, 2, grace=30.0)
    notes = "".join(caught.value.__notes__)
    assert re.search(
        r"then rank 0 failed: RuntimeError: .*Connection (closed|reset) by peer", notes
    )
