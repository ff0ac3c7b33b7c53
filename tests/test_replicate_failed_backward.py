"""A synchronizing backward that raises: what the next steps do, beside DDP on one rank.

Once gradients began to arrive, a bucket may have gone out on one rank and not on
another, so DDP refuses every later forward with grad enabled; so does ``replicate``,
with ``UnfinishedBackwardError`` and DDP's first sentence. A backward that raised before
any gradient arrived, or a static graph's first (which sends nothing before its end),
leaves no trace on either, and the next steps' gradients are DDP's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from torchcontract import UnfinishedBackwardError
from torchcontract.apis import _torch, replicate
from torchcontract.apis.replicate import ReplicateModule

pytestmark = pytest.mark.usefixtures("one_rank_group")

#: DDP's first sentence, which both errors start with.
UNFINISHED: Final = (
    "Expected to have finished reduction in the prior iteration before starting a new one"
)
#: Where the planned failure is: the output of that layer of four, whose gradient comes
#: after the gradients of the layers above it (midway) or before any (the last layer's,
#: below a last ``Tanh``: the backward has begun synchronizing when it fails).
FAILS_AT: Final = {"midway": 1, "before any gradient": 3}
KEYWORDS: Final[dict[str, dict[str, Any]]] = {
    "by default": {},
    "find_unused_parameters": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
}

Wrap = Callable[..., nn.Module]
WRAPS: Final[dict[str, Wrap]] = {"replicate": replicate, "DDP": DistributedDataParallel}


def _layers() -> nn.Sequential:
    torch.manual_seed(0)
    # A tiny cap: one bucket per parameter, so buckets go out while backward runs.
    return nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)), nn.Tanh())


def _fail_once_at(layers: nn.Sequential, position: int) -> None:
    """Make the next backward raise where the gradient of ``layers[position]``'s output arrives."""
    armed = [True]

    def fail(grad: Tensor) -> Tensor:
        if armed[0]:
            armed[0] = False
            raise ValueError("planned failure")
        return grad

    def arm(module: nn.Module, args: object, output: Tensor) -> None:
        if output.requires_grad and armed[0]:
            _torch.register_tensor_hook(output, fail)

    layers[position].register_forward_hook(arm)


def _step(model: nn.Module, seed: int) -> None:
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).sum().backward()


def _outcomes(wrap: Wrap, keywords: dict[str, Any], fails_at: int, warm: bool) -> list[object]:
    """The failing step's own outcome, then each of two more: an error's class and first
    sentence, or the gradients the step left."""
    layers = _layers()
    model = wrap(layers, bucket_cap_mb=0.0001, **keywords)
    if warm:
        _step(model, 0)
    _fail_once_at(layers, fails_at)
    with pytest.raises(ValueError, match="planned failure"):
        _step(model, 1)
    outcomes: list[object] = []
    for seed in (2, 3):
        layers.zero_grad()
        try:
            _step(model, seed)
        except RuntimeError as error:
            outcomes.append((type(error).__name__, str(error).split(". ")[0]))
        else:
            outcomes.append([parameter.grad for parameter in layers.parameters()])
    return outcomes


def _as_ddp_names_it(outcome: object) -> object:
    """Our outcome with our error's class named as DDP's, to compare the rest."""
    if isinstance(outcome, tuple) and outcome[0] == UnfinishedBackwardError.__name__:
        return ("RuntimeError", outcome[1])
    return outcome


def _same(mine: object, theirs: object) -> bool:
    if isinstance(mine, list) and isinstance(theirs, list):
        return len(mine) == len(theirs) and all(map(torch.equal, mine, theirs))
    return mine == theirs


@pytest.mark.parametrize("warm", [False, True], ids=["first backward", "after a step"])
@pytest.mark.parametrize("where", list(FAILS_AT))
@pytest.mark.parametrize("keywords", list(KEYWORDS))
def test_the_steps_after_a_failed_backward_are_ddps(keywords: str, where: str, warm: bool) -> None:
    mine, theirs = (
        _outcomes(WRAPS[name], KEYWORDS[keywords], FAILS_AT[where], warm) for name in WRAPS
    )
    assert all(map(_same, map(_as_ddp_names_it, mine), theirs)), (mine, theirs)
    # Which cases raise, spelled out: a bucket may have been sent before the failure.
    static_first = keywords == "static_graph" and not warm
    raises = where == "midway" and not static_first
    expected = ("UnfinishedBackwardError", UNFINISHED)
    assert [outcome == expected for outcome in mine] == [raises, raises]


def test_the_error_says_what_happened_and_what_to_do() -> None:
    layers = _layers()
    model = replicate(layers, bucket_cap_mb=0.0001)
    _fail_once_at(layers, FAILS_AT["midway"])
    with pytest.raises(ValueError, match="planned failure"):
        _step(model, 1)
    with pytest.raises(UnfinishedBackwardError) as raised:
        _step(model, 2)
    assert str(raised.value) == (
        f"{UNFINISHED}. replicate on Sequential: the last synchronizing backward raised after "
        "gradients had begun to arrive; its buckets may have been sent on some ranks and not on "
        "others, so this rank's collectives may no longer pair with theirs, and no gradient of "
        "that backward was averaged. As with DDP, the module cannot train on: resume from a "
        "checkpoint in a new process; to skip a batch, decide on every rank before its backward"
    )


@pytest.mark.parametrize("name", list(WRAPS))
def test_a_forward_without_grad_still_runs_as_ddps(name: str) -> None:
    layers = _layers()
    model = WRAPS[name](layers, bucket_cap_mb=0.0001)
    _fail_once_at(layers, FAILS_AT["midway"])
    with pytest.raises(ValueError, match="planned failure"):
        _step(model, 1)
    with torch.no_grad():
        assert model(torch.ones(1, 8)).shape == (1, 8)


@pytest.mark.parametrize("name", list(WRAPS))
def test_a_backward_of_an_earlier_forward_after_one_that_failed_midway_raises(name: str) -> None:
    """Two forwards, then their backwards: the second's cannot pair with the other ranks'."""
    layers = _layers()
    model = WRAPS[name](layers, bucket_cap_mb=0.0001)
    first, second = (model(torch.randn(2, 8)).sum() for _ in range(2))
    _fail_once_at(layers, FAILS_AT["midway"])  # arms the next forward's outputs: a third
    third = model(torch.randn(2, 8)).sum()
    with pytest.raises(ValueError, match="planned failure"):
        third.backward()
    with pytest.raises(UnfinishedBackwardError if name == "replicate" else RuntimeError):
        first.backward()
    del second


class _Shifted(nn.Module):
    """A layer, and a shift added last: the shift's gradient needs no saved tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.shift = nn.Parameter(torch.zeros(8))

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = torch.tanh(self.layer(x)) + self.shift
        return out


def test_a_checkpoint_recomputing_the_module_inside_its_own_backward_is_no_failure() -> None:
    """A non-reentrant checkpoint reruns the forward inside the synchronizing backward,
    after the shift got its gradient: that backward is still running, and the gradients
    are a plain module's (one rank). DDP raises its error there (a difference)."""
    torch.manual_seed(0)
    plain = _Shifted()
    torch.manual_seed(0)
    shifted = _Shifted()
    model = replicate(shifted)
    for seed in range(2):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(seed))
        out = checkpoint(model, x, use_reentrant=False)
        assert isinstance(out, Tensor)
        torch.autograd.backward(out.pow(2).sum())
        torch.autograd.backward(plain(x).pow(2).sum())
    for mine, expected in zip(shifted.parameters(), plain.parameters(), strict=True):
        assert mine.grad is not None
        assert expected.grad is not None
        assert torch.equal(mine.grad, expected.grad)
    out = checkpoint(DistributedDataParallel(_Shifted()), torch.randn(2, 8), use_reentrant=False)
    assert isinstance(out, Tensor)
    with pytest.raises(RuntimeError, match=UNFINISHED):
        torch.autograd.backward(out.pow(2).sum())


def test_a_comm_hook_registered_after_a_failed_backward_is_taken_as_ddp_takes_it() -> None:
    """After one that raised before any gradient the module trains on with the hook; after
    one that raised midway the hook is taken, and the next forward still raises."""
    for where, trains in (("before any gradient", True), ("midway", False)):
        layers = _layers()
        model = replicate(layers, bucket_cap_mb=0.0001)
        _fail_once_at(layers, FAILS_AT[where])
        with pytest.raises(ValueError, match="planned failure"):
            _step(model, 1)
        assert isinstance(model, ReplicateModule)
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        if trains:
            _step(model, 2)
            assert replicate.state(model).step == 1
        else:
            with pytest.raises(UnfinishedBackwardError):
                _step(model, 2)
