"""``apis._objects.all_gather_objects`` gives what torch's ``all_gather_object`` gives, on gloo.

Ours reads the gathered bytes back without numpy (torch's goes through
``Tensor.numpy()``); here both run side by side on 3 ranks, on objects of different
sizes and kinds, over the world group and over a subgroup of two ranks.
"""

from __future__ import annotations

from typing import Any, Final

import pytest
import torch.distributed as dist

from torchcontract.apis._objects import all_gather_objects
from torchcontract.testing import run_distributed

WORLD_SIZE: Final = 3
Gathered = tuple[list[object], list[object], list[object] | None, list[object] | None]


def _value(rank: int) -> object:
    """Objects of different kinds and sizes (a few bytes to a few kilobytes) by rank."""
    return [None, {"rank": rank, "shape": (2, 3)}, "x" * 5000][rank]


def _gather_both(rank: int, world_size: int) -> Gathered:
    value = _value(rank)
    ours = all_gather_objects(value)
    torchs: list[Any] = [None] * world_size
    dist.all_gather_object(torchs, value)
    pair = dist.new_group([0, 2])
    if rank == 1:
        return ours, torchs, None, None
    ours_over_pair = all_gather_objects(("pair", rank), pair)
    torchs_over_pair: list[Any] = [None] * 2
    dist.all_gather_object(torchs_over_pair, ("pair", rank), group=pair)
    return ours, torchs, ours_over_pair, torchs_over_pair


@pytest.fixture(scope="module")
def gathered() -> list[Gathered]:
    return run_distributed(_gather_both, WORLD_SIZE, timeout=120.0)


def test_every_rank_gets_every_ranks_object_by_rank_as_torchs(gathered: list[Gathered]) -> None:
    expected = [_value(rank) for rank in range(WORLD_SIZE)]
    for ours, torchs, _, _ in gathered:
        assert ours == torchs == expected


def test_a_subgroup_gathers_its_ranks_objects_by_group_rank_as_torchs(
    gathered: list[Gathered],
) -> None:
    for rank in (0, 2):
        _, _, ours, torchs = gathered[rank]
        assert ours == torchs == [("pair", 0), ("pair", 2)]
