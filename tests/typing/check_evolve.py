"""Typing checks: ``attrs.evolve`` inside ``update`` is checked field by field.

This holds under mypy, whose attrs plugin types ``evolve`` from the record class.
pyright types ``evolve`` as ``(inst: T, **changes: Any) -> T``, so it cannot see a
wrong field; that is why this file, unlike the others here, does not ask basedpyright
to report ``type: ignore`` comments it finds unnecessary.
"""

from __future__ import annotations

from typing import assert_type

import attrs
from torch import nn

from torchcontract import contract


@attrs.frozen
class ScaleState:
    factor: float = 1.0
    calls: int = 0


@contract(ScaleState)
def scale(module: nn.Module, *, factor: float) -> None:
    scale.update(module, lambda record: attrs.evolve(record, factor=factor))


model = nn.Linear(2, 2)

assert_type(scale.update(model, lambda record: attrs.evolve(record, calls=2)), ScaleState)
scale.update(model, lambda record: attrs.evolve(record, scale=2.0))  # type: ignore[call-arg]
scale.update(model, lambda record: attrs.evolve(record, calls="2"))  # type: ignore[arg-type]
scale.update(model, lambda record: attrs.evolve(record, factor=None))  # type: ignore[arg-type]
