"""Models built, given APIs and dropped, two thousand times over: nothing stays behind.

The store and the registry hold modules weakly, so a dropped model's records go
with it: the store ends empty, a weak reference to every model is dead, and the
memory Python traces stays flat after a warm-up, whether the applies succeeded,
shared one record over a list of modules, or failed half-way.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import tracemalloc
import weakref
from collections.abc import Callable

import pytest
import torch
from strategies import Count, Holder, bump
from torch import nn
from torch.distributed._composable.contract import contract as torch_contract
from torch.distributed._composable_state import _State as TorchState

from torchcontract import InvalidRecordError, StateStore, contract, registry
from torchcontract._registry import REGISTRY

ROUNDS = 2_000
WARM_UP = 200
#: Traced bytes the rounds may add. Interpreter caches and free lists move by under
#: 8 KB here, whatever the number of rounds. The smallest leak, one list slot (8
#: bytes) per apply, adds at least 28 KB over the 2 to 4 applies of a round; one
#: leaked object per apply at least 96 KB, one leaked Linear module megabytes.
SLACK = 16 * 1024

STORE = StateStore()


def _count_calls(
    ref: weakref.ref[nn.Module],
) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
    """A forward pre-hook that reaches its module only through ``ref``."""

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        owner = ref()
        if owner is not None:
            counted.update(owner, bump)

    return hook


@contract(Count, store=STORE)
def counted(module: nn.Module) -> None:
    module.register_forward_pre_hook(_count_calls(weakref.ref(module)))


@contract(Count, store=STORE)
def tagged(module: nn.Module, *, tag: str) -> None:
    tagged.update(module, bump)


@contract(Count, store=STORE)
def shared(modules: list[nn.Module]) -> None:
    shared.update(modules[0], bump)


@contract(Count, store=STORE)
def failing(module: nn.Module) -> None:
    failing.set_state(module, Count(3))
    tagged(module.get_submodule("0"), tag="nested")
    counted.update(module, bump)
    raise ValueError("failing always fails")


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))


def _three_apis() -> nn.Module:
    model = _model()
    counted(model)
    tagged(model[0], tag="first")
    shared([model[0], model[2]])
    return model


def _list_apply() -> nn.Module:
    model = _model()
    shared([model[0], model[1], model[2]])
    tagged(model, tag="root")
    return model


def _failed_apply() -> nn.Module:
    model = _model()
    counted(model)
    with contextlib.suppress(ValueError):
        failing(model)
    return model


SCENARIOS = [_three_apis, _list_apply, _failed_apply]


@pytest.fixture(autouse=True)
def empty_store() -> None:
    """Start every test from an empty store, so it can show the store ends empty."""
    gc.collect()
    assert len(STORE) == 0


@pytest.mark.parametrize("build", SCENARIOS, ids=lambda build: build.__name__.strip("_"))
def test_dropped_models_leave_nothing_in_the_store_or_registry(
    build: Callable[[], nn.Module],
) -> None:
    registered = len(REGISTRY)
    models = [weakref.ref(build()) for _ in range(ROUNDS)]
    gc.collect()
    assert [ref for ref in models if ref() is not None] == []
    assert len(STORE) == 0
    assert len(REGISTRY) <= registered


@pytest.mark.parametrize("build", SCENARIOS, ids=lambda build: build.__name__.strip("_"))
def test_traced_memory_does_not_grow_over_two_thousand_models(
    build: Callable[[], nn.Module],
) -> None:
    tracemalloc.start()
    try:
        for _ in range(WARM_UP):
            build()
        gc.collect()
        start, _ = tracemalloc.get_traced_memory()
        for _ in range(ROUNDS):
            build()
        gc.collect()
        end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert end - start < SLACK, f"{end - start} bytes more after {ROUNDS} models"


# A StateStore has slots and no weak reference slot; its table (which nothing but the
# store and the store's contracts hold) is freed exactly when the store is, or leaks
# with it: the tests watch the table.


def test_a_store_nobody_uses_is_freed_without_the_cycle_collector() -> None:
    gc.disable()
    try:
        store = StateStore()
        ref = weakref.ref(store._table)
        del store
        freed = ref() is None
    finally:
        gc.enable()
    assert freed


def test_a_store_is_freed_with_its_apis_once_their_modules_died() -> None:
    store = StateStore()

    @contract(Count, store=store)
    def local(modules: nn.Module | list[nn.Module], *, fail: bool = False) -> None:
        if fail:
            raise ValueError("local failed")

    model = _model()
    local(model)
    local([model[0], model[2]])
    local.update(model, bump)
    with contextlib.suppress(ValueError):
        local(model[1], fail=True)
    table, api = weakref.ref(store._table), weakref.ref(local)
    del store, local, model
    gc.collect()
    assert (table(), api()) == (None, None)


def test_a_dropped_api_leaves_no_column_in_the_default_store_or_the_registry() -> None:
    """Tables that outlive an API (the default store, the registry) forget its columns."""

    @contract(Count)
    def local(module: nn.Module) -> None:
        pass

    model = _model()
    local(model)
    store_table = local.store._table
    REGISTRY.column(local)  # as a rule naming it asks for one
    key = id(local)
    assert [key in table._columns for table in (store_table, REGISTRY)] == [True, True]
    api = weakref.ref(local)
    del local, model
    gc.collect()
    assert api() is None
    tables = (store_table, REGISTRY)
    left = [key in held for table in tables for held in (table._columns, table._column_keys)]
    assert left == [False, False, False, False]


def test_a_dropped_api_leaves_no_column_in_a_store_that_outlives_it() -> None:
    """The same for a store made here: its tables' callbacks are made with it."""
    store = StateStore()

    @contract(Count, store=store)
    def local(module: nn.Module) -> None:
        pass

    model = _model()
    local(model)
    key = id(local)
    assert (key in store._table._columns, key in store._table._column_keys) == (True, True)
    api = weakref.ref(local)
    del local, model  # the model's row holds the API, as its registry entry does
    gc.collect()
    assert api() is None
    assert (key in store._table._columns, key in store._table._column_keys) == (False, False)
    assert len(store) == 0


def test_models_die_without_the_cycle_collector() -> None:
    # The library adds no reference cycle through a module, and a hook that reaches
    # its module through a weak reference adds none either: dropping the last
    # reference frees the model at once.
    alive = []
    gc.disable()
    try:
        for build in SCENARIOS:
            model = build()
            model(torch.zeros(1, 2))
            ref = weakref.ref(model)
            del model
            alive.append(ref() is not None)
        held = len(STORE)
    finally:
        gc.enable()
    assert alive == [False, False, False]
    assert held == 0


def test_hooks_reaching_the_module_by_weak_reference_do_not_keep_it_alive() -> None:
    model = _model()
    counted(model)
    model(torch.zeros(1, 2))
    assert counted.state(model) == Count(1)
    assert len(STORE) == 1
    assert list(registry(model)) == [counted]
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    assert len(STORE) == 0


def _modules_reusing_a_dead_id(apply: Callable[[nn.Module], object]) -> list[nn.Module]:
    """Fresh modules that got the id of a module that ``apply`` was applied to and that died."""
    reusing: list[nn.Module] = []
    for _ in range(200):
        module = nn.Linear(1, 1)
        apply(module)
        dead = id(module)
        del module
        module = nn.Linear(1, 1)
        if id(module) == dead:
            reusing.append(module)
        del module  # the next round's dead module must be able to die
    return reusing


def test_module_reusing_a_dead_modules_id_starts_without_state() -> None:
    reusing = _modules_reusing_a_dead_id(lambda module: tagged(module, tag="old"))
    assert reusing  # CPython hands the freed memory straight back
    for module in reusing:
        assert not tagged.is_applied(module)
        assert tagged.get_state(module) is None
        assert list(registry(module)) == []
        assert dict(STORE.records(module)) == {}


def test_module_reusing_a_dead_modules_id_starts_without_state_in_a_store_made_later() -> None:
    # The stores above are made at import; this one is made here, after the library's
    # own set-up, so what a new store does when a module dies is tested too.
    store = StateStore()

    @contract(Count, store=store)
    def late(module: nn.Module) -> None:
        pass

    reusing = _modules_reusing_a_dead_id(late)
    assert reusing
    for module in reusing:
        assert not late.is_applied(module)
        assert late.get_state(module) is None
    assert len(store) == 0


@contract(Holder, store=STORE)
def saving(module: nn.Module) -> None:
    pass


class TorchSaved(TorchState):
    saved: object = None


@torch_contract(TorchSaved)
def torch_saving(module: nn.Module) -> nn.Module:
    return module


def _referring(module: nn.Module) -> list[object]:
    """Values that keep ``module`` alive: a bound method, a closure, a partial."""
    return [module.forward, lambda x: module(x) + 1, functools.partial(module)]


@pytest.mark.parametrize("index", range(3), ids=["bound-method", "closure", "partial"])
def test_record_reaching_its_module_through_a_callable_is_refused_so_the_module_can_die(
    index: int,
) -> None:
    # torch's contract keeps its state in the module's __dict__: such a value makes a
    # cycle, which the collector frees. Ours would be a strong reference from a
    # process-wide store: refused, and the module is freed as torch's is.
    model = _model()
    saving(model)
    with pytest.raises(InvalidRecordError, match="through a bound method, a closure"):
        saving.set_state(model, Holder(_referring(model)[index]))
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    assert len(STORE) == 0

    torch_model = _model()
    state = torch_saving.state(torch_saving(torch_model))
    state.saved = _referring(torch_model)[index]
    torch_ref = weakref.ref(torch_model)
    del torch_model, state
    gc.collect()
    assert torch_ref() is None


def _containing(module: nn.Module) -> list[object]:
    """Containers that keep ``module`` alive: a set, a frozenset, a dict key, a tuple."""
    return [{module}, frozenset([module]), {module: None}, (module,)]


@pytest.mark.parametrize("index", range(4), ids=["set", "frozenset", "dict-key", "tuple"])
def test_record_holding_its_module_in_a_container_is_refused_so_the_module_can_die(
    index: int,
) -> None:
    model = _model()
    saving(model)
    with pytest.raises(InvalidRecordError, match=r"holds an nn\.Module"):
        saving.set_state(model, Holder(_containing(model)[index]))
    assert saving.state(model) == Holder()
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    assert len(STORE) == 0


def test_record_holding_a_weak_proxy_of_its_module_is_kept_and_does_not_keep_it_alive() -> None:
    model = _model()
    saving(model)
    saving.set_state(model, Holder(weakref.proxy(model)))
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    assert len(STORE) == 0
