"""Module trees people build that plain ``nn.Module`` trees do not show: traced modules, cycles."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed._composable.contract import contract as torch_contract

from torchcontract import (
    ContractError,
    CyclicModuleTreeError,
    FQNChangedError,
    NotAppliedError,
    StateStore,
    contract,
    describe,
    take_snapshot,
)

STORE = StateStore()

# torch.jit.trace is deprecated in favour of torch.compile, yet traced modules live on in models.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")


@contract(store=STORE, strict=False)
def noop(module: nn.Module) -> None:
    pass


@torch_contract()
def torch_noop(module: nn.Module) -> nn.Module:
    return module


@contract(store=STORE, strict=False)
def untrace(module: nn.Module) -> None:
    """Replace ``module.traced`` by a plain Linear: its FQNs change from '0.weight' to 'weight'."""
    module.traced = nn.Linear(2, 2)


#: torch.jit.trace has no annotations.
_trace: Callable[[nn.Module, torch.Tensor], torch.jit.ScriptModule] = torch.jit.trace


class WithTraced(nn.Module):
    """A Linear and a traced Sequential (with a nested Sequential and a buffer) beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(2, 2)
        inner = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 2)))
        inner.register_buffer("scale", torch.ones(1))
        self.traced = _trace(inner, torch.randn(1, 2))


def _model_with_traced() -> WithTraced:
    return WithTraced()


def _names(module: nn.Module) -> tuple[list[str], list[str], list[str]]:
    return (
        [name for name, _ in module.named_parameters()],
        [name for name, _ in module.named_buffers(remove_duplicate=False)],
        [name for name, _ in module.named_modules(remove_duplicate=False)],
    )


# ----------------------------------------------------------------- traced modules


def test_snapshot_of_a_tree_with_a_traced_module_lists_what_named_functions_list() -> None:
    model = _model_with_traced()
    snapshot = take_snapshot(model)
    names = (list(snapshot.parameters), list(snapshot.buffers), list(snapshot.module_fqns))
    assert names == _names(model)
    assert "traced.1.1.weight" in snapshot.parameters


def test_api_applies_to_a_tree_holding_a_traced_module_as_torch_contract_does() -> None:
    model = _model_with_traced()
    noop(model)
    noop(model.traced)
    torch_noop(_model_with_traced())
    assert noop.is_applied(model)
    assert noop.is_applied(model.traced)


def test_fqn_check_still_sees_the_names_under_a_traced_module() -> None:
    model = _model_with_traced()
    with pytest.raises(FQNChangedError, match=r"untrace changed the parameter FQNs.*'traced\.0\."):
        untrace(model)
    assert not untrace.is_applied(model)


@contract(store=STORE, strict=False)
def noop_group(modules: list[nn.Module]) -> None:
    pass


def test_list_apply_finds_the_roots_among_traced_modules_and_labels_reach_inside() -> None:
    model = _model_with_traced()
    inner = model.traced._modules["1"]
    assert inner is not None
    noop_group([inner, model.traced])
    assert noop_group.is_applied(model.traced)
    assert not noop_group.is_applied(inner)
    with pytest.raises(NotAppliedError, match=r"noop_group is not applied to TracedModule '1' of"):
        noop_group.state(inner)


def test_describe_shows_a_tree_with_a_traced_module() -> None:
    model = _model_with_traced()
    noop(model.traced)
    lines = describe(model).splitlines()
    assert lines[0] == "WithTraced"
    assert lines[-1].startswith("  traced: TopLevelTracedModule  [noop]")


# ----------------------------------------------------------------- lazy modules


@contract(store=STORE)
def warm_up(module: nn.Module) -> None:
    """Run the module once, as an API that needs its shapes does: lazy modules materialize."""
    module(torch.zeros(1, 3))


@torch_contract()
def torch_warm_up(module: nn.Module) -> nn.Module:
    module(torch.zeros(1, 3))
    return module


def test_lazy_module_materializing_inside_a_strict_api_passes_as_under_torch_contract() -> None:
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(2))
    warm_up(model)
    assert [type(module) for module in model] == [nn.Linear, nn.ReLU, nn.Linear]
    assert warm_up.is_applied(model)
    torch_warm_up(nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(2)))


@contract(store=STORE)
def unpatch(module: nn.Module) -> None:
    del module.forward


def test_api_deleting_an_instance_forward_is_refused_as_deleting_it() -> None:
    module: nn.Module = nn.Linear(3, 3)
    module.forward = module.forward
    with pytest.raises(ContractError, match="unpatch deleted the forward assigned on the instance"):
        unpatch(module)
    assert not unpatch.is_applied(module)


# ----------------------------------------------------------------- shared modules


@contract(store=STORE, strict=False)
def drop_second_path(module: nn.Sequential) -> None:
    module[2] = nn.Identity()


@torch_contract()
def torch_drop_second_path(module: nn.Module) -> nn.Module:
    assert isinstance(module, nn.Sequential)
    module[2] = nn.Identity()
    return module


def _shared_twice() -> nn.Sequential:
    shared = nn.Linear(3, 3)
    return nn.Sequential(shared, nn.ReLU(), shared)


def test_replacing_one_path_of_a_shared_module_is_refused_as_torch_contract_does() -> None:
    # state_dict() would lose '2.weight' and '2.bias', though named_parameters() and the
    # module FQNs (remove_duplicate=False) stay the same.
    model = _shared_twice()
    with pytest.raises(FQNChangedError) as info:
        drop_second_path(model)
    message = str(info.value)
    assert "drop_second_path changed the state_dict parameter FQNs of Sequential" in message
    assert "only before: ['2.weight', '2.bias']" in message
    assert not drop_second_path.is_applied(model)
    with pytest.raises(RuntimeError, match="cannot modify FQNs"):
        torch_drop_second_path(_shared_twice())


# ----------------------------------------------------------------- cycles


@contract(store=STORE)
def first(module: nn.Module) -> None:
    pass


@contract(store=STORE)
def second(module: nn.Module) -> None:
    pass


@contract(store=STORE, strict=False)
def closing_a_cycle(module: nn.Module) -> None:
    next(module.children()).back = module


def _cyclic() -> nn.Sequential:
    """``parent[0].back`` is ``parent``: a reference cycle through ``_modules``."""
    parent = nn.Sequential(nn.Sequential(nn.Linear(3, 3)), nn.ReLU())
    parent[0].back = parent
    return parent


@pytest.mark.timeout(30)
def test_errors_labelling_modules_end_while_a_registered_tree_has_a_cycle() -> None:
    leaf = nn.Linear(3, 3)
    parent = nn.Sequential(nn.Sequential(leaf), nn.ReLU())
    first(parent)
    parent[0].back = parent
    with pytest.raises(NotAppliedError, match=r"second is not applied to Linear;"):
        second.state(nn.Linear(3, 3))
    with pytest.raises(NotAppliedError, match=r"second is not applied to Linear '0\.0' of Sequ"):
        second.state(leaf)


@pytest.mark.timeout(30)
def test_apply_to_a_cyclic_tree_names_the_api_the_class_and_the_path_closing_the_cycle() -> None:
    parent = _cyclic()
    with pytest.raises(CyclicModuleTreeError) as info:
        second(parent)
    message = str(info.value)
    assert message.startswith("test_unusual_trees.second: the module tree of Sequential has a ")
    assert "cycle: Sequential at '0.back' is the module at the root again" in message
    assert "remove that reference from the tree" in message
    assert not second.is_applied(parent)


@pytest.mark.timeout(30)
def test_cycle_below_the_root_names_the_path_of_the_module_it_returns_to() -> None:
    inner = nn.Sequential(nn.Linear(3, 3))
    model = nn.Sequential(nn.ReLU(), nn.Sequential(inner))
    inner.back = model[1]
    with pytest.raises(CyclicModuleTreeError) as info:
        second(model)
    assert "Sequential at '1.0.back' is the module at '1' again" in str(info.value)


@pytest.mark.timeout(30)
def test_cyclic_tree_error_is_found_past_a_module_shared_by_two_paths() -> None:
    shared, looped = nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3))
    looped.back = looped
    closing = r"Sequential at '2\.back' is the module at '2' again"
    with pytest.raises(CyclicModuleTreeError, match=closing):
        second(nn.Sequential(shared, shared, looped))


@pytest.mark.timeout(30)
def test_cyclic_tree_error_message_in_full() -> None:
    with pytest.raises(CyclicModuleTreeError) as info:
        second(_cyclic())
    assert str(info.value) == (
        "test_unusual_trees.second: the module tree of Sequential has a cycle: Sequential at "
        "'0.back' is the module at the root again, so named_modules(), state_dict() and the "
        "FQN check never end; remove that reference from the tree (keep a weakref.ref to the "
        "module instead)"
    )


@pytest.mark.timeout(30)
def test_cyclic_tree_error_names_the_target_by_its_label() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(3, 3)))
    second(model)  # registered: a module inside it is labelled by its path
    model[0].back = model[0]
    with pytest.raises(CyclicModuleTreeError) as info:
        second(model[0])
    assert str(info.value).startswith(
        "test_unusual_trees.second: the module tree of Sequential '0' of Sequential has a cycle"
    )


@pytest.mark.timeout(30)
def test_apply_to_a_module_inside_a_cycle_names_the_path_from_that_module() -> None:
    parent = _cyclic()
    with pytest.raises(CyclicModuleTreeError, match=r"Sequential at 'back\.0' is the module at"):
        second(parent[0])


@pytest.mark.timeout(30)
def test_api_closing_a_cycle_is_refused_and_rolled_back() -> None:
    parent = nn.Sequential(nn.Sequential(nn.Linear(3, 3)))
    with pytest.raises(CyclicModuleTreeError, match="closing_a_cycle: the module tree of Seq"):
        closing_a_cycle(parent)
    assert not closing_a_cycle.is_applied(parent)


@pytest.mark.timeout(30)
def test_take_snapshot_of_a_cyclic_tree_raises_the_cycle_error() -> None:
    with pytest.raises(CyclicModuleTreeError, match="take_snapshot: the module tree of Sequential"):
        take_snapshot(_cyclic())


@pytest.mark.timeout(60)
def test_a_tree_too_deep_to_walk_is_a_contract_error_not_a_recursion_error() -> None:
    deep: nn.Module = nn.Linear(1, 1)
    for _ in range(sys.getrecursionlimit() + 100):
        deep = nn.Sequential(deep)
    with pytest.raises(ContractError, match="nested deeper than Python's recursion limit") as info:
        second(deep)
    assert not isinstance(info.value, CyclicModuleTreeError)
    assert str(info.value) == (
        "test_unusual_trees.second: the module tree of Sequential is nested deeper than "
        f"Python's recursion limit ({sys.getrecursionlimit()}) lets named_modules() and "
        "state_dict() walk it; flatten it, or raise the limit with sys.setrecursionlimit"
    )
    assert not second.is_applied(deep)


@pytest.mark.timeout(30)
def test_describe_shows_a_cycle_once_and_ends() -> None:
    leaf = nn.Linear(3, 3)
    parent = nn.Sequential(nn.Sequential(leaf), nn.ReLU())
    first(parent)
    first(leaf)
    parent[0].back = parent
    assert describe(parent).splitlines() == [
        "Sequential  [first]",
        "  0: Sequential",
        "    0: Linear  [first]",
        "    back: Sequential  (cycle: a module around this line)",
        "  1: ReLU",
    ]
