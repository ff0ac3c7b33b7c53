"""DDP's keywords on replicate, side by side with DistributedDataParallel on 2 gloo ranks.

``find_unused_parameters=False`` (numbers, and DDP's error when a parameter goes
unused), ``static_graph``, a 1-D ``device_mesh``, ``init_sync=False`` (ranks
keep models that differ) and ``gradient_as_bucket_view`` (with gradients set to
None or zeroed between steps): the gradients and parameters after every step
equal DDP's with the same keywords. With ``gradient_as_bucket_view`` the
gradients live in the bucket buffers, as DDP's: one storage per bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import attrs
import pytest
import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from torchcontract.apis import _compat, replicate
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


def _train(model: nn.Module, raw: Net, rank: int, set_to_none: bool = True) -> list[Tensor]:
    """Every gradient after each step, then every parameter, flattened."""
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
    seen: list[Tensor] = []
    for step in range(STEPS):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * rank + step))
        model(x).pow(2).mean().backward()
        seen.extend(p.grad.clone() for p in raw.parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
    seen.extend(p.detach().clone() for p in raw.parameters())
    return seen


#: By name: the keywords (made on each rank: a mesh is), and whether models differ by rank.
CASES: Final[dict[str, tuple[Callable[[], dict[str, Any]], bool]]] = {
    "find_unused_parameters=False": (lambda: {"find_unused_parameters": False}, False),
    "static_graph": (lambda: {"static_graph": True}, False),
    "device_mesh": (lambda: {"device_mesh": init_device_mesh("cpu", (2,))}, False),
    "gradient_as_bucket_view": (lambda: {"gradient_as_bucket_view": True}, False),
    "gradient_as_bucket_view, zeroed": (lambda: {"gradient_as_bucket_view": True}, False),
}
if "init_sync" in _compat.DDP_KEYWORDS:  # DDP 2.7 on; ours refuses it elsewhere
    CASES["init_sync=False"] = (lambda: {"init_sync": False}, True)


def _gap(name: str, rank: int) -> float:
    keywords, differ = CASES[name]
    seed = rank if differ else 0
    set_to_none = not name.endswith("zeroed")
    mine = replicate(_model(seed), **keywords())
    ours = _train(mine, mine, rank, set_to_none)
    raw = _model(seed)
    theirs = _train(DistributedDataParallel(raw, **keywords()), raw, rank, set_to_none)
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


def _storages(model: nn.Module, raw: Net, rank: int, views: bool) -> tuple[int, int]:
    """After training: how many storages the gradients live in, and their bytes."""
    _train(model, raw, rank, set_to_none=False)
    storages = {
        p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
        for p in raw.parameters()
        if p.grad is not None
    }
    return len(storages), sum(storages.values())


@attrs.frozen
class Report:
    gaps: dict[str, float]
    ours_error: str
    theirs_error: str
    #: (storages, bytes) of the gradients: ours and DDP's with views, ours without.
    ours_views: tuple[int, int]
    theirs_views: tuple[int, int]
    ours_plain: tuple[int, int]


def _job(rank: int, world_size: int) -> Report:
    gaps = {name: _gap(name, rank) for name in CASES}
    ours = _unused_error(replicate(_model(0), find_unused_parameters=False))
    theirs = _unused_error(DistributedDataParallel(_model(0)))
    mine = replicate(_model(0), gradient_as_bucket_view=True)
    raw = _model(0)
    ddp = DistributedDataParallel(raw, gradient_as_bucket_view=True, find_unused_parameters=True)
    plain = replicate(_model(0))
    return Report(
        gaps,
        ours,
        theirs,
        _storages(mine, mine, rank, True),
        _storages(ddp, raw, rank, True),
        _storages(plain, plain, rank, False),
    )


@pytest.fixture(scope="module")
def results() -> list[Report]:
    return run_distributed(_job, 2, timeout=120)


@pytest.mark.parametrize("name", list(CASES))
def test_numbers_equal_ddps_with_the_same_keyword(results: list[Report], name: str) -> None:
    for report in results:
        assert report.gaps[name] == 0.0, f"differs from DDP's by {report.gaps[name]}"


def test_an_unused_parameter_without_find_unused_parameters_raises_ddps_error(
    results: list[Report],
) -> None:
    sentence = (
        "Expected to have finished reduction in the prior iteration before starting a new one"
    )
    for report in results:
        assert sentence in report.theirs_error
        assert sentence in report.ours_error
        # and names the module and the parameters
        assert "replicate on Net with find_unused_parameters=False got no gradient for " in (
            report.ours_error
        )
        assert "'side.weight', 'side.bias' in this backward" in report.ours_error


def test_gradients_as_bucket_views_live_in_the_buckets_as_ddps(results: list[Report]) -> None:
    """One storage per bucket (the model's one), as DDP's; without views, one per parameter."""
    gradient_bytes = sum(p.numel() * p.element_size() for p in _model(0).parameters())
    parameters = len(list(_model(0).parameters()))
    for report in results:
        assert report.ours_views[0] == report.theirs_views[0] == 1
        assert report.ours_plain == (parameters, gradient_bytes)
        # The bucket holds the gradients (and, ours, one used-flag per parameter).
        assert report.theirs_views[1] == gradient_bytes
        assert report.ours_views[1] == gradient_bytes + parameters * 4
