"""The tensors in a forward's output, found where ``DistributedDataParallel`` finds them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import cast

from torch import Tensor

__all__ = ["find_tensors"]


def find_tensors(output: object) -> list[Tensor]:
    """Every tensor in ``output``: itself, or inside lists, tuples, mappings and dataclasses.

    DDP's ``_find_tensors`` looks in lists and tuples (namedtuples too), dicts and
    dataclasses, nested in any order; so does this walk, which also takes any
    ``Mapping``. Hugging Face's ``ModelOutput``, an ``OrderedDict`` and a dataclass
    at once, is read as a mapping, as DDP reads it. ``torch.utils._pytree`` is no
    substitute: it leaves a plain dataclass whole, so the tensors in it would be
    missed. One walk, without recursion; a container met again (shared, or holding
    itself) is not entered twice, so the walk ends on any output.
    """
    if isinstance(output, Tensor):
        return [output]
    found: list[Tensor] = []
    pending: list[object] = [output]
    entered: set[int] = set()
    while pending:
        item = pending.pop()
        if isinstance(item, Tensor):
            found.append(item)
            continue
        key = id(item)
        if key in entered:
            continue
        if isinstance(item, (list, tuple)):
            pending.extend(cast("Iterable[object]", item))
        elif isinstance(item, Mapping):
            pending.extend(cast("Mapping[object, object]", item).values())
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            pending.extend(getattr(item, field.name) for field in dataclasses.fields(item))
        else:
            continue
        entered.add(key)
    return found
