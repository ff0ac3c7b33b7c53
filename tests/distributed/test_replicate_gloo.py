"""replicate on two gloo ranks: parity with DistributedDataParallel, and the rules.

One job runs every scenario on both ranks (starting ranks is the slow part) and
returns what each measured; each test asserts one behaviour on those results.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from torchcontract import (
    ContractError,
    IncompatibleAPIError,
    NoProcessGroupError,
    NotAppliedError,
    contract,
)
from torchcontract.apis import checkpoint, no_sync, rank_local, replicate
from torchcontract.testing import ModelCase, check_api_invariants, run_distributed

WORLD_SIZE = 2
TOLERANCE = 1e-6
Results = dict[str, Any]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.2)
        self.down = nn.Linear(32, 16)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = x + self.down(self.drop(torch.relu(self.up(self.norm(x)))))
        return out


class Net(nn.Module):
    """Embedding, residual blocks, a head; a buffer; optionally a branch only some ranks use."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 5)
        self.side = nn.Linear(16, 16)
        self.register_buffer("offset", torch.zeros(16))

    def forward(self, tokens: Tensor, use_side: bool = False) -> Tensor:
        x = self.embed(tokens) + self.offset
        for block in self.blocks:
            x = block(x)
        if use_side:
            x = self.side(x)
        out: Tensor = self.head(x).mean(dim=1)
        return out


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(100 * rank + step)
    return torch.randint(0, 20, (8, 6), generator=generator), torch.randn(8, 5, generator=generator)


def _loss(model: nn.Module, rank: int, step: int, seed: int, use_side: bool = False) -> Tensor:
    tokens, target = _batch(rank, step)
    torch.manual_seed(seed)
    out: Tensor = model(tokens, use_side)
    return (out - target).pow(2).mean()


def _gradient_gap(mine: nn.Module, theirs: nn.Module) -> float:
    """The largest gradient difference; a parameter must have a gradient in both or neither."""
    gap = 0.0
    for (name, a), (_, b) in zip(mine.named_parameters(), theirs.named_parameters(), strict=True):
        if a.grad is None and b.grad is None:
            continue
        if a.grad is None or b.grad is None:
            raise AssertionError(f"{name} has a gradient on one side only")
        gap = max(gap, float((a.grad - b.grad).abs().max()))
    return gap


def _parameter_gap(mine: nn.Module, theirs: nn.Module) -> float:
    return max(
        float((a - b).abs().max())
        for a, b in zip(mine.parameters(), theirs.parameters(), strict=True)
    )


def _train_both(
    rank: int,
    make_optimizer: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer],
    *,
    steps: int = 4,
    bucket_cap_mb: float = 25.0,
    checkpoint_blocks: bool = False,
    use_side: Callable[[int], bool] = lambda rank: False,
) -> tuple[float, float]:
    """Train replicate and DDP side by side; the largest gradient and parameter gaps.

    ``side`` is unused unless ``use_side(rank)``, so DDP must look for unused parameters.
    """
    model, reference = _net(), _net()
    if checkpoint_blocks:
        for block in model.blocks:
            checkpoint(block)
    replicate(model, find_unused_parameters=True, bucket_cap_mb=bucket_cap_mb)
    ddp = DistributedDataParallel(reference, find_unused_parameters=True)
    optimizers = [make_optimizer(model.parameters()), make_optimizer(ddp.parameters())]
    gap = 0.0
    for step in range(steps):
        seed = 1000 * rank + step
        torch.autograd.backward(_loss(model, rank, step, seed, use_side(rank)))
        torch.autograd.backward(_loss(ddp, rank, step, seed, use_side(rank)))
        gap = max(gap, _gradient_gap(model, reference))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return gap, _parameter_gap(model, reference)


def _sgd(parameters: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)


def _adam(parameters: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(parameters, lr=1e-2)


def _no_sync_gap(rank: int) -> tuple[float, int, bool]:
    """Two local micro-batches then a synced one, against DDP's no_sync."""
    model, reference = _net(), _net()
    replicate(model, find_unused_parameters=True)
    ddp = DistributedDataParallel(reference, find_unused_parameters=True)
    with no_sync(model):
        inside = replicate.state(model).sync_gradients
        for step in range(2):
            torch.autograd.backward(_loss(model, rank, step, step))
    with ddp.no_sync():
        for step in range(2):
            torch.autograd.backward(_loss(ddp, rank, step, step))
    torch.autograd.backward(_loss(model, rank, 2, 2))
    torch.autograd.backward(_loss(ddp, rank, 2, 2))
    return _gradient_gap(model, reference), replicate.state(model).step, inside


def _broadcast_result(rank: int) -> tuple[bool, bool]:
    """Rank 1 starts from other values; after apply every rank holds rank 0's."""
    model = _net()
    if rank == 1:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                tensor.add_(1.0)
    replicate(model, find_unused_parameters=True)
    flat = torch.cat([t.reshape(-1) for t in [*model.parameters(), *model.buffers()]])
    gathered = [torch.empty_like(flat) for _ in range(WORLD_SIZE)]
    dist.all_gather(gathered, flat)
    expected = torch.cat([t.reshape(-1) for t in [*_net().parameters(), *_net().buffers()]])
    return torch.equal(gathered[0], gathered[1]), torch.equal(flat, expected)


def _rule_messages() -> tuple[str, str]:
    first, second = _net(), _net()
    messages = []
    checkpoint(first.blocks[0], use_reentrant=True)
    try:
        replicate(first)
    except IncompatibleAPIError as error:
        messages.append(f"{type(error).__name__}: {error}")
    replicate(second)
    try:
        checkpoint(second.blocks[0], use_reentrant=True)
    except IncompatibleAPIError as error:
        messages.append(f"{type(error).__name__}: {error}")
    first_message, second_message = messages
    return first_message, second_message


def _freed_after_training(rank: int) -> bool:
    model = _net()
    for block in model.blocks:
        checkpoint(block)
    replicate(model, find_unused_parameters=True)
    torch.autograd.backward(_loss(model, rank, 0, 0))
    alive = weakref.ref(model)
    gc.disable()
    try:
        del model
        return alive() is None
    finally:
        gc.enable()


@contract()
def replicate_then_fail(module: nn.Module) -> None:
    replicate(module, find_unused_parameters=True)
    raise ValueError("planned failure after replicate installed its hooks")


def _rolled_back_hooks_gap(rank: int) -> tuple[bool, float]:
    """After a rolled-back apply the hooks stay but do nothing: gradients stay local."""
    model, local = _net(), _net()
    with contextlib.suppress(ValueError):
        replicate_then_fail(model)
    torch.autograd.backward(_loss(model, rank, 0, 0))
    torch.autograd.backward(_loss(local, rank, 0, 0))
    return replicate.is_applied(model), _gradient_gap(model, local)


def _sparse_gradient_error(rank: int) -> str:
    model = nn.EmbeddingBag(10, 4, sparse=True)
    replicate(model, find_unused_parameters=True)
    try:
        torch.autograd.backward(model(torch.tensor([[1, 2]])).sum())
    except ContractError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _same_data_inputs() -> tuple[Tensor, bool]:
    return _batch(0, 0)[0], False


def _parity_job(rank: int, world_size: int) -> Results:
    results: Results = {}
    results["sgd"] = _train_both(rank, _sgd)
    results["adam_small_buckets"] = _train_both(rank, _adam, bucket_cap_mb=0.001)
    results["checkpointed"] = _train_both(rank, _sgd, checkpoint_blocks=True)
    results["unused_on_one_rank"] = _train_both(rank, _sgd, use_side=lambda rank: rank == 0)
    results["no_sync"] = _no_sync_gap(rank)
    results["broadcast"] = _broadcast_result(rank)
    results["rules"] = _rule_messages()
    results["freed"] = _freed_after_training(rank)
    results["rolled_back"] = _rolled_back_hooks_gap(rank)
    results["sparse"] = _sparse_gradient_error(rank)
    model = _net()
    replicate(model, find_unused_parameters=True, bucket_cap_mb=0.001)
    state = replicate.state(model)
    results["buckets"] = state.buckets
    results["group_size"] = None if state.process_group is None else state.process_group.size()
    results["names"] = [name for name, _ in model.named_parameters()]
    results["invariants"] = check_api_invariants(replicate, ModelCase(_net, _same_data_inputs))
    return results


@pytest.fixture(scope="module")
def ranks() -> list[Results]:
    return run_distributed(_parity_job, WORLD_SIZE, timeout=120.0)


def test_gradients_match_ddp_over_steps_with_momentum(ranks: list[Results]) -> None:
    for rank in ranks:
        gradient_gap, parameter_gap = rank["sgd"]
        assert gradient_gap <= TOLERANCE
        assert parameter_gap <= TOLERANCE


def test_gradients_match_ddp_with_one_bucket_per_parameter_and_adam(ranks: list[Results]) -> None:
    for rank in ranks:
        gradient_gap, parameter_gap = rank["adam_small_buckets"]
        assert gradient_gap <= TOLERANCE
        assert parameter_gap <= TOLERANCE


def test_checkpointed_replicated_model_matches_unchecked_ddp(ranks: list[Results]) -> None:
    for rank in ranks:
        gradient_gap, parameter_gap = rank["checkpointed"]
        assert gradient_gap <= TOLERANCE
        assert parameter_gap <= TOLERANCE


def test_parameter_used_on_one_rank_matches_ddp_find_unused(ranks: list[Results]) -> None:
    for rank in ranks:
        gradient_gap, parameter_gap = rank["unused_on_one_rank"]
        assert gradient_gap <= TOLERANCE
        assert parameter_gap <= TOLERANCE


def test_no_sync_accumulation_matches_ddp_no_sync(ranks: list[Results]) -> None:
    for rank in ranks:
        gap, _, _ = rank["no_sync"]
        assert gap <= TOLERANCE


def test_no_sync_backwards_are_not_counted_as_steps(ranks: list[Results]) -> None:
    for rank in ranks:
        _, steps, sync_inside = rank["no_sync"]
        assert steps == 1
        assert sync_inside is False


def test_apply_broadcasts_rank_zero_parameters_and_buffers(ranks: list[Results]) -> None:
    for rank in ranks:
        ranks_agree, equal_to_rank_zero_init = rank["broadcast"]
        assert ranks_agree
        assert equal_to_rank_zero_init


def test_reentrant_checkpoint_then_replicate_fails_naming_both(ranks: list[Results]) -> None:
    for rank in ranks:
        message = rank["rules"][0]
        assert message.startswith("IncompatibleAPIError: torchcontract.apis.replicate.replicate")
        assert "torchcontract.apis.checkpoint.checkpoint" in message
        assert "on Block 'blocks.0', inside Net" in message


def test_replicate_then_reentrant_checkpoint_fails_naming_both(ranks: list[Results]) -> None:
    for rank in ranks:
        message = rank["rules"][1]
        assert message.startswith("IncompatibleAPIError: torchcontract.apis.checkpoint.checkpoint")
        assert "torchcontract.apis.replicate.replicate" in message
        assert "on Net, which contains Block 'blocks.0' of Net" in message


def test_model_is_freed_after_training_without_garbage_collection(ranks: list[Results]) -> None:
    assert all(rank["freed"] for rank in ranks)


def test_hooks_left_by_a_rolled_back_apply_do_not_synchronize(ranks: list[Results]) -> None:
    for rank in ranks:
        applied, gap_to_local = rank["rolled_back"]
        assert not applied
        assert gap_to_local == 0.0


def test_sparse_gradients_are_refused_with_advice(ranks: list[Results]) -> None:
    for rank in ranks:
        assert rank["sparse"] == (
            "ContractError: replicate on EmbeddingBag: parameter 'weight' has a sparse gradient, "
            "which replicate does not average; use dense gradients (e.g. "
            "nn.Embedding(sparse=False)) or DistributedDataParallel"
        )


def test_record_buckets_hold_every_fqn_once_in_reverse_order(ranks: list[Results]) -> None:
    for rank in ranks:
        names: list[str] = rank["names"]
        # Gradients arrive roughly last layer first, so the buckets, in launch order, take
        # the parameters from the last defined to the first (each in DDP's order inside).
        positions = [
            sorted((names.index(name) for name in bucket), reverse=True)
            for bucket in rank["buckets"]
        ]
        assert [index for bucket in positions for index in bucket] == list(
            reversed(range(len(names)))
        )
        assert len(rank["buckets"]) > 1  # a 1 KB cap splits this model


def test_record_holds_the_world_group(ranks: list[Results]) -> None:
    assert [rank["group_size"] for rank in ranks] == [WORLD_SIZE, WORLD_SIZE]


def test_replicate_passes_the_invariant_checks(ranks: list[Results]) -> None:
    for rank in ranks:
        report = rank["invariants"]
        assert report.parameters == len(rank["names"]) - 2  # side and its bias unused here
        assert report.gradient_difference <= TOLERANCE


# ----------------------------------------------------------------- in this process, no ranks


def test_replicate_without_a_process_group_fails_and_installs_nothing() -> None:
    assert not dist.is_initialized()
    model = _net()
    with pytest.raises(
        NoProcessGroupError, match=r"no default process group; call torch\.distributed"
    ):
        replicate(model)
    assert not replicate.is_applied(model)


def test_nonpositive_bucket_cap_is_rejected() -> None:
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive and finite, got 0"):
        replicate(_net(), bucket_cap_mb=0)


def test_no_sync_without_replicate_raises_not_applied() -> None:
    context = no_sync(_net())
    with pytest.raises(
        NotAppliedError, match=r"no_sync: neither replicate nor fully_shard is applied to Net"
    ):
        context.__enter__()


@pytest.mark.parametrize(
    ("value", "shown"), [("25", "str '25'"), (True, "bool True"), ([25], "list [25]")]
)
def test_bucket_cap_of_another_type_is_a_type_error_naming_it(value: object, shown: str) -> None:
    model = _net()
    with pytest.raises(TypeError) as raised:
        replicate(model, bucket_cap_mb=value)  # type: ignore[arg-type]
    assert str(raised.value) == (
        "replicate on Net: bucket_cap_mb takes a number of megabytes (int or float) or None, "
        f"got {shown}"
    )
    assert not replicate.is_applied(model)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1])
def test_infinite_nan_or_negative_bucket_cap_is_a_value_error(value: float) -> None:
    with pytest.raises(ValueError, match=r"bucket_cap_mb must be positive and finite, got"):
        replicate(_net(), bucket_cap_mb=value)


def test_process_group_of_another_type_is_a_type_error_naming_it() -> None:
    model = _net()
    with pytest.raises(TypeError) as raised:
        replicate(model, process_group="gloo")  # type: ignore[arg-type]
    assert str(raised.value) == (
        "replicate on Net: process_group takes a torch.distributed.ProcessGroup or None "
        "(the default group), got str 'gloo'; pass e.g. torch.distributed.new_group(ranks)"
    )
    assert not replicate.is_applied(model)


def test_broadcast_buffers_of_another_type_is_a_type_error_naming_it() -> None:
    with pytest.raises(
        TypeError, match=r"^replicate on Net: broadcast_buffers takes True or False, got str 'no'$"
    ):
        replicate(_net(), broadcast_buffers="no")  # type: ignore[arg-type]


def test_rank_local_without_replicate_raises_not_applied() -> None:
    context = rank_local(_net())
    with pytest.raises(NotAppliedError, match=r"replicate"):
        context.__enter__()
