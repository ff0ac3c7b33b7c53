"""describe(): the module tree, compact, with the APIs applied where."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.distributed._composable.checkpoint_activation import checkpoint as torch_checkpoint

from torchcontract import contract, describe


@contract()
def shard(module: nn.Module) -> None:
    pass


@contract()
def offload(module: nn.Module) -> None:
    pass


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(2, 2)
        self.mlp = nn.Sequential(nn.Linear(2, 2), nn.ReLU())


class Model(nn.Module):
    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(3, 2)
        self.layers = nn.ModuleList([Block() for _ in range(blocks)])
        self.head = nn.Linear(2, 2)


def test_leaf_without_apis_is_its_class_name() -> None:
    assert describe(nn.Linear(2, 2)) == "Linear"


def test_leaf_with_an_api_lists_it() -> None:
    layer = nn.Linear(2, 2)
    shard(layer)
    assert describe(layer) == "Linear  [shard]"


def test_tree_without_apis_is_one_line_with_its_module_count() -> None:
    # embed, layers, 4 x (block, attn, mlp, mlp.0, mlp.1), head
    assert describe(Model()) == "Model  (23 modules below, no APIs)"


def test_one_module_below_is_counted_in_the_singular() -> None:
    assert describe(nn.Sequential(nn.Linear(2, 2))) == "Sequential  (1 module below, no APIs)"


def test_apis_are_listed_in_application_order() -> None:
    layer = nn.Linear(2, 2)
    offload(layer)
    shard(layer)
    assert describe(layer) == "Linear  [offload, shard]"


def test_children_are_shown_by_name_with_their_apis() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    shard(model[0])
    assert describe(model) == "Sequential\n  0: Linear  [shard]\n  1: ReLU"


def test_runs_of_alike_siblings_merge_and_subtrees_without_apis_collapse() -> None:
    model = Model()
    for block in model.layers:
        shard(block)
    shard(model)
    offload(model)
    assert describe(model) == (
        "Model  [shard, offload]\n"
        "  embed: Embedding\n"
        "  layers: ModuleList\n"
        "    0-3: Block ×4  [shard]  (4 modules below, no APIs)\n"
        "  head: Linear"
    )


def test_siblings_that_differ_break_a_run_and_apis_deeper_down_are_shown() -> None:
    model = Model()
    shard(model.layers[0])
    shard(model.get_submodule("layers.1.attn"))
    shard(model.layers[2])
    shard(model.layers[3])
    offload(model.layers[3])
    assert describe(model) == (
        "Model\n"
        "  embed: Embedding\n"
        "  layers: ModuleList\n"
        "    0: Block  [shard]  (4 modules below, no APIs)\n"
        "    1: Block\n"
        "      attn: Linear  [shard]\n"
        "      mlp: Sequential  (2 modules below, no APIs)\n"
        "    2: Block  [shard]  (4 modules below, no APIs)\n"
        "    3: Block  [shard, offload]  (4 modules below, no APIs)\n"
        "  head: Linear"
    )


def test_merged_run_keeps_the_common_subtree_below_it() -> None:
    model = Model(blocks=3)
    for block in model.layers:
        shard(block.get_submodule("attn"))
    assert describe(model) == (
        "Model\n"
        "  embed: Embedding\n"
        "  layers: ModuleList\n"
        "    0-2: Block ×3\n"
        "      attn: Linear  [shard]\n"
        "      mlp: Sequential  (2 modules below, no APIs)\n"
        "  head: Linear"
    )


def test_alike_siblings_that_are_not_adjacent_are_not_merged() -> None:
    model = nn.Sequential(nn.Linear(1, 1), nn.ReLU(), nn.Linear(1, 1))
    shard(model[0])
    shard(model[2])
    assert describe(model) == "Sequential\n  0: Linear  [shard]\n  1: ReLU\n  2: Linear  [shard]"


def test_torch_composable_apis_are_shown_marked_as_torch() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    torch_checkpoint(model[0])
    shard(model[0])
    assert describe(model) == "Sequential\n  0: Linear  [shard, checkpoint (torch)]\n  1: ReLU"


def test_describe_never_prints_a_module_repr() -> None:
    model = Model()
    shard(model.head)
    text = describe(model)
    assert "in_features" not in text
    assert "Embedding(3, 2)" not in text


@given(count=st.integers(min_value=2, max_value=40), applied=st.booleans())
def test_any_run_of_alike_siblings_is_one_line(count: int, applied: bool) -> None:
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(count)], nn.ReLU())
    if applied:
        for layer in list(model)[:count]:
            shard(layer)
        expected = f"Sequential\n  0-{count - 1}: Linear ×{count}  [shard]\n  {count}: ReLU"
    else:
        shard(model[count])
        expected = f"Sequential\n  0-{count - 1}: Linear ×{count}\n  {count}: ReLU  [shard]"
    assert describe(model) == expected


def test_named_siblings_are_never_merged_even_when_alike() -> None:
    model = nn.Module()
    model.tokens = nn.Embedding(3, 2)
    model.positions = nn.Embedding(3, 2)
    shard(model.tokens)
    shard(model.positions)
    assert describe(model) == (
        "Module\n  tokens: Embedding  [shard]\n  positions: Embedding  [shard]"
    )


def test_numbered_siblings_merge_only_when_consecutive() -> None:
    model = nn.ModuleDict({"0": nn.Linear(2, 2), "2": nn.Linear(2, 2), "3": nn.Linear(2, 2)})
    for layer in model.values():
        shard(layer)
    assert describe(model) == "ModuleDict\n  0: Linear  [shard]\n  2-3: Linear ×2  [shard]"
