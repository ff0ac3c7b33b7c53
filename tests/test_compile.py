"""Reading state from a forward pre-hook compiles without a graph break."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import attrs
import pytest
import torch
import torch._dynamo
from torch import nn

from torchcontract import contract


@attrs.frozen
class ScaleState:
    factor: float = 1.0


def _scale_input(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (args[0] * scale.state(module).factor,)


@contract(ScaleState)
def scale(module: nn.Module, *, factor: float) -> None:
    scale.set_state(module, ScaleState(factor))
    module.register_forward_pre_hook(_scale_input)


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    # Compiled code is cached per code object; each test starts and ends with none.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    compiled: Callable[[torch.Tensor], torch.Tensor] = torch.compile(
        module, fullgraph=True, backend="eager"
    )
    return compiled


def _linear(weight: float, bias: float) -> nn.Linear:
    layer = nn.Linear(1, 1)
    with torch.no_grad():
        layer.weight.fill_(weight)
        layer.bias.fill_(bias)
    return layer


def test_hook_reading_state_runs_under_fullgraph_compile() -> None:
    layer = _linear(weight=3.0, bias=1.0)
    scale(layer, factor=2.0)
    output = _compiled(layer)(torch.tensor([[5.0]]))
    # (5 * 2) * 3 + 1
    assert output.item() == 31.0


def test_compiled_hook_sees_a_record_updated_after_compiling() -> None:
    layer = _linear(weight=1.0, bias=0.0)
    scale(layer, factor=2.0)
    compiled = _compiled(layer)
    assert compiled(torch.tensor([[1.0]])).item() == 2.0
    scale.update(layer, lambda record: attrs.evolve(record, factor=10.0))
    assert compiled(torch.tensor([[1.0]])).item() == 10.0


def test_each_module_reads_its_own_record_under_compile() -> None:
    model = nn.Sequential(_linear(weight=1.0, bias=0.0), _linear(weight=1.0, bias=0.0))
    scale(model[0], factor=2.0)
    scale(model[1], factor=3.0)
    assert _compiled(model)(torch.tensor([[1.0]])).item() == 6.0


def test_fullgraph_compile_raises_on_a_graph_break_in_a_hook() -> None:
    # The control for the tests above: under fullgraph=True a break is an error, not a
    # silent fallback, so their passing means the state read traced into one graph.
    def breaking(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        torch._dynamo.graph_break()

    layer = _linear(weight=1.0, bias=0.0)
    layer.register_forward_pre_hook(breaking)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        _compiled(layer)(torch.tensor([[1.0]]))


# ----------------------------------------------------------------- per-step counters


@attrs.frozen
class StepState:
    """The documented pattern for a counter a compiled hook advances: a tensor, in place."""

    steps: torch.Tensor = attrs.field(factory=lambda: torch.zeros((), dtype=torch.int64))


def _count_step(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
    steps.state(module).steps.add_(1)


@contract(StepState)
def steps(module: nn.Module) -> None:
    module.register_forward_pre_hook(_count_step)


def test_tensor_counter_in_a_record_counts_every_forward_under_fullgraph_compile() -> None:
    model = nn.Sequential(_linear(weight=1.0, bias=0.0), _linear(weight=1.0, bias=0.0))
    steps(model[0])
    steps(model[1])
    compiled = _compiled(model)
    for _ in range(5):
        compiled(torch.tensor([[1.0]]))
    model(torch.tensor([[1.0]]))  # eager forwards count too
    assert steps.state(model[0]).steps.item() == 6
    assert steps.state(model[1]).steps.item() == 6  # each record has its own tensor


def _update_step(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
    scale.update(module, lambda record: attrs.evolve(record, factor=record.factor + 1))


def test_update_in_a_fullgraph_compiled_hook_is_unsupported_by_dynamo() -> None:
    # Documented: update() takes a lock and builds a frozen attrs record, and dynamo
    # traces neither. If a torch release lifts this, the README's advice can change.
    layer = _linear(weight=1.0, bias=0.0)
    scale(layer, factor=1.0)
    layer.register_forward_pre_hook(_update_step)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        _compiled(layer)(torch.tensor([[1.0]]))
    assert scale.state(layer).factor == 1.0


def test_update_between_compiled_steps_counts_every_step() -> None:
    layer = _linear(weight=1.0, bias=0.0)
    scale(layer, factor=1.0)
    compiled = _compiled(layer)
    for _ in range(4):
        compiled(torch.tensor([[1.0]]))
        scale.update(layer, lambda record: attrs.evolve(record, factor=record.factor + 1))
    assert scale.state(layer).factor == 5.0
