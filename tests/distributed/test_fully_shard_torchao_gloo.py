"""torchao's FSDP2 weights on 2 gloo ranks, beside FSDP2: float8 all-gathers and NF4 (QLoRA).

``convert_to_float8_training(..., enable_fsdp_float8_all_gather=True)`` makes each
linear weight a tensor subclass that all-gathers float8 data through FSDP2's
hooks; NF4 weights (frozen, under trainable low-rank adapters) gather their
quantized data, scalers and factors. Both train with each API for a few steps;
the tests compare losses and parameters bitwise, the all-gathers' sizes, and
count the hook calls. torchao is imported in the ranks only.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fully_shard_models import needs_reference_fully_shard
from fully_shard_recorder import Recorder
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from torchcontract.apis import fully_shard
from torchcontract.testing import run_distributed

pytestmark = needs_reference_fully_shard

Results = dict[str, Any]
APIS: dict[str, Callable[..., Any]] = {"ours": fully_shard, "torch": torch_fully_shard}


def _torchao(module: str) -> Any:
    """A torchao module (untyped), imported in the rank."""
    return importlib.import_module(f"torchao.{module}")


def _counting(kind: Any, calls: list[str]) -> None:
    """Count ``kind``'s pre-all-gather calls in ``calls`` (this rank only)."""
    original = kind.fsdp_pre_all_gather

    @functools.wraps(original)
    def counted(self: Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(type(self).__name__)
        return original(self, *args, **kwargs)

    kind.fsdp_pre_all_gather = counted


def _train(model: nn.Module, rank: int, dim: int) -> tuple[list[float], Recorder]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    torch.manual_seed(rank)
    inputs = torch.randn(16, dim)
    losses: list[float] = []
    recorder = Recorder()
    with recorder.recording():
        for _ in range(3):
            loss = model(inputs).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses, recorder


def _trainable(model: nn.Module) -> dict[str, list[Any]]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().tolist()
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def _float8(api: str, rank: int) -> Results:
    float8 = _torchao("float8")
    calls: list[str] = []
    _counting(_torchao("float8.fsdp_utils").WeightWithDynamicFloat8CastTensor, calls)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    float8.convert_to_float8_training(model, config=config)
    for linear in (model[0], model[2]):
        APIS[api](linear)
    APIS[api](model)
    losses, recorder = _train(model, rank, 32)
    gathers = [size for kind, size in recorder.collectives if kind == "all_gather"]
    return {"losses": losses, "full": _trainable(model), "gathers": gathers, "calls": len(calls)}


def _nf4(api: str, rank: int) -> Results:
    nf4 = _torchao("quantization.quantize_.workflows.nf4.nf4_tensor")

    class QLoRALinear(nn.Module):
        """A frozen NF4 weight under a trainable low-rank adapter."""

        def __init__(self, dim: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(nf4.to_nf4(torch.randn(dim, dim)), requires_grad=False)
            self.lora_a = nn.Linear(dim, 4, bias=False)
            self.lora_b = nn.Linear(4, dim, bias=False)

        def forward(self, x: Tensor) -> Tensor:
            output: Tensor = nf4.linear_nf4(x, self.weight) + self.lora_b(self.lora_a(x))
            return output

    calls: list[str] = []
    _counting(nf4.NF4Tensor, calls)
    torch.manual_seed(0)
    model = nn.Sequential(QLoRALinear(256), QLoRALinear(256))
    for layer in model:
        APIS[api](layer)
    APIS[api](model)
    losses, recorder = _train(model, rank, 256)
    gathers = [size for kind, size in recorder.collectives if kind == "all_gather"]
    return {"losses": losses, "full": _trainable(model), "gathers": gathers, "calls": len(calls)}


def _job(rank: int, world: int) -> dict[str, Results]:
    return {
        f"{name}/{api}": scenario(api, rank)
        for name, scenario in (("float8", _float8), ("nf4", _nf4))
        for api in APIS
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Results]]:
    pytest.importorskip("torchao")
    return run_distributed(_job, 2, timeout=240)


@pytest.mark.parametrize("scenario", ["float8", "nf4"])
def test_trains_as_fsdp2_to_the_bit(ranks: list[dict[str, Results]], scenario: str) -> None:
    for results in ranks:
        ours, theirs = results[f"{scenario}/ours"], results[f"{scenario}/torch"]
        assert ours["losses"] == theirs["losses"]
        assert ours["full"] == theirs["full"]


@pytest.mark.parametrize("scenario", ["float8", "nf4"])
def test_gathers_what_fsdp2_gathers(ranks: list[dict[str, Results]], scenario: str) -> None:
    for results in ranks:
        ours, theirs = results[f"{scenario}/ours"], results[f"{scenario}/torch"]
        assert ours["calls"] > 0
        assert ours["calls"] == theirs["calls"]
        assert ours["gathers"] == theirs["gathers"]


def test_float8_weights_travel_in_one_byte_per_element(ranks: list[dict[str, Results]]) -> None:
    # Each linear's group: its float8 weight (1 byte an element) and float32 bias (4 bytes)
    # in one byte-typed all-gather of this rank's halves.
    first = 32 * 64 // 2 + 4 * 64 // 2
    assert ranks[0]["float8/ours"]["gathers"][0] == first
