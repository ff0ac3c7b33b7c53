"""named_tree and root_modules: walks that end on any tree."""

from __future__ import annotations

from torch import nn

from torchcontract import named_tree, root_modules


def _model() -> nn.Sequential:
    shared = nn.Linear(2, 2)
    return nn.Sequential(nn.Sequential(shared, nn.ReLU()), shared, nn.Linear(2, 1))


def test_named_tree_lists_every_path_as_named_modules_keeping_duplicates() -> None:
    model = _model()
    mine = [(fqn, id(module)) for fqn, module in named_tree(model)]
    theirs = [(fqn, id(module)) for fqn, module in model.named_modules(remove_duplicate=False)]
    assert mine == theirs


def test_named_tree_puts_the_prefix_before_every_path() -> None:
    model = _model()
    assert [fqn for fqn, _ in named_tree(model, "net")][:3] == ["net", "net.0", "net.0.0"]


def test_named_tree_ends_on_a_tree_holding_a_module_inside_itself() -> None:
    outer = nn.Sequential(nn.Linear(2, 2))
    inner = nn.Sequential(nn.ReLU())
    outer.add_module("inner", inner)
    inner.add_module("back", outer)  # a cycle: named_modules would recurse forever
    assert [fqn for fqn, _ in named_tree(outer)] == ["", "0", "inner", "inner.0"]


def test_root_modules_keeps_those_no_other_contains_in_the_given_order() -> None:
    model = _model()
    inner, shared, last = model[0], model[1], model[2]
    assert root_modules([last, shared, inner, model]) == [model]
    assert root_modules([last, shared, inner]) == [last, inner]


def test_root_modules_of_one_module_is_that_module() -> None:
    model = _model()
    assert root_modules([model]) == [model]
