"""module_label: the one-line name errors give a module."""

from __future__ import annotations

from torch import nn

from torchcontract import contract, module_label


@contract()
def marked(module: nn.Module) -> None:
    pass


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(2, 2), nn.ReLU())


def test_a_module_inside_no_applied_module_is_labelled_by_its_class() -> None:
    assert module_label(Model().layers[0]) == "Linear"


def test_a_module_inside_an_applied_module_is_labelled_by_its_path_there() -> None:
    model = Model()
    marked(model)
    assert module_label(model.layers[0]) == "Linear 'layers.0' of Model"
    assert module_label(model) == "Model"


def test_a_label_ends_while_an_applied_tree_holds_a_cycle() -> None:
    model = Model()
    marked(model)
    model.layers.add_module("back", model)
    stranger = nn.Linear(1, 1)
    assert module_label(stranger) == "Linear"
