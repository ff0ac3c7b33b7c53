"""checkpoint: same numerics as the unchecked model, fewer saved activations, no leaks."""

from __future__ import annotations

import copy
import pickle
import weakref
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.distributed._composable.checkpoint_activation import checkpoint as torch_checkpoint

from torchcontract import (
    InvalidTargetError,
    contract,
    describe,
    registry,
    take_snapshot,
    torch_registry,
)
from torchcontract.apis import CheckpointState, checkpoint
from torchcontract.testing._compare import gc_disabled as _gc_disabled

WIDTH = 32


class Block(nn.Module):
    """Linear, ReLU, dropout, Linear: a residual MLP block that saves several activations."""

    def __init__(self, dropout: float = 0.25) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(dropout)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = x + self.down(self.drop(self.act(self.up(x))))
        return out


def deep_mlp(depth: int = 8, dropout: float = 0.25) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(dropout) for _ in range(depth)))


def _block(model: nn.Sequential, index: int) -> Block:
    block = model[index]
    assert isinstance(block, Block)
    return block


def _inputs(requires_grad: bool = True) -> Tensor:
    return torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(1)).requires_grad_(
        requires_grad
    )


def _run(model: nn.Module, x: Tensor, seed: int = 7) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """Forward and backward under ``seed``; the output, parameter gradients, input gradient."""
    x = x.detach().clone().requires_grad_(x.requires_grad)
    torch.manual_seed(seed)
    out = model(x)
    out.pow(2).mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    x_grad = x.grad.clone() if x.grad is not None else torch.zeros(0)
    return out.detach(), grads, x_grad


def _assert_same_run(
    mine: tuple[Tensor, dict[str, Tensor], Tensor], theirs: tuple[Tensor, dict[str, Tensor], Tensor]
) -> None:
    torch.testing.assert_close(mine[0], theirs[0], rtol=0, atol=1e-6)
    assert mine[1].keys() == theirs[1].keys()
    for name in mine[1]:
        torch.testing.assert_close(mine[1][name], theirs[1][name], rtol=0, atol=1e-6)
    torch.testing.assert_close(mine[2], theirs[2], rtol=0, atol=1e-6)


@attrs.frozen
class Saved:
    count: int
    bytes: int


def _saved_by_forward(model: nn.Module, x: Tensor) -> Saved:
    """What autograd saves for backward during one forward, seen through saved_tensors_hooks."""
    sizes: list[int] = []

    def pack(tensor: Tensor) -> Tensor:
        sizes.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(x)
    out.sum().backward()
    return Saved(len(sizes), sum(sizes))


REENTRANT = pytest.mark.parametrize(
    "use_reentrant", [False, True], ids=["nonreentrant", "reentrant"]
)


# ----------------------------------------------------------------- numerics


@REENTRANT
def test_gradients_equal_unchecked_model_with_dropout(use_reentrant: bool) -> None:
    model, reference = deep_mlp(), deep_mlp()
    for block in model:
        checkpoint(block, use_reentrant=use_reentrant)
    _assert_same_run(_run(model, _inputs()), _run(reference, _inputs()))


@REENTRANT
def test_without_preserved_rng_state_recomputed_dropout_differs(use_reentrant: bool) -> None:
    model, reference = deep_mlp(), deep_mlp()
    for block in model:
        checkpoint(block, use_reentrant=use_reentrant, preserve_rng_state=False)
    _, mine, _ = _run(model, _inputs())
    _, theirs, _ = _run(reference, _inputs())
    assert any(not torch.equal(mine[name], theirs[name]) for name in mine)


@REENTRANT
def test_checkpoint_on_the_whole_model_matches_unchecked(use_reentrant: bool) -> None:
    model, reference = deep_mlp(depth=3), deep_mlp(depth=3)
    checkpoint(model, use_reentrant=use_reentrant)
    _assert_same_run(_run(model, _inputs()), _run(reference, _inputs()))


@settings(max_examples=12)
@given(
    chosen=st.lists(st.booleans(), min_size=4, max_size=4),
    dropout=st.sampled_from([0.0, 0.5]),
    use_reentrant=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_choice_of_checkpointed_blocks_keeps_gradients(
    chosen: list[bool], dropout: float, use_reentrant: bool, seed: int
) -> None:
    model, reference = deep_mlp(depth=4, dropout=dropout), deep_mlp(depth=4, dropout=dropout)
    for block, on in zip(model, chosen, strict=True):
        if on:
            checkpoint(block, use_reentrant=use_reentrant)
    _assert_same_run(_run(model, _inputs(), seed), _run(reference, _inputs(), seed))


@REENTRANT
def test_nested_checkpoints_keep_gradients(use_reentrant: bool) -> None:
    model, reference = deep_mlp(depth=3), deep_mlp(depth=3)
    checkpoint(model, use_reentrant=use_reentrant)
    checkpoint(model[1], use_reentrant=use_reentrant)
    checkpoint(_block(model, 1).up, use_reentrant=use_reentrant)
    _assert_same_run(_run(model, _inputs()), _run(reference, _inputs()))


class Twice(nn.Module):
    """Runs the same block twice: one checkpointed module, two regions per forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = Block()

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.block(self.block(x))
        return out


@REENTRANT
def test_module_called_twice_per_forward_keeps_gradients(use_reentrant: bool) -> None:
    model, reference = Twice(), Twice()
    checkpoint(model.block, use_reentrant=use_reentrant)
    _assert_same_run(_run(model, _inputs()), _run(reference, _inputs()))


class Scaled(nn.Module):
    """Takes a keyword tensor and returns a tuple with an integer tensor in it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor, *, scale: Tensor) -> tuple[Tensor, Tensor]:
        y = torch.tanh(self.linear(x)) * scale
        return y, y.argmax(dim=1)


@REENTRANT
def test_keyword_inputs_and_tuple_outputs_keep_gradients(use_reentrant: bool) -> None:
    model, reference = Scaled(), Scaled()
    checkpoint(model, use_reentrant=use_reentrant)
    results = []
    for module in (model, reference):
        scale = torch.full((WIDTH,), 2.0, requires_grad=True)
        y, index = module(_inputs(), scale=scale)
        y.pow(2).sum().backward()
        assert scale.grad is not None
        results.append((y.detach(), index, module.linear.weight.grad, scale.grad))
    for mine, theirs in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)


# ----------------------------------------------------------------- memory


@REENTRANT
def test_checkpointing_every_block_cuts_saved_activations(use_reentrant: bool) -> None:
    model, reference = deep_mlp(), deep_mlp()
    for block in model:
        checkpoint(block, use_reentrant=use_reentrant)
    unchecked = _saved_by_forward(reference, _inputs())
    checked = _saved_by_forward(model, _inputs())
    # Unchecked: every block saves its input, both Linear inputs, the ReLU output and the
    # dropout mask. Checked: only what torch's machinery keeps of each region's input
    # (one tensor per block on current torch, two views of it on torch 2.6).
    assert unchecked.count >= 5 * len(model)
    assert checked.count <= 2 * len(model)
    assert checked.bytes * 4 <= unchecked.bytes
    if not use_reentrant:  # exactly what torch's own composable checkpoint keeps
        theirs = deep_mlp()
        for block in theirs:
            torch_checkpoint(block)
        assert checked == _saved_by_forward(theirs, _inputs())


def test_disabled_record_stops_checkpointing() -> None:
    model, reference = deep_mlp(), deep_mlp()
    for block in model:
        checkpoint(block)
        checkpoint.update(block, lambda record: attrs.evolve(record, enabled=False))
    assert _saved_by_forward(model, _inputs()) == _saved_by_forward(reference, _inputs())


def test_reenabled_record_checkpoints_again() -> None:
    model, reference = deep_mlp(), deep_mlp()
    for block in model:
        checkpoint(block)
        checkpoint.update(block, lambda record: attrs.evolve(record, enabled=False))
        checkpoint.update(block, lambda record: attrs.evolve(record, enabled=True))
    assert (
        _saved_by_forward(model, _inputs()).bytes * 4
        <= _saved_by_forward(reference, _inputs()).bytes
    )


# ----------------------------------------------------------------- contract


@REENTRANT
def test_record_holds_the_apply_arguments(use_reentrant: bool) -> None:
    block = Block()
    checkpoint(block, use_reentrant=use_reentrant, preserve_rng_state=False)
    assert checkpoint.state(block) == CheckpointState(
        use_reentrant=use_reentrant, preserve_rng_state=False, enabled=True
    )


def test_registry_entry_records_use_reentrant_for_rules() -> None:
    block = Block()
    checkpoint(block, use_reentrant=True)
    assert registry(block)[checkpoint].arguments == {
        "use_reentrant": True,
        "preserve_rng_state": True,
    }


@REENTRANT
def test_fqns_and_module_tree_are_unchanged(use_reentrant: bool) -> None:
    model = deep_mlp(depth=2)
    before = take_snapshot(model)
    keys = list(model.state_dict())
    checkpoint(model[0], use_reentrant=use_reentrant)
    after = take_snapshot(model)
    assert (after.parameters, after.buffers, after.module_fqns) == (
        before.parameters,
        before.buffers,
        before.module_fqns,
    )
    assert list(model.state_dict()) == keys
    assert "forward" not in vars(model[0])


def test_list_of_modules_is_rejected_with_advice() -> None:
    model = deep_mlp(depth=2)
    targets: Any = [model[0], model[1]]
    with pytest.raises(InvalidTargetError, match=r"one nn\.Module at a time"):
        checkpoint(targets)
    assert not checkpoint.is_applied(model[0])


@pytest.mark.parametrize(
    ("keyword", "value", "shown"),
    [
        ("use_reentrant", "False", "str 'False'"),
        ("use_reentrant", None, "NoneType None"),
        ("preserve_rng_state", 1, "int 1"),
    ],
)
def test_option_that_is_not_a_bool_is_a_type_error_naming_it(
    keyword: str, value: object, shown: str
) -> None:
    # As torch's composable checkpoint, which refuses anything but a real choice: the
    # string "False" is truthy and would have meant reentrant.
    model = nn.Linear(2, 2)
    options: dict[str, Any] = {keyword: value}
    with pytest.raises(TypeError) as raised:
        checkpoint(model, **options)
    assert str(raised.value) == f"checkpoint on Linear: {keyword} takes True or False, got {shown}"
    assert not checkpoint.is_applied(model)
    assert not model._forward_hooks


@REENTRANT
def test_model_is_freed_by_reference_counting_after_training(use_reentrant: bool) -> None:
    model = deep_mlp(depth=2)
    for block in model:
        checkpoint(block, use_reentrant=use_reentrant)
    _run(model, _inputs())
    alive = weakref.ref(model)
    with _gc_disabled():
        del model
        assert alive() is None


@REENTRANT
def test_failed_forward_leaves_the_module_usable(use_reentrant: bool) -> None:
    model, reference = deep_mlp(depth=2), deep_mlp(depth=2)
    checkpoint(model[1], use_reentrant=use_reentrant)
    handle = _block(model, 1).up.register_forward_hook(_raise)
    with pytest.raises(ValueError, match="planned failure"):
        model(_inputs())
    handle.remove()
    assert torch.is_grad_enabled()
    _assert_same_run(_run(model, _inputs()), _run(reference, _inputs()))


def _raise(module: nn.Module, args: object, output: object) -> None:
    raise ValueError("planned failure")


@REENTRANT
def test_forward_without_grad_is_not_checkpointed(use_reentrant: bool) -> None:
    model, reference = deep_mlp(), deep_mlp()
    model.eval()
    reference.eval()
    for block in model:
        checkpoint(block, use_reentrant=use_reentrant)
    with torch.no_grad():
        torch.testing.assert_close(model(_inputs()), reference(_inputs()), rtol=0, atol=0)
    assert torch.is_grad_enabled()


def test_reentrant_forward_without_grad_inputs_warns_and_keeps_gradients() -> None:
    model, reference = deep_mlp(depth=2), deep_mlp(depth=2)
    checkpoint(model[0], use_reentrant=True)
    with pytest.warns(UserWarning, match="no input requires grad"):
        mine = _run(model, _inputs(requires_grad=False))
    _assert_same_run(mine, _run(reference, _inputs(requires_grad=False)))


def test_reentrant_refuses_autograd_grad_with_advice() -> None:
    model = deep_mlp(depth=2)
    checkpoint(model[0], use_reentrant=True)
    x = _inputs()
    out = model(x).sum()
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        torch.autograd.grad(out, x)


def test_nonreentrant_supports_autograd_grad() -> None:
    model, reference = deep_mlp(depth=2), deep_mlp(depth=2)
    checkpoint(model[0])
    grads = []
    for module in (model, reference):
        x = _inputs()
        torch.manual_seed(3)
        (grad,) = torch.autograd.grad(module(x).pow(2).sum(), x)
        grads.append(grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-6)


@contract()
def checkpoint_then_fail(module: nn.Module) -> None:
    checkpoint(module)
    raise ValueError("planned failure after checkpoint installed its hooks")


def test_hooks_left_by_a_rolled_back_apply_do_nothing() -> None:
    model, reference = deep_mlp(depth=2), deep_mlp(depth=2)
    # The outer apply fails after checkpoint ran: the contract removes checkpoint's
    # record, not its hooks, so the hooks must find no record and stand aside.
    with pytest.raises(ValueError, match="planned failure"):
        checkpoint_then_fail(model[0])
    assert not checkpoint.is_applied(model[0])
    assert len(model[0]._forward_pre_hooks) == 1
    assert _saved_by_forward(model, _inputs()) == _saved_by_forward(reference, _inputs())


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_carry_no_record_and_train_like_the_original(how: str) -> None:
    model, reference = deep_mlp(depth=2), deep_mlp(depth=2)
    checkpoint(model[0])
    copied = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    assert not checkpoint.is_applied(copied[0])
    _assert_same_run(_run(copied, _inputs()), _run(reference, _inputs()))


def test_original_keeps_checkpointing_after_being_copied() -> None:
    model, reference = deep_mlp(), deep_mlp()
    for block in model:
        checkpoint(block)
    copy.deepcopy(model)
    checked = _saved_by_forward(model, _inputs())
    assert checked.bytes * 4 <= _saved_by_forward(reference, _inputs()).bytes


@REENTRANT
@pytest.mark.timeout(60)
def test_checkpoint_applied_to_a_deepcopy_of_a_checkpointed_block_trains_correctly(
    use_reentrant: bool,
) -> None:
    # Deep-copying a prototype block and applying APIs to each copy is a common way to
    # build a model. The copy inherits the prototype's hooks; once it gets a record of
    # its own they must stay inert, or two regions open per forward (a nested
    # recomputation that never ends with use_reentrant=True).
    prototype = deep_mlp(depth=1)[0]
    checkpoint(prototype, use_reentrant=use_reentrant)
    model = nn.Sequential(*(copy.deepcopy(prototype) for _ in range(3)))
    reference = nn.Sequential(*(copy.deepcopy(prototype) for _ in range(3)))
    for block in model:
        assert len(block._forward_pre_hooks) == 1  # the prototype's, inherited
        checkpoint(block, use_reentrant=use_reentrant)
    _assert_same_run(_run(model, _inputs()), _run(reference, _inputs()))
    checked = _saved_by_forward(model, _inputs())
    assert checked.count < _saved_by_forward(reference, _inputs()).count


# ----------------------------------------------------------------- beside torch's API


def test_beside_torch_checkpoint_both_registries_stay_right() -> None:
    model = deep_mlp(depth=3)
    torch_checkpoint(model[0])
    checkpoint(model[1])
    assert list(torch_registry(model[0])) == ["checkpoint"]
    assert dict(registry(model[0])) == {}
    assert list(registry(model[1])) == [checkpoint]
    assert dict(torch_registry(model[1])) == {}
    assert dict(registry(model[2])) == {}
    assert dict(torch_registry(model[2])) == {}


def test_beside_torch_checkpoint_training_matches_unchecked() -> None:
    model, reference = deep_mlp(depth=3), deep_mlp(depth=3)
    torch_checkpoint(model[0])
    checkpoint(model[1])
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (model, reference)]
    for step in range(3):
        runs = [_run(m, _inputs(), seed=step) for m in (model, reference)]
        _assert_same_run(runs[0], runs[1])
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def test_describe_shows_torch_and_our_checkpoint() -> None:
    model = deep_mlp(depth=3)
    torch_checkpoint(model[0])
    checkpoint(model[1])
    text = describe(model)
    assert "0: Block  [checkpoint (torch)]" in text
    assert "1: Block  [checkpoint]" in text
