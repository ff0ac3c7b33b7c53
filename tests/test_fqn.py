"""Unit tests of FQN snapshots and of the diff that explains a changed FQN."""

from __future__ import annotations

import copy
import pickle
import weakref

import pytest
import torch
from torch import nn

from torchcontract import ContractError, FQNChangedError, FQNSnapshot, take_snapshot
from torchcontract._fqn import descendants
from torchcontract._fqn_checks import check_strict, check_unchanged


def _label(module: nn.Module) -> str:
    return type(module).__qualname__


def _check(before: FQNSnapshot, after: FQNSnapshot) -> str:
    with pytest.raises(FQNChangedError) as info:
        check_unchanged("api", _label, before, after)
    return str(info.value)


def _with_parameters(*names: str) -> nn.Module:
    module = nn.Module()
    for name in names:
        module.register_parameter(name, nn.Parameter(torch.zeros(1)))
    return module


# ----------------------------------------------------------------- snapshots


def test_snapshot_lists_names_as_torch_named_functions_do() -> None:
    model = nn.Sequential(nn.Linear(1, 1), nn.BatchNorm1d(1))
    snapshot = take_snapshot(model)
    assert snapshot.parameters == ("0.weight", "0.bias", "1.weight", "1.bias")
    assert snapshot.buffers == ("1.running_mean", "1.running_var", "1.num_batches_tracked")
    assert snapshot.module_fqns == ("", "0", "1")


def test_snapshot_lists_a_shared_module_at_every_path_but_its_parameters_once() -> None:
    shared = nn.BatchNorm1d(1)
    model = nn.Sequential(shared, nn.Sequential(shared))
    snapshot = take_snapshot(model)
    assert snapshot.module_fqns == ("", "0", "1", "1.0")
    assert snapshot.parameters == ("0.weight", "0.bias")
    assert snapshot.buffers == (
        "0.running_mean",
        "0.running_var",
        "0.num_batches_tracked",
        "1.0.running_mean",
        "1.0.running_var",
        "1.0.num_batches_tracked",
    )


def test_snapshot_lists_a_tied_parameter_at_its_first_path_only() -> None:
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    model[1].weight = model[0].weight
    assert take_snapshot(model).parameters == ("0.weight", "0.bias", "1.bias")


def test_snapshot_lists_state_dict_parameters_at_every_path_as_state_dict_does() -> None:
    shared = nn.Linear(1, 1)
    model = nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(1, 1))
    model[3].weight = shared.weight
    model.register_parameter("gone", None)
    snapshot = take_snapshot(model)
    expected = ("0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias")
    assert snapshot.state_dict_parameters == expected
    assert expected == tuple(name for name, _ in model.named_parameters(remove_duplicate=False))
    assert expected == tuple(model.state_dict())


def test_snapshot_skips_none_parameters_buffers_and_children() -> None:
    model = nn.Module()
    model.register_parameter("gone", None)
    model.register_buffer("empty", None)
    model.register_module("missing", None)
    model.register_parameter("kept", nn.Parameter(torch.zeros(1)))
    snapshot = take_snapshot(model)
    assert (snapshot.parameters, snapshot.buffers, snapshot.module_fqns) == (("kept",), (), ("",))


def test_snapshot_joins_names_under_an_empty_child_name_as_torch_does() -> None:
    model = nn.Module()
    model._modules[""] = nn.Sequential(nn.Linear(1, 1))
    snapshot = take_snapshot(model)
    assert snapshot.module_fqns == tuple(n for n, _ in model.named_modules(remove_duplicate=False))
    assert snapshot.module_fqns == ("", "", "0")
    assert snapshot.parameters == ("0.weight", "0.bias")


def test_snapshot_keeps_the_modules_their_classes_and_instance_forwards() -> None:
    model = nn.Sequential(nn.Linear(1, 1))

    def forward(x: torch.Tensor) -> torch.Tensor:
        return x

    model[0].forward = forward
    snapshot = take_snapshot(model)
    assert snapshot.modules == (model, model[0])
    assert snapshot.classes == (nn.Sequential, nn.Linear)
    assert snapshot.forwards == (None, forward)


def test_a_leaf_snapshot_equals_the_walk_of_the_same_leaf_inside_a_container() -> None:
    """A module without children is snapshotted without the walk: the same result."""
    leaf = nn.Linear(2, 2)
    leaf.register_parameter("gone", None)
    leaf.register_buffer("scale", torch.ones(1))
    leaf.register_buffer("empty", None)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return x

    leaf.__dict__["forward"] = forward  # set on the instance, as a patch would be
    alone, inside = take_snapshot(leaf), take_snapshot(nn.Sequential(leaf))
    assert alone.parameters == tuple(n for n, _ in leaf.named_parameters()) == ("weight", "bias")
    assert alone.buffers == ("scale",)
    assert alone.state_dict_parameters == ("weight", "bias")
    assert alone.module_fqns == ("",)
    assert (alone.modules, alone.classes, alone.forwards) == ((leaf,), (nn.Linear,), (forward,))
    assert inside.parameters == ("0.weight", "0.bias")
    assert inside.forwards == (None, forward)
    assert alone.same_as(take_snapshot(leaf))
    leaf.bias = nn.Parameter(torch.zeros(2))
    assert not alone.same_as(take_snapshot(leaf))  # a new parameter object: ids differ
    check_unchanged("api", _label, alone, take_snapshot(leaf))  # the names do not


def test_snapshot_does_not_change_when_the_module_changes_afterwards() -> None:
    model = nn.Sequential(nn.Linear(1, 1))
    snapshot = take_snapshot(model)
    model.append(nn.Linear(1, 1))
    del model[0].bias
    assert snapshot.parameters == ("0.weight", "0.bias")
    assert snapshot.module_fqns == ("", "0")


def test_snapshot_keeps_no_tensor_alive() -> None:
    model = nn.Linear(1, 1)
    old_weight = weakref.ref(model.weight)
    snapshot = take_snapshot(model)
    model.weight = nn.Parameter(torch.zeros(1, 1))
    assert old_weight() is None
    assert snapshot.parameters == ("weight", "bias")


def test_snapshot_repr_counts_without_listing_names() -> None:
    snapshot = take_snapshot(nn.Sequential(nn.Linear(1, 1), nn.BatchNorm1d(1)))
    assert repr(snapshot) == "<FQNSnapshot of 3 modules, 4 parameters, 3 buffers>"


def test_snapshots_of_an_unchanged_module_are_the_same() -> None:
    model = nn.Sequential(nn.Linear(1, 1))
    assert take_snapshot(model).same_as(take_snapshot(model))


def test_new_parameter_objects_under_the_same_names_pass_the_check() -> None:
    model = nn.Linear(1, 1)
    before = take_snapshot(model)
    model.weight = nn.Parameter(torch.zeros(1, 1))
    after = take_snapshot(model)
    assert not before.same_as(after)
    check_unchanged("api", _label, before, after)


def test_the_same_names_from_another_tree_shape_pass_the_check() -> None:
    nested = nn.Module()
    nested.a = _with_parameters("b")
    flat = nn.Module()
    flat.a = nn.Module()
    flat._parameters["a.b"] = nn.Parameter(torch.zeros(1))
    assert take_snapshot(flat).parameters == take_snapshot(nested).parameters
    check_unchanged("api", _label, take_snapshot(nested), take_snapshot(flat))


# ----------------------------------------------------------------- the diff


def test_added_name_is_listed_only_after() -> None:
    message = _check(
        take_snapshot(_with_parameters("a")), take_snapshot(_with_parameters("a", "b"))
    )
    assert "api changed the parameter FQNs of Module: only before: []; only after: ['b']" in message


def test_removed_name_is_listed_only_before() -> None:
    message = _check(
        take_snapshot(_with_parameters("a", "b")), take_snapshot(_with_parameters("a"))
    )
    assert "only before: ['b']; only after: []" in message


def test_renamed_name_is_listed_on_both_sides_in_order() -> None:
    before = take_snapshot(_with_parameters("a", "b", "c"))
    after = take_snapshot(_with_parameters("a", "y", "x"))
    assert "only before: ['b', 'c']; only after: ['y', 'x']" in _check(before, after)


def test_reorder_names_the_first_position_that_differs_and_both_names() -> None:
    before = take_snapshot(_with_parameters("a", "b", "c", "d"))
    after = take_snapshot(_with_parameters("a", "b", "d", "c"))
    message = _check(before, after)
    assert "same names, new order: position 2 was 'c', is now 'd'" in message


def test_a_name_repeated_more_often_is_counted() -> None:
    after = nn.Module()
    after._modules[""] = nn.Module()  # torch names it "", as the root
    assert take_snapshot(after).module_fqns == ("", "")
    message = _check(take_snapshot(nn.Module()), take_snapshot(after))
    assert "module FQNs of Module: 1 names before, 2 after" in message


def test_a_listing_one_name_too_long_ends_with_one_more() -> None:
    names = [f"p{index}" for index in range(9)]
    message = _check(take_snapshot(_with_parameters()), take_snapshot(_with_parameters(*names)))
    shown = ", ".join(repr(name) for name in names[:8])
    assert f"only after: [{shown}, ... and 1 more]" in message


def test_a_listing_of_eight_names_shows_them_all() -> None:
    names = [f"p{index}" for index in range(8)]
    message = _check(take_snapshot(_with_parameters()), take_snapshot(_with_parameters(*names)))
    shown = ", ".join(repr(name) for name in names)
    assert f"only after: [{shown}]" in message


def test_long_listings_end_with_how_many_more() -> None:
    names = [f"p{index}" for index in range(11)]
    message = _check(take_snapshot(_with_parameters()), take_snapshot(_with_parameters(*names)))
    shown = ", ".join(repr(name) for name in names[:8])
    assert f"only after: [{shown}, ... and 3 more]" in message


def test_listing_of_exactly_eight_names_has_no_more_clause() -> None:
    names = [f"p{index}" for index in range(8)]
    message = _check(take_snapshot(_with_parameters()), take_snapshot(_with_parameters(*names)))
    assert "more" not in message
    assert "'p7']" in message


def test_parameters_are_reported_before_buffers_and_modules() -> None:
    before = nn.Module()
    after = nn.Module()
    after.register_parameter("p", nn.Parameter(torch.zeros(1)))
    after.register_buffer("b", torch.zeros(1))
    after.child = nn.Module()
    assert "changed the parameter FQNs" in _check(take_snapshot(before), take_snapshot(after))


def test_buffers_are_reported_when_parameters_agree() -> None:
    after = nn.Module()
    after.register_buffer("b", torch.zeros(1))
    after.child = nn.Module()
    message = _check(take_snapshot(nn.Module()), take_snapshot(after))
    assert "changed the buffer FQNs of Module: only before: []; only after: ['b']" in message


def test_modules_are_reported_when_members_agree() -> None:
    after = nn.Module()
    after.child = nn.Module()
    message = _check(take_snapshot(nn.Module()), take_snapshot(after))
    assert "changed the module FQNs of Module: only before: []; only after: ['child']" in message


def test_one_path_of_a_shared_module_replaced_is_reported_as_a_state_dict_change() -> None:
    # Module FQNs and named_parameters() agree; only the state dict loses '2.*'.
    shared = nn.Linear(1, 1)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    before = take_snapshot(model)
    model[2] = nn.Identity()
    message = _check(before, take_snapshot(model))
    assert "api changed the state_dict parameter FQNs of Sequential" in message
    assert "only before: ['2.weight', '2.bias']; only after: []" in message


def test_tying_two_parameters_is_reported_as_a_parameter_change() -> None:
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    before = take_snapshot(model)
    model[1].weight = model[0].weight
    assert "changed the parameter FQNs" in _check(before, take_snapshot(model))


def test_message_names_the_root_with_the_label_and_says_what_to_do() -> None:
    message = _check(take_snapshot(nn.Linear(1, 1)), take_snapshot(nn.Linear(1, 1, bias=False)))
    assert message.startswith("api changed the parameter FQNs of Linear: ")
    assert message.endswith(
        "Composable APIs must keep every FQN and its order; keep new state in the "
        "API's record, not in the module tree"
    )


# ----------------------------------------------------------------- strict checks


class Wider(nn.Linear):
    pass


class Other(nn.Module):
    pass


def test_class_changed_to_a_subclass_passes_the_strict_check() -> None:
    model = nn.Sequential(nn.Linear(1, 1))
    before = take_snapshot(model)
    model[0].__class__ = Wider
    check_strict("api", before, take_snapshot(model))


def test_class_changed_to_a_non_subclass_names_the_module_and_both_classes() -> None:
    model = nn.Sequential(nn.Linear(1, 1))
    before = take_snapshot(model)
    model[0].__class__ = Other
    with pytest.raises(ContractError) as info:
        check_strict("api", before, take_snapshot(model))
    assert "api changed the class of Linear at '0' to Other, which is not a subclass" in str(
        info.value
    )


def test_forward_assigned_on_an_instance_names_the_module() -> None:
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    before = take_snapshot(model)
    model[1].forward = model[1].forward
    with pytest.raises(ContractError) as info:
        check_strict("api", before, take_snapshot(model))
    assert "api assigned forward on the instance of Linear at '1'" in str(info.value)
    assert "strict=False" in str(info.value)


def test_forward_removed_from_an_instance_is_reported_as_deleted() -> None:
    model: nn.Module = nn.Linear(1, 1)
    model.forward = model.forward
    before = take_snapshot(model)
    del model.forward
    with pytest.raises(ContractError) as info:
        check_strict("api", before, take_snapshot(model))
    message = str(info.value)
    assert "api deleted the forward assigned on the instance of Linear at the root" in message
    assert "assigned forward on" not in message
    assert "strict=False" in message


def test_forward_replaced_on_an_instance_is_reported_as_assigned() -> None:
    model: nn.Module = nn.Linear(1, 1)
    model.forward = model.forward
    before = take_snapshot(model)
    model.forward = nn.Linear.forward.__get__(model)  # a new bound method
    with pytest.raises(ContractError, match="api assigned forward on the instance of Linear at"):
        check_strict("api", before, take_snapshot(model))


def test_lazy_module_materializing_into_its_cls_to_become_passes_the_strict_check() -> None:
    model = nn.Sequential(nn.LazyLinear(2))
    before = take_snapshot(model)
    model(torch.zeros(1, 3))
    assert type(model[0]) is nn.Linear  # what LazyLinear.cls_to_become names
    check_strict("api", before, take_snapshot(model))


def test_lazy_module_turned_into_another_class_fails_the_strict_check() -> None:
    model = nn.Sequential(nn.LazyLinear(2))
    before = take_snapshot(model)
    model[0].__class__ = Other
    with pytest.raises(ContractError, match="changed the class of LazyLinear at '0' to Other"):
        check_strict("api", before, take_snapshot(model))


def test_strict_check_reports_the_first_offending_module_in_order() -> None:
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    before = take_snapshot(model)
    model[0].forward = model[0].forward
    model[1].__class__ = Other
    with pytest.raises(ContractError, match="assigned forward on the instance of Linear at '0'"):
        check_strict("api", before, take_snapshot(model))


def test_descendants_lists_a_module_shared_by_two_paths_once() -> None:
    shared = nn.Linear(1, 1)
    root = nn.Sequential(shared, nn.Sequential(shared))
    assert [id(module) for module in descendants(root)] == [id(shared), id(root[1])]


def test_snapshots_are_made_only_by_take_snapshot() -> None:
    words = r"^FQNSnapshot: snapshots are made by take_snapshot\(module\); call that$"
    with pytest.raises(TypeError, match=words):
        FQNSnapshot()


def test_a_leaf_snapshot_reads_its_instance_forward_and_shares_nothing_it_reads() -> None:
    plain, patched = nn.Linear(2, 2), nn.Linear(2, 2)
    patched.__dict__["forward"] = patched.forward  # an instance forward, as a patch sets
    first, second = take_snapshot(plain), take_snapshot(plain)
    assert first.forwards == second.forwards == (None,)
    assert take_snapshot(patched).forwards == (patched.__dict__["forward"],)
    assert first.same_as(second)
    assert first.classes == (nn.Linear,)
    assert first.module_fqns == ("",)


@pytest.mark.parametrize(
    "model",
    [nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))],
    ids=["leaf", "tree"],
)
def test_snapshots_survive_copying_and_pickling(model: nn.Module) -> None:
    snapshot = take_snapshot(model)
    for copied in (
        copy.copy(snapshot),
        copy.deepcopy(snapshot),
        pickle.loads(pickle.dumps(snapshot)),
    ):
        assert (copied.parameters, copied.buffers, copied.module_fqns) == (
            snapshot.parameters,
            snapshot.buffers,
            snapshot.module_fqns,
        )
        assert copied.forwards == snapshot.forwards
