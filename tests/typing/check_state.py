"""Typing checks: state access is typed by the API's record class.

Checked, never run: by mypy (warn_unused_ignores) and basedpyright (strict, and the
directive below), so a line marked as an error that stops being one fails the check.
"""

# pyright: reportUnnecessaryTypeIgnoreComment=error

from __future__ import annotations

from typing import assert_type

import attrs
from torch import nn

from torchcontract import Application, EmptyState, contract


@attrs.frozen
class ScaleState:
    factor: float = 1.0
    calls: int = 0


@attrs.frozen
class OtherState:
    name: str = ""


@contract(ScaleState)
def scale(module: nn.Module, *, factor: float) -> None:
    pass


@contract()
def mark(module: nn.Module) -> None:
    pass


model = nn.Linear(2, 2)

assert_type(scale.state(model), ScaleState)
assert_type(scale.state(model).factor, float)
assert_type(scale.get_state(model), ScaleState | None)
assert_type(scale.update(model, lambda record: attrs.evolve(record, calls=1)), ScaleState)
assert_type(scale.is_applied(model), bool)
assert_type(scale.name, str)
assert_type(scale.state_cls, type[ScaleState])
assert_type(mark.state(model), EmptyState)

found = scale.get_state(model)
found.factor  # type: ignore[union-attr]
if found is not None:
    assert_type(found.factor, float)

scale.set_state(model, ScaleState(factor=2.0))
scale.set_state(model, OtherState())  # type: ignore[arg-type]
scale.set_state(model, None)  # type: ignore[arg-type]
scale.update(model, lambda record: OtherState())  # type: ignore[arg-type,return-value]
scale.update(model, lambda record: None)  # type: ignore[arg-type,return-value]
scale.state("model")  # type: ignore[arg-type]
mark.set_state(model, ScaleState())  # type: ignore[arg-type]


def to_other(record: ScaleState) -> OtherState:
    return OtherState()


def from_other(record: OtherState) -> ScaleState:
    return ScaleState()


scale.update(model, to_other)  # type: ignore[arg-type]
scale.update(model, from_other)  # type: ignore[arg-type]

# Records are frozen: a transition builds a new one.
scale.state(model).factor = 2.0  # type: ignore[misc]


# Application handles are typed by the record class too.
handle = scale.application(model)
assert_type(handle, Application[ScaleState])
assert_type(handle.record(model), ScaleState | None)
assert_type(mark.application(model).record(model), EmptyState | None)
other_handle: Application[OtherState] = scale.application(model)  # type: ignore[assignment]
