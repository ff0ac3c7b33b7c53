"""DDP's keywords on replicate, side by side with DistributedDataParallel on 2 gloo ranks.

No keyword (DDP's defaults: ``find_unused_parameters=False``), each keyword alone
(``find_unused_parameters=True``, ``static_graph``, also with a parameter no
iteration uses, a 1-D ``device_mesh``, ``init_sync=False`` with ranks keeping
models that differ, ``gradient_as_bucket_view`` with gradients set to None or
zeroed between steps): the gradients and parameters after every step equal DDP's
with the same keywords. Without unused parameters found, a parameter that goes
unused raises DDP's error at the same moment (the next forward), leaving the
same gradients. With ``gradient_as_bucket_view`` the gradients live in the
bucket buffers, as DDP's (one storage per bucket), and a parameter no rank used
keeps no gradient, as DDP's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
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


def _train(
    model: nn.Module, raw: Net, rank: int, set_to_none: bool = True, use_side: bool = True
) -> list[Tensor]:
    """Every gradient after each step, then every parameter, flattened."""
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
    seen: list[Tensor] = []
    for step in range(STEPS):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * rank + step))
        model(x, use_side).pow(2).mean().backward()
        seen.extend(p.grad.clone() for p in raw.parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
    seen.extend(p.detach().clone() for p in raw.parameters())
    return seen


#: By name: the keywords (made on each rank: a mesh is), and whether models differ by rank.
CASES: Final[dict[str, tuple[Callable[[], dict[str, Any]], bool]]] = {
    "no keyword": (dict, False),
    "find_unused_parameters=False": (lambda: {"find_unused_parameters": False}, False),
    "find_unused_parameters=True": (lambda: {"find_unused_parameters": True}, False),
    "find_unused_parameters=True, side unused": (
        lambda: {"find_unused_parameters": True},
        False,
    ),
    "static_graph": (lambda: {"static_graph": True}, False),
    # DDP finds a static graph's unused parameters in its first iteration: no error.
    "static_graph, side unused": (lambda: {"static_graph": True}, False),
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
    use_side = not name.endswith("side unused")
    mine = replicate(_model(seed), **keywords())
    ours = _train(mine, mine, rank, set_to_none, use_side)
    raw = _model(seed)
    ddp = DistributedDataParallel(raw, **keywords())
    theirs = _train(ddp, raw, rank, set_to_none, use_side)
    assert len(ours) == len(theirs)
    return max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True))


@attrs.frozen
class Unused:
    """A parameter unused without unused parameters found: when it raised, what, and grads."""

    #: "forward N" or "backward N" (counted from 1), or "" if nothing raised.
    moment: str
    error: str
    error_type: str
    #: Every gradient after the backward that left the parameter unused (plain lists: the
    #: report crosses processes).
    grads: list[list[float] | None]


def _unused_error(model: nn.Module, raw: Net, rank: int) -> Unused:
    """Three steps that leave ``side`` unused; DDP raises at the next forward with grad."""
    grads: list[list[float] | None] = []
    for step in range(1, 4):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
        moment = f"forward {step}"
        try:
            loss = model(x, use_side=False).sum()
            moment = f"backward {step}"
            loss.backward()
        except RuntimeError as error:
            return Unused(moment, str(error), type(error).__name__, grads)
        grads = _plain(p.grad for p in raw.parameters())
    return Unused("", "", "", grads)


def _plain(tensors: Iterable[Tensor | None]) -> list[list[float] | None]:
    """Each tensor as a flat list of floats (None stays None)."""
    return [None if tensor is None else tensor.flatten().tolist() for tensor in tensors]


def _unused_grads_with_views(model: nn.Module, raw: Net, rank: int) -> list[list[float] | None]:
    """``gradient_as_bucket_view`` with ``side`` unused everywhere: AdamW's steps, then grads.

    A parameter no rank used keeps no gradient; weight decay would move it if it got zeros.
    """
    optimizer = torch.optim.AdamW(raw.parameters(), lr=0.1, weight_decay=0.5)
    for step in range(2):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * rank + step))
        model(x, use_side=False).pow(2).mean().backward()
        optimizer.step()
    return _plain(p.grad for p in raw.parameters()) + _plain(raw.parameters())


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
    ours_unused: Unused
    theirs_unused: Unused
    #: (storages, bytes) of the gradients: ours and DDP's with views, ours without.
    ours_views: tuple[int, int]
    theirs_views: tuple[int, int]
    ours_plain: tuple[int, int]
    #: With views and ``side`` unused: every gradient (or None), then every parameter.
    ours_unused_views: list[list[float] | None]
    theirs_unused_views: list[list[float] | None]


def _job(rank: int, world_size: int) -> Report:
    gaps = {name: _gap(name, rank) for name in CASES}
    mine = replicate(_model(0))
    ours_unused = _unused_error(mine, mine, rank)
    raw = _model(0)
    theirs_unused = _unused_error(DistributedDataParallel(raw), raw, rank)
    mine = replicate(_model(0), gradient_as_bucket_view=True)
    raw = _model(0)
    ddp = DistributedDataParallel(raw, gradient_as_bucket_view=True)
    plain = replicate(_model(0))
    views: dict[str, Any] = {"gradient_as_bucket_view": True, "find_unused_parameters": True}
    unused_views = replicate(_model(0), **views)
    unused_raw = _model(0)
    unused_ddp = DistributedDataParallel(unused_raw, **views)
    return Report(
        gaps,
        ours_unused,
        theirs_unused,
        _storages(mine, mine, rank, True),
        _storages(ddp, raw, rank, True),
        _storages(plain, plain, rank, False),
        _unused_grads_with_views(unused_views, unused_views, rank),
        _unused_grads_with_views(unused_ddp, unused_raw, rank),
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
        ours, theirs = report.ours_unused, report.theirs_unused
        assert sentence in theirs.error
        assert sentence in ours.error
        assert theirs.error_type == "RuntimeError"
        assert ours.error_type == "UnusedParameterError"  # a RuntimeError too
        # and names the module, the parameters and what to do
        assert "replicate on Net got no gradient for 'side.weight', 'side.bias'" in ours.error
        assert "pass find_unused_parameters=True to replicate" in ours.error


def test_an_unused_parameter_raises_at_the_next_forward_as_ddps(results: list[Report]) -> None:
    for report in results:
        assert report.ours_unused.moment == report.theirs_unused.moment == "forward 2"


def test_an_unused_parameter_leaves_the_gradients_unaveraged_as_ddps(
    results: list[Report],
) -> None:
    for report in results:
        ours, theirs = report.ours_unused.grads, report.theirs_unused.grads
        assert [grad is None for grad in ours] == [grad is None for grad in theirs]
        for a, b in zip(ours, theirs, strict=True):
            if a is not None and b is not None:
                assert a == b


def test_gradients_as_bucket_views_live_in_the_buckets_as_ddps(results: list[Report]) -> None:
    """One storage per bucket (the model's one), as DDP's; without views, one per parameter."""
    gradient_bytes = sum(p.numel() * p.element_size() for p in _model(0).parameters())
    parameters = len(list(_model(0).parameters()))
    for report in results:
        assert report.ours_views == report.theirs_views == (1, gradient_bytes)
        assert report.ours_plain == (parameters, gradient_bytes)


def test_a_parameter_no_rank_used_keeps_no_gradient_with_bucket_views_as_ddps(
    results: list[Report],
) -> None:
    """Not a zero gradient: AdamW's weight decay would then move it away from DDP's."""
    names = [name for name, _ in _model(0).named_parameters()]
    for report in results:
        ours, theirs = report.ours_unused_views, report.theirs_unused_views
        grads = len(names)
        assert [grad is None for grad in ours[:grads]] == [grad is None for grad in theirs[:grads]]
        assert [names[i] for i, grad in enumerate(ours[:grads]) if grad is None] == [
            "side.weight",
            "side.bias",
        ]
        for a, b in zip(ours, theirs, strict=True):
            if a is not None and b is not None:
                assert a == b
