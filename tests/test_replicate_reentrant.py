"""A parameter a reentrant checkpoint runs again, beside DDP, on a gloo group of one rank.

A reentrant checkpoint accumulates its parameters' gradients in a nested backward. A
parameter it runs after its direct use gets its second gradient after its bucket went
out, had the bucket been sent as soon as the direct one came: DDP raises there, and so
does ``replicate`` (``LateGradientError``), rather than average a gradient without it.
Used the other way round, the nested gradient comes first, and both average it.

A backward whose first gradient arrives in the nested backward (the model's output is of
the user's own class, so no output starts it) synchronizes on into the backward around
the checkpoint, to its end: the layers before the checkpoint are averaged too, and a
failure there leaves the backward unfinished, as DDP's.
"""

from __future__ import annotations

from typing import Final

import pytest
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from torchcontract import GraphChangedError, LateGradientError, UnfinishedBackwardError
from torchcontract.apis import replicate

pytestmark = pytest.mark.usefixtures("one_rank_group")

#: Small enough that each parameter has a bucket of its own, sent once its gradient came.
CAP_MB: Final = 1e-5


class Reused(nn.Module):
    """``shared`` runs twice: inside a reentrant checkpoint, and directly."""

    def __init__(self, checkpoint_first: bool) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        self.checkpoint_first = checkpoint_first
        self.once = False  # ``shared`` runs once, directly

    def forward(self, x: Tensor) -> Tensor:
        if self.once:
            h = self.shared(x)
        elif self.checkpoint_first:  # its backward runs last: the direct gradient comes first
            h = self.shared(_checkpointed(self.shared, x))
        else:
            h = _checkpointed(self.shared, self.shared(x))
        out: Tensor = self.head(h)
        return out


def _checkpointed(module: nn.Module, x: Tensor) -> Tensor:
    out = checkpoint(module, x, use_reentrant=True)
    assert isinstance(out, Tensor)
    return out


def _grads(model: nn.Module, raw: Reused) -> list[Tensor]:
    x = torch.ones(2, 4, requires_grad=True)
    model(x).sum().backward()
    return [p.grad.clone() for p in raw.parameters() if p.grad is not None]


def _seeded(checkpoint_first: bool) -> Reused:
    torch.manual_seed(0)
    return Reused(checkpoint_first)


def test_a_gradient_after_its_bucket_went_out_raises_ddps_error() -> None:
    raw = _seeded(checkpoint_first=True)
    model = replicate(raw, bucket_cap_mb=CAP_MB)
    with pytest.raises(LateGradientError) as ours:
        _grads(model, raw)
    theirs_raw = _seeded(checkpoint_first=True)
    with pytest.raises(RuntimeError) as theirs:
        _grads(DistributedDataParallel(theirs_raw, bucket_cap_mb=CAP_MB), theirs_raw)
    sentence = "Expected to mark a variable ready only once."
    assert str(theirs.value).startswith(sentence)
    assert str(ours.value) == (
        f"{sentence} replicate on Reused: parameter 'shared.bias' got a gradient again in "
        "this synchronizing backward, after its bucket was sent (a reentrant checkpoint that "
        "runs it again, or a parameter used outside the forward); pass static_graph=True if "
        "every step uses the same parameters, as DDP advises"
    )


@pytest.mark.parametrize("checkpoint_first", [True, False], ids=["direct first", "nested first"])
def test_with_a_static_graph_or_the_nested_gradient_first_the_averages_are_the_plain_ones(
    checkpoint_first: bool,
) -> None:
    plain = _seeded(checkpoint_first)
    expected = _grads(plain, plain)
    raw = _seeded(checkpoint_first)
    # A static graph counts each parameter's gradients in its first backward and waits.
    model = replicate(raw, bucket_cap_mb=CAP_MB, static_graph=checkpoint_first)
    for _ in range(3):
        raw.zero_grad()
        got = _grads(model, raw)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_a_static_graph_that_runs_a_parameter_more_often_than_at_first_raises_ddps_error() -> None:
    """Its bucket went out after as many gradients as the first backward gave it."""
    errors: list[BaseException] = []
    for theirs in (False, True):
        raw = _seeded(checkpoint_first=True)
        model: nn.Module = (
            DistributedDataParallel(raw, bucket_cap_mb=CAP_MB, static_graph=True)
            if theirs
            else replicate(raw, bucket_cap_mb=CAP_MB, static_graph=True)
        )
        raw.once = True
        _grads(model, raw)
        raw.once = False
        with pytest.raises(RuntimeError) as raised:
            _grads(model, raw)
        errors.append(raised.value)
    ours, theirs_error = errors
    sentence = "Your training graph has changed in this iteration"
    assert str(theirs_error).startswith(sentence)
    assert isinstance(ours, GraphChangedError)
    assert str(ours).startswith(sentence)
    assert (
        "replicate on Reused: parameter 'shared.bias' got more gradients in this "
        "synchronizing backward than the 1 of the first; " in str(ours)
    )


class Boxed:
    """An output of the user's own class: no search for tensors looks inside it."""

    def __init__(self, value: Tensor) -> None:
        self.value = value


class FirstThenCheckpointed(nn.Module):
    """A layer, then a block in a reentrant checkpoint; the output in a ``Boxed``.

    Its first gradient arrives in the checkpoint's nested backward; the layer's, after
    that backward ended, in the one around it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        self.fail_first = False  # raise where the layer's gradient arrives, once

    def forward(self, x: Tensor) -> Boxed:
        h = self.first(x)
        if self.fail_first:
            self.fail_first = False
            h.register_hook(_fail)
        return Boxed(_checkpointed(self.block, h))


def _fail(grad: Tensor) -> Tensor:
    raise ValueError("planned failure")


def _boxed_step(model: nn.Module) -> None:
    out = model(torch.ones(2, 4))
    assert isinstance(out, Boxed)
    torch.autograd.backward(out.value.sum())


def test_a_backward_begun_inside_a_reentrant_checkpoint_synchronizes_to_its_end() -> None:
    """The layer before the checkpoint is in the average: the next steps run, as DDP's.

    (With ``find_unused_parameters``, where DDP raises, ours averages the same: on two
    ranks in ``distributed/test_replicate_training_patterns_gloo.py``.)
    """
    torch.manual_seed(0)
    plain = FirstThenCheckpointed()
    _boxed_step(plain)
    torch.manual_seed(0)
    raw = FirstThenCheckpointed()
    model = replicate(raw, bucket_cap_mb=CAP_MB)
    for _ in range(3):
        raw.zero_grad()
        _boxed_step(model)
        for mine, expected in zip(raw.parameters(), plain.parameters(), strict=True):
            assert mine.grad is not None
            assert expected.grad is not None
            assert torch.equal(mine.grad, expected.grad)


def test_a_backward_that_raises_after_its_checkpoint_sent_gradients_is_unfinished() -> None:
    """As DDP: buckets went out in the nested backward, so the next forward raises."""
    errors: list[BaseException] = []
    for theirs in (False, True):
        torch.manual_seed(0)
        raw = FirstThenCheckpointed()
        model: nn.Module = (
            DistributedDataParallel(raw, bucket_cap_mb=CAP_MB)
            if theirs
            else replicate(raw, bucket_cap_mb=CAP_MB)
        )
        raw.fail_first = True
        with pytest.raises(ValueError, match="planned failure"):
            _boxed_step(model)
        with pytest.raises(RuntimeError) as raised:
            _boxed_step(model)
        errors.append(raised.value)
    ours, theirs_error = errors
    sentence = (
        "Expected to have finished reduction in the prior iteration before starting a new one"
    )
    assert str(theirs_error).startswith(sentence)
    assert isinstance(ours, UnfinishedBackwardError)
    assert str(ours).startswith(sentence)


def test_the_module_run_in_two_reentrant_checkpoints_averages_as_ddps() -> None:
    """Each recompute's backward is one through the outputs: whole, though nested."""
    grads: list[list[Tensor]] = []
    for wrap in (None, replicate, DistributedDataParallel):
        torch.manual_seed(0)
        raw = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        model = raw if wrap is None else wrap(raw)
        for _ in range(2):  # the second step's forward checks the first backward ended
            raw.zero_grad()
            x = torch.ones(2, 4, requires_grad=True)
            h = _checkpointed(model, _checkpointed(model, x))
            torch.autograd.backward(h.sum())
        grads.append([p.grad.clone() for p in raw.parameters() if p.grad is not None])
    plain, ours, theirs = grads
    assert len(plain) == 2
    for expected, mine, ddps in zip(plain, ours, theirs, strict=True):
        assert torch.equal(mine, expected)
        assert torch.equal(ddps, expected)
