"""The C walk copies a module tree exactly as the Python walk does, or hands the tree back.

``_fqn`` takes a tree's snapshot with the C walk where the package was built with it (as
``make test``'s environment is) and with the Python walk, the reference, elsewhere. Both
must copy the same lists, entry for entry, on every tree: random ones (tied parameters,
shared modules, ``None`` members and children, every container) changed through every path
a user has, and trees with instance ``forward``s. Where the Python walk takes a path of its
own (a traced module, a member that is no dict), the C walk answers None and the
Python walk runs, as it does for a tree deeper than the C walk goes or one that changes
while walked; a cyclic or too deep tree raises the same errors through both. The
comparison after an API function (``unchanged_since``) says a tree is unchanged exactly
when a new walk would copy the very same objects, so an apply that changes nothing takes
one snapshot, not two.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from types import MappingProxyType
from typing import Any, Final, cast

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_fqn_properties import EXAMPLES, DrawChooser, Pools, build_tree, mutate
from torch import nn

from torchcontract import (
    ContractError,
    CyclicModuleTreeError,
    StateStore,
    _fqn,
    contract,
    take_snapshot,
)

# torch.jit.trace is deprecated in favour of torch.compile, yet traced modules live on in models.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")

native_walk: Final = _fqn._native_walk
#: torch.jit.trace has no annotations.
_trace: Callable[[nn.Module, torch.Tensor], torch.jit.ScriptModule] = torch.jit.trace


Copies = tuple[list[int], object, object, object, object]


def _python_copies(root: nn.Module) -> Copies:
    """What the Python walk copied of ``root``: the modules' ids, classes, tree, forwards,
    members."""
    snapshot = _fqn._walk_in_python(root)
    modules = list(map(id, snapshot._modules))
    return (modules, snapshot.classes, snapshot._tree, snapshot._forwards, snapshot._members)


def _native_copies(root: nn.Module) -> Copies | None:
    """What the C walk copied of ``root``, as ``_python_copies``; None if it handed it back."""
    assert native_walk is not None
    copies = native_walk(root)
    if copies is None:
        return None
    modules, classes, tree, forwards, members = copies
    return (list(map(id, modules)), classes, tree, forwards, members)


def _same_copies(root: nn.Module) -> None:
    native = _native_copies(root)
    assert native is not None
    assert native == _python_copies(root)


def test_the_c_walk_is_built() -> None:
    """``make test``'s environment has it: the speed the performance page shows is its."""
    assert native_walk is not None, (
        "torchcontract._walk_native did not build (no C compiler?): install one, then run "
        "pip install -e . again"
    )


@EXAMPLES
@given(st.data())
def test_both_walks_copy_random_trees_alike(data: st.DataObject) -> None:
    chooser = DrawChooser(data)
    pools = Pools()
    root = nn.Sequential(build_tree(chooser, pools))
    _same_copies(root)
    for _ in range(chooser.integer(1, 3)):
        mutate(chooser, pools, root)
        _same_copies(root)


def _identical(before: _fqn.FQNSnapshot, after: _fqn.FQNSnapshot) -> bool:
    """Whether two snapshots copied the very same objects: modules, classes, forwards, names."""
    return (
        before.same_as(after)
        and list(map(id, before._modules)) == list(map(id, after._modules))
        and before.classes == after.classes
        and before._forwards.keys() == after._forwards.keys()
        and all(before._forwards[key] is after._forwards[key] for key in before._forwards)
        and list(map(id, before._tree[1])) == list(map(id, after._tree[1]))
        and all(
            list(map(id, old[1])) == list(map(id, new[1]))
            for old, new in zip(before._members, after._members, strict=True)
        )
    )


@EXAMPLES
@given(st.data())
def test_the_comparison_says_unchanged_exactly_when_a_new_walk_copies_the_same_objects(
    data: st.DataObject,
) -> None:
    chooser = DrawChooser(data)
    pools = Pools()
    root = nn.Sequential(build_tree(chooser, pools))
    before = take_snapshot(root)
    assert _fqn.unchanged_since(before, root)
    for _ in range(chooser.integer(1, 3)):
        kind = mutate(chooser, pools, root)
        after = take_snapshot(root)
        assert _fqn.unchanged_since(before, root) == _identical(before, after), kind
        before = after
        assert _fqn.unchanged_since(before, root)


def test_the_comparison_sees_a_forward_a_class_and_a_member_object_change() -> None:
    linear, norm, inner = nn.Linear(2, 2), nn.LayerNorm(2), nn.Sequential()
    inner.add_module("norm", norm)
    root = nn.Sequential(linear, inner)
    root.register_buffer("steps", torch.zeros(1))
    changes: list[Callable[[], object]] = [
        lambda: setattr(linear, "forward", print),
        lambda: vars(linear).pop("forward"),
        lambda: setattr(norm, "__class__", type("Norm", (nn.LayerNorm,), {})),
        lambda: setattr(root, "steps", torch.zeros(1)),
        lambda: setattr(linear, "bias", nn.Parameter(torch.zeros(2))),
        lambda: inner.add_module("more", nn.ReLU()),
    ]
    for change in changes:
        before = take_snapshot(root)
        change()
        assert not _fqn.unchanged_since(before, root)
        assert _fqn.unchanged_since(take_snapshot(root), root)


def test_a_leafs_snapshot_is_compared_too() -> None:
    leaf = nn.Linear(2, 2)
    before = take_snapshot(leaf)
    assert _fqn.unchanged_since(before, leaf)
    leaf.weight = nn.Parameter(torch.zeros(2, 2))
    assert not _fqn.unchanged_since(before, leaf)
    assert not _fqn.unchanged_since(before, nn.Linear(2, 2))  # another module: not the same tree


def test_the_comparison_refuses_copies_it_did_not_make() -> None:
    assert _fqn._native_unchanged is not None
    root = nn.Sequential(nn.Linear(1, 1))
    copies = take_snapshot(root)._copies()
    wrongs: list[object] = [list(copies), copies[:4], (*copies[:3], [], copies[4])]
    for wrong in wrongs:
        with pytest.raises(TypeError, match=r"unchanged\(\) takes the copies walk\(\) returns"):
            _fqn._native_unchanged(root, cast(Any, wrong))


def test_the_comparison_hands_back_what_the_walk_hands_back() -> None:
    """A traced module: the C comparison answers None, ``unchanged`` False (compare in full)."""
    root = nn.Sequential(_trace(nn.Linear(2, 2), torch.zeros(1, 2)))
    before = take_snapshot(root)
    assert _fqn._native_unchanged is not None
    assert _fqn._native_unchanged(root, before._copies()) is None
    assert not _fqn.unchanged_since(before, root)


def test_both_walks_copy_instance_forwards_alike() -> None:
    first, last = nn.Linear(1, 1), nn.Linear(1, 1)
    root = nn.Sequential(first, nn.Sequential(nn.ReLU(), last))
    bound = first.forward
    for module, forward in ((first, bound), (last, print), (root, len)):
        setattr(module, "forward", forward)  # noqa: B010 (mypy refuses assigning a method)
    native = _native_copies(root)
    assert native is not None
    assert native[3] == {0: len, 1: bound, 4: print}
    _same_copies(root)


def test_a_snapshot_is_the_c_walks_and_equals_the_pythons(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.LayerNorm(2)))
    root.register_buffer("steps", torch.zeros(1))
    walked: list[nn.Module] = []

    def walk(module: nn.Module) -> object:
        walked.append(module)
        assert native_walk is not None
        return native_walk(module)

    monkeypatch.setattr(_fqn, "_native_walk", walk)
    ours, reference = take_snapshot(root), _fqn._walk_in_python(root)
    assert walked == [root]
    assert ours.same_as(reference)
    assert reference.same_as(ours)
    assert ours.parameters == reference.parameters
    assert ours.buffers == ("steps",)
    assert ours.module_fqns == ("", "0", "1", "1.0")


def test_a_traced_module_is_left_to_the_python_walk() -> None:
    traced = _trace(nn.Linear(2, 2), torch.zeros(1, 2))
    root = nn.Sequential(nn.Linear(2, 2), traced)
    assert _native_copies(root) is None
    snapshot = take_snapshot(root)
    assert snapshot.parameters == tuple(name for name, _ in root.named_parameters())


def test_an_ordered_dict_is_read_in_its_own_order() -> None:
    """``nn.Sequential``'s ``del`` leaves its children in an ``OrderedDict``; reordered here."""
    child = nn.Linear(2, 2)
    child._parameters = OrderedDict(child._parameters)
    child._parameters.move_to_end("weight")  # its order now differs from its dict's
    root = nn.Sequential(nn.Linear(1, 1), child, nn.Linear(1, 1))
    del root[0]
    assert type(root._modules) is OrderedDict
    _same_copies(root)
    names = tuple(name for name, _ in root.named_parameters())
    assert take_snapshot(root).parameters == names == ("0.bias", "0.weight", "1.weight", "1.bias")


def test_a_member_that_is_no_dict_is_left_to_the_python_walk() -> None:
    child = nn.Linear(2, 2)
    child._parameters = MappingProxyType(dict(child._parameters))  # type: ignore[assignment]
    root = nn.Sequential(child)
    assert _native_copies(root) is None
    assert take_snapshot(root).parameters == ("0.weight", "0.bias")


class Rebinding(dict[str, nn.Parameter | None]):
    """Parameters whose iteration rebinds its module's buffers and children to new dicts."""

    owner: nn.Module

    def __iter__(self) -> Iterator[str]:
        self.owner.__dict__["_buffers"] = {}
        self.owner.__dict__["_modules"] = {}
        return super().__iter__()


def _rebinding_tree() -> nn.Module:
    owner = nn.Linear(2, 2)
    owner.register_buffer("running", torch.zeros(3))
    owner.add_module("inner", nn.Linear(1, 1))
    parameters = Rebinding(owner._parameters)
    parameters.owner = owner
    owner._parameters = parameters
    return nn.Sequential(owner)


def test_members_rebound_while_read_are_walked_as_the_python_walk_walks_them() -> None:
    """Each walk reads the dicts it found, held while read (the C walk freed them once)."""
    native = _native_copies(_rebinding_tree())
    python = _python_copies(_rebinding_tree())
    assert native is not None
    # A new tree each time: the parameters' ids differ; the names and the tree do not.
    assert native[2] == python[2]
    assert native[2] == ([-1, 1, 0, 1, 1, 1], ["", "0", "inner"], [])


class Growing(dict[str, nn.Parameter | None]):
    """Parameters whose first iteration adds a child to ``root``, the module above."""

    root: nn.Module

    def __iter__(self) -> Iterator[str]:
        if "extra" not in self.root._modules:
            self.root._modules["extra"] = nn.Linear(1, 1)
        return super().__iter__()


def test_children_that_change_while_walked_are_left_to_the_python_walk() -> None:
    first = nn.Linear(1, 1)
    root = nn.Sequential(first, nn.Linear(1, 1))
    parameters = Growing(first._parameters)
    parameters.root = root
    first._parameters = parameters
    assert _native_copies(root) is None  # iterating them, Python would raise
    names = tuple(name for name, _ in root.named_parameters())
    assert take_snapshot(root).parameters == names
    assert names[-2:] == ("extra.weight", "extra.bias")


def test_a_cycle_raises_the_same_error_through_either_walk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    errors: list[str] = []
    for walk in (native_walk, None):
        monkeypatch.setattr(_fqn, "_native_walk", walk)
        root = nn.Sequential(nn.Linear(1, 1))
        root[0].add_module("loop", root)
        with pytest.raises(CyclicModuleTreeError) as raised:
            take_snapshot(root, api_name="api")
        errors.append(str(raised.value))
    assert errors[0] == errors[1]
    assert errors[0].startswith("api: the module tree of Sequential has a cycle: Sequential at")


def _chain(depth: int) -> nn.Module:
    """Sequentials nested ``depth`` deep, a Linear at the bottom."""
    root = leaf = nn.Sequential()
    for _ in range(depth):
        deeper = nn.Sequential()
        leaf.add_module("next", deeper)
        leaf = deeper
    leaf.add_module("end", nn.Linear(1, 1))
    return root


def test_a_tree_deeper_than_the_c_walk_goes_is_walked_in_python() -> None:
    """Past 256 levels (no model has them) the C walk hands the tree back, stack unspent."""
    shallow, deep = _chain(250), _chain(300)
    assert _native_copies(shallow) is not None
    assert _native_copies(deep) is None
    assert take_snapshot(deep).parameters == tuple(name for name, _ in deep.named_parameters())


def test_a_tree_deeper_than_the_recursion_limit_raises_through_either_walk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root = _chain(sys.getrecursionlimit() + 10)
    for walk in (native_walk, None):
        monkeypatch.setattr(_fqn, "_native_walk", walk)
        with pytest.raises(ContractError, match="nested deeper than Python's recursion limit"):
            take_snapshot(root, api_name="api")


def _walks_of(monkeypatch: pytest.MonkeyPatch) -> list[nn.Module]:
    """The roots ``take_snapshot`` walks from now on, in order."""
    walked: list[nn.Module] = []
    walk = _fqn._walk

    def counted(root: nn.Module) -> _fqn.FQNSnapshot:
        walked.append(root)
        return walk(root)

    monkeypatch.setattr(_fqn, "_walk", counted)
    return walked


def test_an_apply_that_changes_nothing_takes_one_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The comparison answers for the second snapshot; without it, one is taken."""

    @contract(store=StateStore())
    def noop(module: nn.Module) -> None:
        pass

    walked = _walks_of(monkeypatch)
    root = nn.Sequential(nn.Linear(1, 1), nn.ReLU())
    noop(root)
    assert walked == [root]
    monkeypatch.setattr(_fqn, "_native_unchanged", None)
    other = nn.Sequential(nn.Linear(1, 1), nn.ReLU())
    noop(other)
    assert walked == [root, other, other]


def test_an_apply_that_changes_the_tree_takes_a_second_snapshot_and_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    @contract(store=StateStore())
    def patching(module: nn.Module) -> None:
        setattr(module.get_submodule("0"), "forward", print)  # noqa: B010 (a method, for mypy)

    walked = _walks_of(monkeypatch)
    root = nn.Sequential(nn.Linear(1, 1), nn.ReLU())
    with pytest.raises(ContractError, match="patching assigned forward on the instance of Linear"):
        patching(root)
    assert walked == [root, root]
