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
keeps no gradient, as DDP's. DDP's buffer keywords (``broadcast_buffers``, deprecated
from torch 2.13, and ``forward_sync_buffers``, which replaces it) on a model whose
buffers differ by rank: the buffers after apply and after each step equal DDP's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any, Final

import attrs
import pytest
import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from torchcontract.apis import _compat, replicate
from torchcontract.testing import run_distributed

STEPS: Final = 3


class Net(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.side = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.checkpointed = checkpointed

    def forward(self, x: Tensor, use_side: bool = True) -> Tensor:
        h = torch.relu(self.first(x))
        if use_side:
            # A reentrant checkpoint accumulates side's gradients in a nested backward.
            side = (
                checkpoint(self.side, h, use_reentrant=True) if self.checkpointed else self.side(h)
            )
            assert isinstance(side, Tensor)
            h = h + side
        out: Tensor = self.head(h)
        return out


def _model(seed: int, checkpointed: bool = False) -> Net:
    torch.manual_seed(seed)
    return Net(checkpointed)


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
    "find_unused_parameters=True, side unused on rank 1": (
        lambda: {"find_unused_parameters": True},
        False,
    ),
    "static_graph": (lambda: {"static_graph": True}, False),
    "static_graph, reentrant checkpoint": (lambda: {"static_graph": True}, False),
    "no keyword, reentrant checkpoint": (dict, False),
    # DDP finds a static graph's unused parameters in its first iteration: no error.
    "static_graph, side unused": (lambda: {"static_graph": True}, False),
    # Used on some rank: averaged every step, with zeros from rank 1.
    "static_graph, side unused on rank 1": (lambda: {"static_graph": True}, False),
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
    use_side = not name.endswith("side unused") and not (
        name.endswith("side unused on rank 1") and rank == 1
    )
    checkpointed = name.endswith("reentrant checkpoint")
    mine = replicate(_model(seed, checkpointed), **keywords())
    ours = _train(mine, mine, rank, set_to_none, use_side)
    raw = _model(seed, checkpointed)
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


def _until_error(
    model: nn.Module, raw: Net, rank: int, uses: tuple[bool, ...] = (False, False, False)
) -> Unused:
    """Steps whose use of ``side`` is ``uses``, step by step: when and what raised.

    By default three steps that leave ``side`` unused: without unused parameters found,
    DDP raises at the next forward with grad.
    """
    grads: list[list[float] | None] = []
    for step, use_side in enumerate(uses, start=1):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank + step))
        moment = f"forward {step}"
        try:
            loss = model(x, use_side=use_side).sum()
            moment = f"backward {step}"
            loss.backward()
        except RuntimeError as error:
            return Unused(moment, str(error), type(error).__name__, grads)
        grads = _plain(p.grad for p in raw.parameters())
    return Unused("", "", "", grads)


#: A static graph that changes, by name: whether ``side`` takes part, step by step.
STATIC_CHANGES: Final = {
    "used first, then not": (True, False, True),
    "unused first, then used": (False, True, True),
}


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


class BufferNet(nn.Module):
    """A batch norm between two layers: running statistics that differ by rank."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.norm(self.first(x)))
        return out


#: DDP's buffer keywords, by name; each where this torch's DDP takes it.
BUFFER_CASES: Final[dict[str, dict[str, Any]]] = {
    "no buffer keyword": {},
    "broadcast_buffers=True": {"broadcast_buffers": True},
    "broadcast_buffers=False": {"broadcast_buffers": False},
}
if "forward_sync_buffers" in _compat.DDP_KEYWORDS:  # DDP 2.13 on; ours refuses it elsewhere
    BUFFER_CASES["broadcast_buffers=None"] = {"broadcast_buffers": None}
    BUFFER_CASES["forward_sync_buffers=True"] = {"forward_sync_buffers": True}
    BUFFER_CASES["forward_sync_buffers=False"] = {"forward_sync_buffers": False}
    BUFFER_CASES["both, forward_sync_buffers wins"] = {
        "broadcast_buffers": True,
        "forward_sync_buffers": False,
    }


def _buffers(raw: nn.Module) -> list[float]:
    return torch.cat([buffer.detach().double().flatten() for buffer in raw.buffers()]).tolist()


def _buffer_history(keywords: dict[str, Any], rank: int, theirs: bool) -> list[list[float]]:
    """The buffers after apply and after each of two steps, ours or DDP's."""
    torch.manual_seed(0)
    raw = BufferNet()
    with torch.no_grad():
        for buffer in raw.norm.buffers():
            if buffer.is_floating_point():
                buffer.fill_(float(rank))  # differ by rank at apply
    with warnings.catch_warnings():  # the deprecation: tests/test_replicate_ddp_keywords.py
        warnings.simplefilter("ignore", FutureWarning)
        model = DistributedDataParallel(raw, **keywords) if theirs else replicate(raw, **keywords)
    history = [_buffers(raw)]
    for step in range(2):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * rank + step))
        model(x).pow(2).mean().backward()
        history.append(_buffers(raw))
    return history


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
    #: By buffer case: the buffers after apply and each step, ours then DDP's.
    buffers: dict[str, tuple[list[list[float]], list[list[float]]]]
    #: By static graph change: what raised, ours then DDP's.
    static_changes: dict[str, tuple[Unused, Unused]]


def _job(rank: int, world_size: int) -> Report:
    gaps = {name: _gap(name, rank) for name in CASES}
    mine = replicate(_model(0))
    ours_unused = _until_error(mine, mine, rank)
    raw = _model(0)
    theirs_unused = _until_error(DistributedDataParallel(raw), raw, rank)
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
        {
            name: (_buffer_history(keywords, rank, False), _buffer_history(keywords, rank, True))
            for name, keywords in BUFFER_CASES.items()
        },
        {name: _static_changes(uses, rank) for name, uses in STATIC_CHANGES.items()},
    )


def _static_changes(uses: tuple[bool, ...], rank: int) -> tuple[Unused, Unused]:
    mine = replicate(_model(0), static_graph=True)
    raw = _model(0)
    ddp = DistributedDataParallel(raw, static_graph=True)
    return _until_error(mine, mine, rank, uses), _until_error(ddp, raw, rank, uses)


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


@pytest.mark.parametrize("name", list(BUFFER_CASES))
def test_buffers_after_apply_and_each_step_equal_ddps_with_the_same_buffer_keywords(
    results: list[Report], name: str
) -> None:
    for report in results:
        ours, theirs = report.buffers[name]
        assert len(ours) == len(theirs) == 3
        for moment, (mine, its) in enumerate(zip(ours, theirs, strict=True)):
            assert max(abs(a - b) for a, b in zip(mine, its, strict=True)) <= 1e-6, moment


def test_broadcast_buffers_false_keeps_rank_local_buffers_at_apply(results: list[Report]) -> None:
    """What the comparison above rests on: rank 1's buffers stay its own, or become rank 0's."""
    at_apply = results[1].buffers["broadcast_buffers=False"][0][0]
    assert at_apply[:8] == [1.0] * 8
    if "forward_sync_buffers=False" in BUFFER_CASES:
        # forward_sync_buffers=False still copies rank 0's buffers at apply, as DDP.
        assert results[1].buffers["forward_sync_buffers=False"][0][0][:8] == [0.0] * 8


def test_a_parameter_a_static_graph_used_first_then_not_raises_ddps_error_at_the_next_forward(
    results: list[Report],
) -> None:
    for report in results:
        ours, theirs = report.static_changes["used first, then not"]
        assert ours.moment == theirs.moment == "forward 3"
        assert theirs.error_type == "RuntimeError"
        assert ours.error_type == "UnusedParameterError"
        ddps = theirs.error.split("\n")[0]
        assert ddps.endswith("this is not compatible with static_graph set to True.")
        assert ours.error == (
            f"{ddps} replicate on Net got no gradient for 'side.weight', 'side.bias' in the "
            "last synchronizing backward, which the first one gave one; with static_graph=True "
            "every synchronizing backward uses the parameters the first one used: pass "
            "static_graph=False, and find_unused_parameters=True where some go unused"
        )
        # As DDP's, nothing was averaged in the backward that left them out.
        assert ours.grads == theirs.grads


def test_a_parameter_a_static_graph_left_unused_first_raises_ddps_error_in_the_backward(
    results: list[Report],
) -> None:
    for report in results:
        ours, theirs = report.static_changes["unused first, then used"]
        assert ours.moment == theirs.moment == "backward 2"
        assert theirs.error_type == "RuntimeError"
        assert ours.error_type == "GraphChangedError"
        ddps = theirs.error.split("\n")[0]
        assert ours.error.startswith(ddps)
        assert ours.error.endswith(
            "replicate on Net: parameter 'side.bias' got a gradient in this synchronizing "
            "backward and none in the first; with static_graph=True every synchronizing "
            "backward uses the parameters the first one used: pass static_graph=False, and "
            "find_unused_parameters=True where some go unused"
        )
