"""Application handles: hooks act for the application that installed them, never for a copy's."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable

import attrs
import pytest
import torch
from torch import nn

from torchcontract import Application, NotAppliedError, contract


@attrs.frozen
class CountState:
    calls: int = 0


class CountCalls:
    """A forward pre-hook that counts this application's forwards: the documented pattern.

    A class rather than a closure so that modules holding it pickle.
    """

    def __init__(self, application: Application[CountState]) -> None:
        self.application = application

    def __call__(self, module: nn.Module, args: object) -> None:
        if self.application.record(module) is not None:
            counted.update(module, lambda record: attrs.evolve(record, calls=record.calls + 1))


@contract(CountState)
def counted(module: nn.Module) -> None:
    module.register_forward_pre_hook(CountCalls(counted.application(module)))


class _FailsAfterHooksError(Exception):
    pass


@contract(CountState)
def counted_then_fails(module: nn.Module) -> None:
    handle = counted_then_fails.application(module)
    module.register_forward_pre_hook(lambda m, args: handles.append(handle.record(m)))
    raise _FailsAfterHooksError


handles: list[CountState | None] = []


def test_record_of_its_own_application() -> None:
    module = nn.Linear(2, 2)
    counted(module)
    assert counted.application(module).record(module) == CountState()
    module(torch.zeros(1, 2))
    assert counted.state(module).calls == 1


@pytest.mark.parametrize(
    "duplicate",
    [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))],
    ids=["deepcopy", "pickle"],
)
def test_copied_hooks_stay_inert_after_the_api_is_applied_to_the_copy(
    duplicate: Callable[[nn.Module], nn.Module],
) -> None:
    original = nn.Linear(2, 2)
    counted(original)
    twin = duplicate(original)
    assert len(twin._forward_pre_hooks) == 1  # torch copies the hook along
    counted(twin)
    twin(torch.zeros(1, 2))
    # Two hooks ran on the copy, but only its own application's counted.
    assert counted.state(twin).calls == 1
    assert counted.state(original).calls == 0


def test_shared_closure_hook_does_not_act_for_another_module() -> None:
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    counted(first)
    application = counted.application(first)
    counted(second)
    assert application.record(second) is None
    assert application.record(first) == CountState()


def test_copies_and_pickles_of_a_handle_are_detached() -> None:
    module = nn.Linear(2, 2)
    counted(module)
    application = counted.application(module)
    for duplicate in (copy.copy(application), copy.deepcopy(application)):
        assert duplicate.record(module) is None
        assert "detached" in repr(duplicate)
    restored: Application[CountState] = pickle.loads(pickle.dumps(application))
    assert restored.record(module) is None
    assert "attached" in repr(application)


def test_handle_of_a_rolled_back_application_answers_none() -> None:
    module = nn.Linear(2, 2)
    with pytest.raises(_FailsAfterHooksError):
        counted_then_fails(module)
    handles.clear()
    module(torch.zeros(1, 2))
    assert handles == [None]


def test_handle_answers_none_once_the_api_is_applied_again_after_a_rollback() -> None:
    module = nn.Linear(2, 2)
    with pytest.raises(_FailsAfterHooksError):
        counted_then_fails(module)
    handles.clear()
    counted(module)  # another API; the failed one's hook still sees no record of its own
    module(torch.zeros(1, 2))
    assert handles == [None]


def test_handle_repr_says_whether_it_is_attached() -> None:
    module = nn.Linear(2, 2)
    counted(module)
    handle = counted.application(module)
    assert repr(handle) == "<Application attached>"
    assert repr(copy.copy(handle)) == "<Application detached>"


def test_application_of_an_unapplied_module_raises_not_applied() -> None:
    with pytest.raises(NotAppliedError, match=r"counted is not applied to Linear"):
        counted.application(nn.Linear(2, 2))


def test_handle_keeps_no_module_alive() -> None:
    import gc
    import weakref

    module = nn.Linear(2, 2)
    counted(module)
    application = counted.application(module)
    alive = weakref.ref(module)
    del module
    gc.collect()
    assert alive() is None
    twin = nn.Linear(2, 2)
    assert application.record(twin) is None
