"""share_scale(): a list API; the roots of the list share one record."""

from __future__ import annotations

import attrs
from torch import nn

from torchcontract import contract


@attrs.frozen()
class ScaleState:
    """A factor shared by every module of one ``share_scale`` call."""

    factor: float = 1.0
    members: int = 0


@contract(ScaleState)
def share_scale(modules: list[nn.Linear], *, factor: float) -> None:
    """Record ``factor`` once for all ``modules``; an update through one is seen through all."""
    share_scale.update(
        modules[0], lambda record: attrs.evolve(record, factor=factor, members=len(modules))
    )
