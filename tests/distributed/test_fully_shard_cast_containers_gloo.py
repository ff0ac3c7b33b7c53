"""Mixed precision casts reach inside every container FSDP2's do, on 2 gloo ranks.

FSDP2 casts a forward's floating inputs to ``param_dtype`` and its outputs to
``output_dtype`` through torch's ``_apply_to_tensors``, which enters dataclasses,
dicts, named tuples and list, tuple or set subclasses. A dataclass left uncast would
run the model in the wrong dtype, silently where promotion hides it: an fp32 tensor
in a dataclass next to bf16 activations makes the whole output fp32. Each case
here compares the output's dtype, the loss and the gradient shards with FSDP2's,
bitwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from fully_shard_models import needs_reference_fully_shard
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.nn import functional

from torchcontract.apis import fully_shard
from torchcontract.testing import run_distributed

pytestmark = needs_reference_fully_shard

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
BF16_OUT_FP32 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)


@dataclasses.dataclass
class Output:
    logits: Tensor


@dataclasses.dataclass
class Inputs:
    x: Tensor
    bias: Tensor


class Pair(list[Tensor]):
    """A list subclass, which ``pytree`` sees as one leaf."""


class ReturnsDataclass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Output:
        return Output(self.linear(x))


class TakesDataclass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, inputs: Inputs) -> Tensor:
        out: Tensor = self.linear(inputs.x) + inputs.bias
        return out


class TakesListSubclass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, pair: Pair) -> Tensor:
        out: Tensor = self.linear(pair[0]) + pair[1]
        return out


#: name: (module, policy, its output from the batch (x, bias))
CASES: dict[
    str, tuple[type[nn.Module], MixedPrecisionPolicy, Callable[[Any, Tensor, Tensor], Tensor]]
] = {
    "dataclass output, output_dtype": (
        ReturnsDataclass,
        BF16_OUT_FP32,
        lambda model, x, bias: model(x).logits,
    ),
    "dataclass input": (
        TakesDataclass,
        BF16,
        lambda model, x, bias: model(Inputs(x.bfloat16(), bias)),
    ),
    "list subclass input": (
        TakesListSubclass,
        BF16,
        lambda model, x, bias: model(Pair([x, bias])),
    ),
}


def _run(rank: int, apply: Callable[..., Any], case: str) -> dict[str, Any]:
    module, policy, run = CASES[case]
    mesh = init_device_mesh("cpu", (2,))
    generator = torch.Generator().manual_seed(rank)
    x, bias, target = (torch.randn(3, n, generator=generator) for n in (8, 4, 4))
    torch.manual_seed(0)
    model = apply(module(), mesh=mesh, mp_policy=policy)
    out = run(model, x, bias)
    loss = functional.mse_loss(out, target.to(out.dtype))
    torch.autograd.backward(loss)
    return {
        "dtype": str(out.dtype),
        "loss": loss.item(),
        "grads": {
            name: cast(DTensor, parameter.grad).to_local().tolist()
            for name, parameter in model.named_parameters()
        },
    }


def _job(rank: int, world_size: int) -> dict[str, list[dict[str, Any]]]:
    return {
        case: [_run(rank, apply, case) for apply in (fully_shard, torch_fully_shard)]
        for case in CASES
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, list[dict[str, Any]]]]:
    return run_distributed(_job, 2, timeout=120)


@pytest.mark.parametrize("case", CASES)
def test_casts_as_fsdp2(ranks: list[dict[str, list[dict[str, Any]]]], case: str) -> None:
    for results in ranks:
        ours, theirs = results[case]
        assert ours == theirs
