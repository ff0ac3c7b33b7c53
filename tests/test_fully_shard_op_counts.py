"""The ops one training step dispatches, ours beside FSDP2's: never more, and its collectives.

Each op is CPU work on every device (and a kernel launch on a GPU), so a count above
FSDP2's is step time lost wherever the step runs. The ranks are PyTorch's fake
process group (``fake_world``): rank 0 of a world of 1, 2 or 4, in this process, so
both implementations dispatch exactly what they would on a real group, and the
count is deterministic. The step counted is the third: the first two warm both up.
``profiler`` ops (FSDP2's ``record_function`` ranges) are not counted. The
collectives (c10d's ops) are also listed in order with the reduce op each passes:
a sum where FSDP2 averages costs a division kernel more on a GPU, and NCCL's
average rounds as a premultiplied sum, not as a sum divided after.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from custom_comms import PlainAllGather, PlainReduceScatter
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
FP16 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)
CONFIGURATIONS = ("fp32", "bf16", "hsdp", "prefetch", "custom comms")
#: Where FSDP2 sums: float16's range (divided before and after), and sums asked for.
SUMMING = ("fp16", "force_sum")


class OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch: untyped
    """Counts every op dispatched while it is active, by name (``profiler`` ops left out).

    ``collectives``: each c10d op in order, with the reduce op it passed (its
    ``ReduceOp.RedOpType`` name), or None for one that reduces nothing.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counts: Counter[str] = Counter()
        self.collectives: list[tuple[str, str | None]] = []

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
        if name.startswith("c10d."):
            self.collectives.append((name, _reduce_op(args)))
        return func(*args, **(kwargs or {}))


_OP_NAMES: dict[int, str] = {
    op.value: name for name, op in dist.ReduceOp.RedOpType.__members__.items()
}


def _reduce_op(args: tuple[Any, ...]) -> str | None:
    """The name of the reduce op among a c10d op's arguments (a ``ReduceOp`` script object)."""
    for argument in args:
        if isinstance(argument, torch.ScriptObject) and "ReduceOp" in str(argument._type()):
            op: Callable[[], int] = getattr(argument, "op")  # noqa: B009 (a TorchScript method)
            return _OP_NAMES[op()]
    return None


def _sharded(library: str, configuration: str, mesh: DeviceMesh) -> GPT:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    apply: Callable[..., Any] = torch_fully_shard if library == "torch" else fully_shard
    keywords: dict[str, Any] = {"mesh": mesh}
    if configuration in ("bf16", "fp16"):
        keywords["mp_policy"] = BF16 if configuration == "bf16" else FP16
    for module in [*model.blocks, model]:
        apply(module, **keywords)
    if configuration == "custom comms":
        comms: list[Any] = [*model.blocks, model]
        for module in comms:
            module.set_custom_all_gather(PlainAllGather())
            module.set_custom_reduce_scatter(PlainReduceScatter())
    if configuration == "force_sum":
        sharded: list[Any] = [*model.blocks, model]
        for module in sharded:
            module.set_force_sum_reduction_for_comms(True)
    if configuration == "prefetch":
        blocks: list[Any] = list(model.blocks)
        for current, following in itertools.pairwise(blocks):
            current.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([current])
    return model


def ops_per_step(library: str, configuration: str, mesh: DeviceMesh) -> OpCounter:
    """What the third training step of ``library``'s sharded GPT dispatched."""
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
    counter = OpCounter()
    with counter:
        step()
    return counter


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
        ours = ops_per_step("torchcontract", configuration, mesh).counts
        theirs = ops_per_step("torch", configuration, mesh).counts
    more = {name: count - theirs[name] for name, count in ours.items() if count > theirs[name]}
    assert sum(ours.values()) <= sum(theirs.values()), (
        f"{configuration} on {world} rank(s): {sum(ours.values())} ops per step against "
        f"FSDP2's {sum(theirs.values())}; more of: {more}"
    )


@pytest.mark.skipif(
    not REFERENCE_FULLY_SHARD_ON_CPU,
    reason=f"PyTorch's fully_shard fails on CPU with torch {torch.__version__}",
)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("configuration", CONFIGURATIONS + SUMMING)
def test_step_sends_fsdp2s_collectives_with_its_reduce_ops(configuration: str, world: int) -> None:
    """Each collective, in order, with FSDP2's reduce op: averages where FSDP2's average."""
    with fake_mesh(*_mesh(configuration, world)) as mesh:
        ours = ops_per_step("torchcontract", configuration, mesh).collectives
        theirs = ops_per_step("torch", configuration, mesh).collectives
    assert ours == theirs
    reductions = {op for name, op in ours if "reduce" in name}
    if configuration != "hsdp" and world == 1:
        assert reductions == set()  # a shard group of one: nothing to reduce
    else:
        assert reductions == {"SUM" if configuration in SUMMING else "AVG"}


def test_counter_sees_each_op_of_a_step() -> None:
    """The counter is not blind: a plain model's step dispatches its matmuls, once each."""
    model = nn.Linear(4, 4)
    with OpCounter() as counter:
        model(torch.ones(2, 4)).sum().backward()
    assert counter.counts["aten.addmm"] == 1
    assert counter.counts["aten.mm"] == 1
