"""replicate reads from the device only where DDP does: each read waits for the device.

Under ``find_unused_parameters`` (or ``static_graph``), DDP reads its map of used
parameters back only when a parameter went unused on this rank
(``finalize_bucket_dense``); a rank that used every parameter knows they were used.
With ``static_graph`` the map is read at most once, in the first synchronizing
backward: it does not change after. Counted here through ``apis._torch.to_bools``,
the one read of the map, on a gloo group of one rank: without and with a
communication hook.
"""

from __future__ import annotations

from typing import Any, Final

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from torchcontract.apis import _torch, replicate

pytestmark = pytest.mark.usefixtures("one_rank_group")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)

    def forward(self, x: Tensor, use_spare: bool) -> Tensor:
        out: Tensor = self.first(x)
        return out + self.spare(x) if use_spare else out


def _reads(monkeypatch: pytest.MonkeyPatch, hook: bool, use_spare: bool, keyword: str) -> int:
    """The reads of the map of used parameters in three synchronizing backwards."""
    reads: list[int] = []
    to_bools = _torch.to_bools

    def counted(tensor: Tensor) -> list[bool]:
        reads.append(tensor.numel())
        return to_bools(tensor)

    monkeypatch.setattr(_torch, "to_bools", counted)
    model: Any = replicate(
        Net(),
        find_unused_parameters=keyword == "find_unused_parameters",
        static_graph=keyword == "static_graph",
    )
    if hook:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    for _ in range(3):
        model(torch.ones(2, 4), use_spare).sum().backward()
    return len(reads)


HOOKS: Final = pytest.mark.parametrize("hook", [False, True], ids=["no hook", "comm hook"])
KEYWORDS: Final = pytest.mark.parametrize("keyword", ["find_unused_parameters", "static_graph"])


@HOOKS
@KEYWORDS
def test_no_read_back_when_every_parameter_was_used(
    monkeypatch: pytest.MonkeyPatch, hook: bool, keyword: str
) -> None:
    assert _reads(monkeypatch, hook, use_spare=True, keyword=keyword) == 0


@HOOKS
def test_one_read_per_backward_when_a_parameter_went_unused(
    monkeypatch: pytest.MonkeyPatch, hook: bool
) -> None:
    assert _reads(monkeypatch, hook, use_spare=False, keyword="find_unused_parameters") == 3


@HOOKS
def test_a_static_graph_reads_its_map_once_when_a_parameter_went_unused(
    monkeypatch: pytest.MonkeyPatch, hook: bool
) -> None:
    assert _reads(monkeypatch, hook, use_spare=False, keyword="static_graph") == 1
