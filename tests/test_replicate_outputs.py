"""find_tensors: the tensors of a forward's output, where DDP's ``_find_tensors`` finds them."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, Final, NamedTuple, cast

import pytest
import torch
from torch import Tensor
from torch.nn.parallel import distributed as ddp_module

from torchcontract.apis.replicate._outputs import find_tensors

#: DDP's own walk, the reference.
ddp_find_tensors: Final = cast(Callable[[object], Iterable[Tensor]], ddp_module._find_tensors)

a, b, c = torch.ones(1), torch.zeros(2), torch.full((3,), 2.0)


@dataclasses.dataclass
class Plain:
    loss: Tensor
    rest: object = None


@dataclasses.dataclass
class LikeModelOutput(collections.OrderedDict[str, Any]):
    """As Hugging Face's ``ModelOutput``: a dataclass and an OrderedDict of its set fields."""

    loss: Tensor | None = None
    logits: Tensor | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value


class Pair(NamedTuple):
    first: Tensor
    second: object


OUTPUTS: Final[dict[str, object]] = {
    "tensor": a,
    "tuple": (a, b),
    "list": [a, "text", 3],
    "dict": {"x": a, "y": [b]},
    "dataclass": Plain(a, {"more": (b, c)}),
    "model_output": LikeModelOutput(loss=a, logits=b),
    "namedtuple": Pair(a, Plain(b)),
    "nested": [({"deep": [Plain(a, LikeModelOutput(logits=c))]},)],
    "none": None,
    "no_tensor": {"loss": 1.5, "text": "abc"},
    "empty": (),
}


def _ids(tensors: Iterable[Tensor]) -> list[int]:
    return sorted(id(tensor) for tensor in tensors)


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_finds_the_tensors_ddp_finds(name: str) -> None:
    output = OUTPUTS[name]
    assert _ids(find_tensors(output)) == _ids(ddp_find_tensors(output))


def test_plain_dataclass_is_searched_where_pytree_stops() -> None:
    from torch.utils import _pytree as pytree

    output = Plain(a)
    assert pytree.tree_leaves(output) == [output]  # what replicate used to search
    assert _ids(find_tensors(output)) == [id(a)]


def test_container_holding_itself_ends_and_each_tensor_is_found_once() -> None:
    cyclic: list[object] = [a]
    cyclic.append(cyclic)
    shared = {"t": b}
    assert _ids(find_tensors([cyclic, shared, shared])) == _ids([a, b])


def test_strings_and_other_objects_are_not_entered() -> None:
    class Holder:
        def __init__(self) -> None:
            self.tensor = a

    assert find_tensors(["text", b"bytes", Holder(), 1.0]) == []
