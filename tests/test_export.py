"""exported_from: an API implemented in a private module is named by its public path."""

from __future__ import annotations

import pickle

from torch import nn

from torchcontract import contract, exported_from
from torchcontract.apis import checkpoint, fully_shard, replicate


@contract()
@exported_from(__name__)  # below contract: the contract reads the name when it is made
def renamed(module: nn.Module) -> None:
    pass


def test_the_name_is_the_package_it_is_exported_from_and_the_function() -> None:
    @exported_from("somewhere.public")
    def api(module: nn.Module) -> None:
        pass

    assert contract()(api).name == f"somewhere.public.{api.__qualname__}"


def test_a_contract_pickles_by_reference_to_where_it_is_exported() -> None:
    assert pickle.loads(pickle.dumps(renamed)) is renamed


def test_the_reference_apis_are_named_by_their_public_import_paths() -> None:
    assert replicate.name == "torchcontract.apis.replicate.replicate"
    assert checkpoint.name == "torchcontract.apis.checkpoint.checkpoint"
    assert fully_shard.name == "torchcontract.apis.fully_shard.fully_shard"
