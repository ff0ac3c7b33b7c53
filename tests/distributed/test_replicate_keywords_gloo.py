"""DDP's keywords on replicate, side by side with DistributedDataParallel on 2 gloo ranks.

``find_unused_parameters=False`` (numbers, and DDP's error when a parameter goes
unused), ``static_graph``, a 1-D ``device_mesh`` and ``init_sync=False`` (ranks
keep models that differ): the gradients and parameters after every step equal
DDP's with the same keywords.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from torchcontract.apis import replicate
from torchcontract.testing import run_distributed

STEPS: Final = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.side = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor, use_side: bool = True) -> Tensor:
        h = torch.relu(self.first(x))
        if use_side:
            h = h + self.side(h)
        out: Tensor = self.head(h)
        return out


def _model(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def _train(model: nn.Module, raw: Net, rank: int) -> list[Tensor]:
    """Every gradient after each step, then every parameter, flattened."""
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
    seen: list[Tensor] = []
    for step in range(STEPS):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * rank + step))
        model(x).pow(2).mean().backward()
        seen.extend(p.grad.clone() for p in raw.parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad()
    seen.extend(p.detach().clone() for p in raw.parameters())
    return seen


#: By name: the keywords (made on each rank: a mesh is), and whether models differ by rank.
CASES: Final[dict[str, tuple[Callable[[], dict[str, Any]], bool]]] = {
    "find_unused_parameters=False": (lambda: {"find_unused_parameters": False}, False),
    "static_graph": (lambda: {"static_graph": True}, False),
    "device_mesh": (lambda: {"device_mesh": init_device_mesh("cpu", (2,))}, False),
    "init_sync=False": (lambda: {"init_sync": False}, True),
}


def _gap(name: str, rank: int) -> float:
    keywords, differ = CASES[name]
    seed = rank if differ else 0
    mine = replicate(_model(seed), **keywords())
    ours = _train(mine, mine, rank)
    raw = _model(seed)
    theirs = _train(DistributedDataParallel(raw, **keywords()), raw, rank)
    assert len(ours) == len(theirs)
    return max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True))


def _unused_error(model: nn.Module) -> str:
    """What a parameter unused in a backward raises: at its end here, at the next forward in DDP."""
    try:
        for _ in range(2):
            model(torch.ones(2, 4), use_side=False).sum().backward()
    except RuntimeError as error:
        return str(error)
    return ""


def _job(rank: int, world_size: int) -> tuple[dict[str, float], str, str]:
    gaps = {name: _gap(name, rank) for name in CASES}
    ours = _unused_error(replicate(_model(0), find_unused_parameters=False))
    theirs = _unused_error(DistributedDataParallel(_model(0)))
    return gaps, ours, theirs


@pytest.fixture(scope="module")
def results() -> list[tuple[dict[str, float], str, str]]:
    return run_distributed(_job, 2, timeout=120)


@pytest.mark.parametrize("name", list(CASES))
def test_numbers_equal_ddps_with_the_same_keyword(
    results: list[tuple[dict[str, float], str, str]], name: str
) -> None:
    for gaps, _, _ in results:
        assert gaps[name] == 0.0, f"differs from DDP's by {gaps[name]}"


def test_an_unused_parameter_without_find_unused_parameters_raises_ddps_error(
    results: list[tuple[dict[str, float], str, str]],
) -> None:
    sentence = (
        "Expected to have finished reduction in the prior iteration before starting a new one"
    )
    for _, ours, theirs in results:
        assert sentence in theirs
        assert sentence in ours
        assert "'side.weight', 'side.bias'" in ours  # and names the parameters
