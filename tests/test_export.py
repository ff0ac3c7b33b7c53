"""exported_from: an API implemented in a private module is named by its public path."""

from __future__ import annotations

import importlib
import pickle
import sys
import typing

from torch import nn

from torchcontract import Contract, contract, exported_from
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


def test_an_apis_module_path_names_the_api_and_its_package_holds_the_rest() -> None:
    from torchcontract.apis.fully_shard import FullyShardAPI, unshard

    package = importlib.import_module("torchcontract.apis.fully_shard")
    assert package.unshard is unshard
    assert typing.get_origin(FullyShardAPI) is Contract  # static: every contract is a Contract
    assert {"FullyShardAPI", "FullyShardState", "reshard", "unshard"} <= set(package.__all__)
    # The attribute of torchcontract.apis is the API, which is what ``import ... as`` binds.
    assert vars(importlib.import_module("torchcontract.apis"))["fully_shard"] is fully_shard
    assert sys.modules["torchcontract.apis.replicate"].replicate is replicate
