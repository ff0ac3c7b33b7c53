"""Every bad argument ends in a clear error of the documented type, with the store untouched."""

from __future__ import annotations

import dataclasses
import functools
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import attr
import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import Count, Holder, Mixed, bump, contents, examples, module_trees, non_modules
from torch import nn
from torch.distributed._composable.contract import contract as torch_contract

from torchcontract import (
    FQNChangedError,
    InvalidRecordError,
    InvalidResultError,
    InvalidStateClassError,
    InvalidTargetError,
    NotAppliedError,
    StateStore,
    contract,
    registry,
)

STORE = StateStore()


@contract(Count, store=STORE)
def marked(module: nn.Module | Sequence[nn.Module]) -> None:
    pass


#: ``marked`` without its signature, to make the calls a type checker would refuse.
untyped: Callable[..., object] = marked


@contract(Holder, store=STORE)
def holding(module: nn.Module) -> None:
    pass


# ----------------------------------------------------------------- targets


@given(non_modules())
def test_non_module_first_argument_is_an_invalid_target(value: object) -> None:
    with pytest.raises(
        InvalidTargetError, match=r"expected an nn\.Module or a non-empty list"
    ) as e:
        untyped(value)
    assert type(value).__qualname__ in str(e.value)
    assert "test_bad_input.marked" in str(e.value)
    assert isinstance(e.value, TypeError)
    assert isinstance(e.value, ValueError)
    assert len(STORE) == 0


def test_missing_module_argument_is_an_invalid_target() -> None:
    with pytest.raises(InvalidTargetError, match=r"pass the module .* first positional argument"):
        untyped()
    assert len(STORE) == 0


def test_module_passed_by_keyword_is_an_invalid_target() -> None:
    module = nn.Linear(1, 1)
    with pytest.raises(InvalidTargetError, match="first positional argument"):
        untyped(module=module)
    assert not marked.is_applied(module)


@pytest.mark.parametrize("empty", [[], ()], ids=["list", "tuple"])
def test_empty_module_list_is_an_invalid_target(empty: Sequence[nn.Module]) -> None:
    with pytest.raises(InvalidTargetError, match="empty list of modules; pass at least one"):
        marked(empty)
    assert len(STORE) == 0


@given(st.lists(st.integers(0, 3), min_size=2, max_size=6).filter(lambda i: len(set(i)) < len(i)))
def test_module_twice_in_a_list_is_an_invalid_target(picks: list[int]) -> None:
    pool = [nn.Linear(1, 1) for _ in range(4)]
    with pytest.raises(InvalidTargetError, match="Linear appears twice in the module list"):
        marked([pool[i] for i in picks])
    assert len(STORE) == 0


def test_non_module_item_in_a_list_is_an_invalid_target() -> None:
    module = nn.Linear(1, 1)
    with pytest.raises(InvalidTargetError, match=r"every item .* must be an nn\.Module, got int"):
        untyped([module, 3])
    assert not marked.is_applied(module)


@settings(max_examples=examples(40), deadline=None)
@given(module_trees(), st.data())
def test_list_with_nested_modules_applies_to_the_ancestors_only(
    tree: nn.Module, data: st.DataObject
) -> None:
    # Documented: of a module and its descendant in one list, the ancestor is the
    # root; it holds the record, shared with the other roots; the descendant gets
    # no record and no registry entry.
    modules = list(tree.modules())
    picked = data.draw(st.lists(st.sampled_from(modules), min_size=1, unique_by=id))
    inside = {id(sub) for module in picked for sub in module.modules() if sub is not module}
    roots = [module for module in picked if id(module) not in inside]
    marked(picked)
    for module in modules:
        assert marked.is_applied(module) == any(module is root for root in roots)
        assert list(registry(module)) == ([marked] if marked.is_applied(module) else [])
    assert len({id(marked.state(root)) for root in roots}) == 1


# ----------------------------------------------------------------- state classes


class Plain:
    n: int = 0


@dataclasses.dataclass(frozen=True)
class FrozenDataclass:
    n: int = 0


@attrs.define
class Mutable:
    n: int = 0


@attrs.define(slots=False)
class MutableDict:
    n: int = 0


@attr.s
class OldStyle:
    n: int = attr.ib(default=0)


@attrs.frozen
class NoDefault:
    n: int
    m: int = 0


@pytest.mark.parametrize(
    ("state_cls", "words"),
    [
        (Plain, "Plain): the state class must be an attrs class; decorate it with @attrs.frozen"),
        (FrozenDataclass, "FrozenDataclass): the state class must be an attrs class"),
        (Count(), "must be an attrs class"),
        (None, "must be an attrs class"),
        (Mutable, "Mutable): the state class must be frozen; use @attrs.frozen"),
        (MutableDict, "MutableDict): the state class must be frozen"),
        (OldStyle, "OldStyle): the state class must be frozen"),
        (
            NoDefault,
            "NoDefault): fields ['n'] have no default; every field needs one, "
            "since apply installs the default record",
        ),
    ],
    ids=["plain", "dataclass", "instance", "none", "define", "define-dict", "attr.s", "no-default"],
)
def test_bad_state_class_is_refused_at_decoration(state_cls: object, words: str) -> None:
    make: Callable[..., object] = contract
    with pytest.raises(InvalidStateClassError, match=re.escape(words)) as caught:
        make(state_cls)
    assert isinstance(caught.value, TypeError)


# ----------------------------------------------------------------- records


@attrs.frozen
class Pair:
    a: int = 0
    b: int = 0


@contract(Count, store=STORE)
def counted(module: nn.Module) -> None:
    pass


def _applied() -> nn.Linear:
    module = nn.Linear(1, 1)
    counted(module)
    counted.update(module, bump)
    return module


@pytest.mark.parametrize(
    "record", [Pair(), None, 1, {"n": 1}], ids=["other", "none", "int", "dict"]
)
def test_set_state_with_a_wrong_type_is_refused_and_keeps_the_record(record: object) -> None:
    module = _applied()
    old = counted.state(module)
    set_state: Callable[..., None] = counted.set_state
    with pytest.raises(
        InvalidRecordError, match="set_state: expected a record of class Count, got"
    ):
        set_state(module, record)
    assert counted.state(module) is old


@pytest.mark.parametrize("result", [None, Pair(), 2], ids=["none", "other", "int"])
def test_update_returning_a_wrong_type_is_refused_and_keeps_the_record(result: object) -> None:
    module = _applied()
    old = counted.state(module)
    update: Callable[..., object] = counted.update
    with pytest.raises(InvalidRecordError, match="update: expected a record of class Count, got"):
        update(module, lambda record: result)
    assert counted.state(module) is old


def test_update_whose_transition_raises_keeps_the_record() -> None:
    module = _applied()
    old = counted.state(module)

    def broken(record: Count) -> Count:
        raise ZeroDivisionError("transition failed")

    with pytest.raises(ZeroDivisionError, match="transition failed"):
        counted.update(module, broken)
    assert counted.state(module) is old


def test_set_state_and_update_on_an_unapplied_module_raise_not_applied() -> None:
    module = nn.Linear(1, 1)
    with pytest.raises(NotAppliedError, match="counted is not applied to Linear"):
        counted.set_state(module, Count(1))
    with pytest.raises(NotAppliedError, match="counted is not applied to Linear"):
        counted.update(module, bump)
    assert len(STORE.records(module)) == 0


def _holding_module(module: nn.Module) -> list[object]:
    other = nn.Linear(1, 1)
    deep: list[object] = [1]
    deep.append(deep)
    deep.append(module)

    def calling(x: torch.Tensor) -> object:
        return module(x)

    def defaulted(x: torch.Tensor, layer: nn.Module = module) -> object:
        return layer(x)

    def keyword_defaulted(x: torch.Tensor, *, layer: nn.Module = module) -> object:
        return layer(x)

    def nested() -> Callable[[torch.Tensor], object]:
        return calling

    return [
        module,
        other,
        (1, module),
        (module, 1),
        [[module]],
        {"key": module},
        {module: "value"},
        {module},
        frozenset([module]),
        Holder(Holder(module)),
        deep,
        module.forward,
        module.__sizeof__,
        lambda x: module(x) + 1,
        calling,
        defaulted,
        keyword_defaulted,
        nested,
        functools.partial(module),
        functools.partial(nn.Module.__call__, module),
        functools.partial(torch.add, alpha=module),
        [module.forward],
    ]


HOLDING_IDS = ["self", "other", "tuple", "tuple-before-an-atom", "list", "dict", "dict-key"]
HOLDING_IDS += ["set", "frozenset"]
HOLDING_IDS += ["nested-record", "cyclic-list", "bound-method", "builtin-bound-method", "lambda"]
HOLDING_IDS += ["closure", "default", "keyword-default", "closure-of-a-closure", "partial-func"]
HOLDING_IDS += ["partial-args", "partial-keywords", "bound-method-in-list"]


@pytest.mark.parametrize("index", range(len(HOLDING_IDS)), ids=HOLDING_IDS)
def test_record_holding_a_module_is_refused_by_set_state_and_update(index: int) -> None:
    module = nn.Linear(1, 1)
    holding(module)
    old = holding.state(module)
    record = Holder(_holding_module(module)[index])
    words = "field 'value' of Holder holds an nn.Module.*store its FQN or a weakref.ref"
    with pytest.raises(InvalidRecordError, match=words):
        holding.set_state(module, record)
    with pytest.raises(InvalidRecordError, match=words):
        holding.update(module, lambda _: record)
    assert holding.state(module) is old


def test_record_holding_a_module_names_the_module_it_is_for() -> None:
    model = nn.Sequential(nn.Linear(1, 1))
    holding(model)
    holding(model[0])
    with pytest.raises(InvalidRecordError, match=r"\(record for Linear '0' of Sequential\)$"):
        holding.set_state(model[0], Holder(model[0].forward))


@attrs.frozen
class CountWithNote(Count):
    """A subclass of the state class ``Count``: its records are records of ``Count`` too."""

    note: str = ""
    owner: object = None


@contract(Mixed, store=STORE)
def mixed(module: nn.Module) -> None:
    pass


def _mixed_records(module: nn.Module) -> list[Mixed]:
    return [
        Mixed(1, (2, "three", None), 4.0),
        Mixed(items=((1, 2), [3]), last={"key": (1.5,)}),
        Mixed(last=weakref.ref(module)),
        Mixed(items=(weakref.proxy(module),)),
    ]


@pytest.mark.parametrize("index", range(4), ids=["atoms", "containers", "weakref", "proxy"])
def test_records_with_values_beyond_atoms_in_any_field_are_accepted(index: int) -> None:
    module = nn.Linear(1, 1)
    mixed(module)
    record = _mixed_records(module)[index]
    assert mixed.update(module, lambda _: record) is record
    assert mixed.state(module) is record
    mixed.set_state(module, Mixed())
    mixed.set_state(module, record)
    assert mixed.state(module) is record


@pytest.mark.parametrize(
    ("field", "record_for"),
    [
        ("items", lambda module: Mixed(items=(1, module))),
        ("last", lambda module: Mixed(last=[module])),
        ("last", lambda module: Mixed(1, (2,), module.forward)),
    ],
    ids=["second-field", "last-field", "after-atoms"],
)
def test_a_module_in_any_field_is_refused_by_update_naming_the_field(
    field: str, record_for: Callable[[nn.Module], Mixed]
) -> None:
    module = nn.Linear(1, 1)
    mixed(module)
    old = mixed.state(module)
    record = record_for(module)
    words = f"mixed.update: field {field!r} of Mixed holds an nn.Module"
    with pytest.raises(InvalidRecordError, match=words):
        mixed.update(module, lambda _: record)
    assert mixed.state(module) is old


def test_update_accepts_a_record_of_a_subclass_of_the_state_class() -> None:
    module = _applied()
    noted = counted.update(module, lambda record: CountWithNote(record.n + 1, note="noted"))
    assert counted.state(module) is noted
    assert noted == CountWithNote(2, note="noted")
    refused = CountWithNote(3, owner=(1, module))
    words = "counted.update: field 'owner' of CountWithNote holds an nn.Module"
    with pytest.raises(InvalidRecordError, match=words):
        counted.update(module, lambda _: refused)
    with pytest.raises(InvalidRecordError, match=words.replace("update", "set_state")):
        counted.set_state(module, refused)
    assert counted.state(module) is noted


def test_record_holding_a_weak_reference_or_a_cyclic_list_is_accepted() -> None:
    module = nn.Linear(1, 1)
    holding(module)
    cyclic: list[object] = []
    cyclic.append(cyclic)
    held = weakref.ref(module)

    def through_weak_reference(x: torch.Tensor) -> object:
        target = held()
        return target(x) if target is not None else None

    values: list[object] = [weakref.ref(module), "0.weight", cyclic, {"deep": [[(1, 2)]]}]
    values += [weakref.proxy(module), [weakref.proxy(module)], weakref.WeakMethod(module.forward)]
    values += [through_weak_reference, functools.partial(torch.add, alpha=2), len, [].append]
    for value in values:
        holding.set_state(module, Holder(value))
        assert holding.state(module).value is value


def _with_an_empty_cell(*, fill: bool = False) -> Callable[[], object]:
    """A function whose closure cell is not filled (unless ``fill``): its variable comes later."""

    def read() -> object:
        return later

    if not fill:
        return read
    later = 1
    return read


def test_record_holding_a_function_with_an_unfilled_closure_cell_is_accepted() -> None:
    module = nn.Linear(1, 1)
    holding(module)
    function = _with_an_empty_cell()
    holding.set_state(module, Holder(function))
    assert holding.state(module).value is function


def test_state_class_whose_default_holds_a_module_is_refused_at_decoration() -> None:
    @attrs.frozen
    class Owning:
        inner: tuple[nn.Module, ...] = attrs.field(factory=lambda: (nn.Linear(1, 1),))

    words = r"^contract\(.*Owning\): field 'inner' of .*Owning holds an nn\.Module"
    with pytest.raises(InvalidStateClassError, match=words):
        contract(Owning)


# ----------------------------------------------------------------- module kinds


class Slotted(nn.Linear):
    """A module subclass with __slots__: it keeps __dict__ and __weakref__ from nn.Module."""

    __slots__ = ("note",)


def test_module_subclass_with_slots_is_applied_and_released() -> None:
    own = StateStore()

    @contract(Count, store=own)
    def slotted_api(module: nn.Module) -> None:
        slotted_api.update(module, bump)

    module = Slotted(1, 1)
    slotted_api(module)
    assert slotted_api.state(module) == Count(1)
    assert list(registry(module)) == [slotted_api]
    assert len(own) == 1
    ref = weakref.ref(module)
    del module
    assert ref() is None
    assert len(own) == 0


# ----------------------------------------------------------------- results


@contract(Count, store=STORE)
def replacing(module: nn.Linear) -> nn.Linear:
    """Return a new Linear with the same FQNs, as a wrapper that rebuilds a module may."""
    replacement = nn.Linear(1, 1)
    replacement.load_state_dict(module.state_dict())
    return replacement


def test_api_returning_a_different_module_with_the_same_fqns_is_allowed() -> None:
    # Documented: the call returns the replacement; the record stays on the module given.
    module = nn.Linear(1, 1)
    result = replacing(module)
    assert result is not module
    assert torch.equal(result.weight, module.weight)
    assert replacing.is_applied(module)
    assert not replacing.is_applied(result)


@contract(Count, store=STORE)
def returning(module: nn.Module | Sequence[nn.Module], *, result: Any) -> Any:
    return result


@pytest.mark.parametrize(
    ("given", "result", "kind"),
    [
        ("module", 1, "int"),
        ("module", "module", "str"),
        ("module", [nn.Linear(1, 1)], "list"),
        ("list", nn.Linear(1, 1), "Linear"),
        ("list", [nn.Linear(1, 1)], "list"),
        ("list", [nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1)], "list"),
        ("list", [nn.Linear(1, 1), 2], "list"),
    ],
    ids=["int", "str", "list-for-module", "module-for-list", "short", "long", "non-module-item"],
)
def test_api_returning_a_wrong_result_is_refused_and_installs_nothing(
    given: str, result: object, kind: str
) -> None:
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    target: nn.Module | list[nn.Module] = model if given == "module" else list(model)
    with pytest.raises(InvalidResultError, match=f"returning returned {kind}; an API function"):
        returning(target, result=result)
    assert contents(model, [STORE]) == contents(nn.Sequential(), [STORE])


@contract(Count, store=STORE, strict=False)
def replacing_in_place(modules: list[nn.Module], *, at: int, fresh: nn.Module) -> list[nn.Module]:
    """Replace one item of the list it was given, and return that same list."""
    modules[at] = fresh
    return modules


@torch_contract()
def torch_replacing_in_place(
    modules: list[nn.Module], *, at: int, fresh: nn.Module
) -> list[nn.Module]:
    modules[at] = fresh
    return modules


@pytest.mark.parametrize("at", [0, 1])
def test_list_api_replacing_an_item_of_its_own_list_is_compared_by_position(at: int) -> None:
    # The returned list is the list given, changed in place: each item is compared with
    # the module that was at its position. torch's contract accepts this too.
    modules: list[nn.Module] = [nn.Linear(1, 1), nn.Linear(1, 1)]
    originals = list(modules)
    returned = replacing_in_place(modules, at=at, fresh=nn.Linear(1, 1))
    assert returned is modules
    assert all(replacing_in_place.is_applied(module) for module in originals)
    torch_modules: list[nn.Module] = [nn.Linear(1, 1), nn.Linear(1, 1)]
    assert torch_replacing_in_place(torch_modules, at=at, fresh=nn.Linear(1, 1)) is torch_modules


def test_list_api_replacing_an_item_by_one_with_other_fqns_is_refused_as_torch_does() -> None:
    modules: list[nn.Module] = [nn.Linear(1, 1), nn.Linear(1, 1)]
    originals = list(modules)
    with pytest.raises(FQNChangedError, match="replacing_in_place changed the parameter FQNs"):
        replacing_in_place(modules, at=1, fresh=nn.Linear(1, 1, bias=False))
    assert not any(replacing_in_place.is_applied(module) for module in originals)
    torch_modules: list[nn.Module] = [nn.Linear(1, 1), nn.Linear(1, 1)]
    with pytest.raises(RuntimeError, match="FQNs"):
        torch_replacing_in_place(torch_modules, at=1, fresh=nn.Linear(1, 1, bias=False))
