"""on_rollback: undo steps for what an API does outside the store."""

from __future__ import annotations

import pytest
from torch import nn

from torchcontract import contract, on_rollback


class RefusedError(Exception):
    pass


undone: list[str] = []


@contract()
def tagging(module: nn.Module, *, fail: bool = False) -> None:
    module.tag = "set"  # type: ignore[assignment]  # a side effect outside the store
    on_rollback(lambda: undone.append("first"))
    on_rollback(lambda: delattr(module, "tag"))
    if fail:
        raise RefusedError


@contract()
def outer(module: nn.Sequential) -> None:
    tagging(module[0])
    raise RefusedError


def setup_function() -> None:
    undone.clear()


def test_undo_steps_run_in_reverse_when_the_apply_fails() -> None:
    module = nn.Linear(2, 2)
    with pytest.raises(RefusedError):
        tagging(module, fail=True)
    assert not hasattr(module, "tag")
    assert undone == ["first"]
    assert not tagging.is_applied(module)


def test_undo_steps_do_not_run_when_the_apply_succeeds() -> None:
    module = nn.Linear(2, 2)
    tagging(module)
    assert module.tag == "set"
    assert undone == []


def test_a_nested_apply_is_undone_when_the_apply_around_it_fails() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(RefusedError):
        outer(model)
    assert not hasattr(model[0], "tag")
    assert undone == ["first"]
    assert not tagging.is_applied(model[0])


def test_outside_an_apply_an_undo_step_is_dropped() -> None:
    on_rollback(lambda: undone.append("never"))
    assert undone == []
