"""The aten ops one training step dispatches, ours beside FSDP2's: never more.

Each op is CPU work on every device (and a kernel launch on a GPU), so a count above
FSDP2's is step time lost wherever the step runs. The ranks are PyTorch's fake
process group (``fake_world``): rank 0 of a world of 1, 2 or 4, in this process, so
both implementations dispatch exactly what they would on a real group, and the
count is deterministic. The step counted is the third: the first two warm both up.
``profiler`` ops (FSDP2's ``record_function`` ranges) are not counted.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fake_world import fake_mesh
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn import functional
from torch.utils._python_dispatch import TorchDispatchMode

from torchcontract.apis import fully_shard
from torchcontract.apis._compat import REFERENCE_FULLY_SHARD_ON_CPU
from torchcontract.demo import GPT, GPTConfig, synthetic_batch

CONFIG = GPTConfig(dropout=0.0, layers=4)
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
CONFIGURATIONS = ("fp32", "bf16", "hsdp", "prefetch")


class OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch: untyped
    """Counts every op dispatched while it is active, by name (``profiler`` ops left out)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: object,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = str(func.overloadpacket)
        if not name.startswith("profiler."):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _sharded(library: str, configuration: str, mesh: DeviceMesh) -> GPT:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    apply: Callable[..., Any] = torch_fully_shard if library == "torch" else fully_shard
    keywords: dict[str, Any] = {"mesh": mesh}
    if configuration == "bf16":
        keywords["mp_policy"] = BF16
    for module in [*model.blocks, model]:
        apply(module, **keywords)
    if configuration == "prefetch":
        blocks: list[Any] = list(model.blocks)
        for current, following in itertools.pairwise(blocks):
            current.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([current])
    return model


def ops_per_step(library: str, configuration: str, mesh: DeviceMesh) -> Counter[str]:
    """The ops of the third training step of ``library``'s sharded GPT, by name."""
    model = _sharded(library, configuration, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    tokens, targets = synthetic_batch(CONFIG, 2, 0, 0)

    def step() -> None:
        logits: torch.Tensor = model(tokens)
        loss = functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)
        )
        torch.autograd.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    step()
    with OpCounter() as counter:
        step()
    counts: Counter[str] = counter.counts
    return counts


def _mesh(configuration: str, world: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """HSDP: 2 replicas of ``world`` shards; else ``world`` shards."""
    if configuration == "hsdp":
        return (2, world), ("replicate", "shard")
    return (world,), ("shard",)


@pytest.mark.skipif(
    not REFERENCE_FULLY_SHARD_ON_CPU,
    reason=f"PyTorch's fully_shard fails on CPU with torch {torch.__version__}",
)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_step_dispatches_no_more_ops_than_fsdp2(configuration: str, world: int) -> None:
    with fake_mesh(*_mesh(configuration, world)) as mesh:
        ours = ops_per_step("torchcontract", configuration, mesh)
        theirs = ops_per_step("torch", configuration, mesh)
    more = {name: count - theirs[name] for name, count in ours.items() if count > theirs[name]}
    assert sum(ours.values()) <= sum(theirs.values()), (
        f"{configuration} on {world} rank(s): {sum(ours.values())} ops per step against "
        f"FSDP2's {sum(theirs.values())}; more of: {more}"
    )


def test_counter_sees_each_op_of_a_step() -> None:
    """The counter is not blind: a plain model's step dispatches its matmuls, once each."""
    model = nn.Linear(4, 4)
    with OpCounter() as counter:
        model(torch.ones(2, 4)).sum().backward()
    assert counter.counts["aten.addmm"] == 1
    assert counter.counts["aten.mm"] == 1
