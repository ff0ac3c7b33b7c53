"""adapter(): a LoRA-style low-rank adapter on an nn.Linear, through a forward hook.

The adapter's weights are tensors in a frozen record, not parameters of the module:
the contract refuses an API that changes the module's parameter FQNs.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor, nn

from torchcontract import Application, contract


@attrs.frozen()
class AdapterState:
    """The adapter's rank, scale and weights (``down``: rank x in, ``up``: out x rank)."""

    rank: int = 0
    scale: float = 1.0
    down: Tensor | None = None
    up: Tensor | None = None


class _AdapterHook:
    """Adds the adapter's output; holds the application's handle, so a copy stays inert."""

    def __init__(self, application: Application[AdapterState]) -> None:
        self.application = application

    def __call__(self, module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> Tensor:
        record = self.application.record(module)
        if record is None:
            return output
        return output + adapted_output(record, args[0])


def adapted_output(record: AdapterState, inputs: Tensor) -> Tensor:
    """What the adapter adds to the layer's output for ``inputs``: ``scale * up(down(x))``."""
    if record.down is None or record.up is None:
        return torch.zeros(())
    hidden = torch.nn.functional.linear(inputs, record.down)
    return torch.nn.functional.linear(hidden, record.up) * record.scale


@contract(AdapterState)
def adapter(module: nn.Linear, *, rank: int, alpha: float = 1.0) -> None:
    """Add ``alpha / rank * up(down(x))`` to the output of ``module``; ``up`` starts at zero."""
    if rank < 1:
        raise ValueError(f"adapter: rank must be at least 1, got {rank}")
    down = torch.randn(rank, module.in_features) / rank
    up = torch.zeros(module.out_features, rank)
    adapter.set_state(module, AdapterState(rank, alpha / rank, down, up))
    module.register_forward_hook(_AdapterHook(adapter.application(module)))
