"""replicate under Join against DistributedDataParallel's, with uneven inputs on 2 gloo ranks.

Rank 0 has 5 batches, rank 1 has 3: the joined rank meets the other's
collectives with zeros until it ends, then every rank takes the model of the
last to join. Both models run the same plan on the same data (BatchNorm buffers
included, which under Join are broadcast from the last rank not joined); the
gradients after every step, the parameters, buffers and gradients at the end
(with ``gradient_as_bucket_view``, the joined rank's left as they were), and the
errors of ``throw_on_early_termination`` must equal DDP's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Final

import attrs
import pytest
import torch
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join, Joinable
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from torchcontract.apis import replicate
from torchcontract.apis.replicate import ReplicateModule
from torchcontract.testing import run_distributed

BATCHES: Final = (5, 3)
FEATURES: Final = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


def _batch(rank: int, index: int) -> Tensor:
    return torch.randn(6, FEATURES, generator=torch.Generator().manual_seed(100 * rank + index))


@attrs.frozen
class Scenario:
    name: str
    #: The context the loop runs in, given the model (replicated, or DDP) and its optimizer.
    context: Callable[[Joinable, torch.optim.Optimizer], contextlib.AbstractContextManager[object]]
    zero: bool = False  # ZeroRedundancyOptimizer (itself a Joinable) instead of SGD
    hook: bool = False  # torch's allreduce_hook registered
    #: gradient_as_bucket_view, the gradients zeroed (not set to None) after each step
    views: bool = False


SCENARIOS: Final = (
    Scenario("join_method", lambda model, _: _join_method(model, True)),
    Scenario("divide_by_ranks_not_joined", lambda model, _: _join_method(model, False)),
    Scenario(
        "join_of_model_and_optimizer",
        lambda model, optimizer: Join([model, _joinable(optimizer)]),
        zero=True,
    ),
    Scenario("join_with_comm_hook", lambda model, _: Join([model]), hook=True),
    Scenario("disabled", lambda model, _: Join([model], enable=False)),
    Scenario("gradient_as_bucket_view", lambda model, _: _join_method(model, True), views=True),
)


def _joinable(optimizer: torch.optim.Optimizer) -> Joinable:
    assert isinstance(optimizer, ZeroRedundancyOptimizer)
    return optimizer


def _join_method(model: Joinable, divide: bool) -> contextlib.AbstractContextManager[object]:
    assert isinstance(model, (ReplicateModule, DistributedDataParallel))
    return model.join(divide_by_initial_world_size=divide)


@attrs.frozen
class Trace:
    grads: list[list[Tensor]]
    final: list[Tensor]


def _train(model: nn.Module, raw: nn.Module, scenario: Scenario, rank: int) -> Trace:
    optimizer: torch.optim.Optimizer = (
        ZeroRedundancyOptimizer(raw.parameters(), torch.optim.SGD, lr=0.1)
        if scenario.zero
        else torch.optim.SGD(raw.parameters(), lr=0.1)
    )
    assert isinstance(model, Joinable)
    grads: list[list[Tensor]] = []
    batches = BATCHES[rank] if scenario.name != "disabled" else min(BATCHES)
    with scenario.context(model, optimizer):
        for index in range(batches):
            model(_batch(rank, index)).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in raw.parameters() if p.grad is not None])
            optimizer.step()
            optimizer.zero_grad(set_to_none=not scenario.views)
    grads_left = [p.grad.clone() for p in raw.parameters() if p.grad is not None]
    final = [t.detach().clone() for t in (*raw.parameters(), *raw.buffers())] + grads_left
    return Trace(grads, final)


def _gap(mine: list[Tensor], theirs: list[Tensor]) -> float:
    assert len(mine) == len(theirs)
    return max((float((a - b).abs().max()) for a, b in zip(mine, theirs, strict=True)), default=0)


@attrs.frozen
class Gaps:
    grads: float
    final: float
    steps: int
    final_model: list[float]  # floats: tensors do not travel back from the ranks


def _run(scenario: Scenario, rank: int) -> Gaps:
    mine = replicate(_model(), gradient_as_bucket_view=scenario.views)
    if scenario.hook:
        assert isinstance(mine, ReplicateModule)
        mine.register_comm_hook(None, default_hooks.allreduce_hook)
    ours = _train(mine, mine, scenario, rank)
    raw = _model()
    ddp = DistributedDataParallel(
        raw, find_unused_parameters=True, gradient_as_bucket_view=scenario.views
    )
    if scenario.hook:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    theirs = _train(ddp, raw, scenario, rank)
    assert len(ours.grads) == len(theirs.grads)
    grads = max((_gap(a, b) for a, b in zip(ours.grads, theirs.grads, strict=True)), default=0.0)
    flat = [float(x) for t in ours.final for x in t.reshape(-1).tolist()]
    return Gaps(grads, _gap(ours.final, theirs.final), replicate.state(mine).step, flat)


def _job(rank: int, world_size: int) -> dict[str, Gaps]:
    return {scenario.name: _run(scenario, rank) for scenario in SCENARIOS}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Gaps]]:
    return run_distributed(_job, 2, timeout=120)


@pytest.mark.parametrize("name", [scenario.name for scenario in SCENARIOS])
def test_uneven_inputs_end_on_every_rank_with_ddps_numbers(
    results: list[dict[str, Gaps]], name: str
) -> None:
    for gaps in (by_name[name] for by_name in results):
        assert gaps.grads == 0.0, f"gradients differ from DDP's by {gaps.grads}"
        assert gaps.final == 0.0, f"the final model differs from DDP's by {gaps.final}"


@pytest.mark.parametrize("name", ["join_method", "join_with_comm_hook"])
def test_every_rank_ends_with_the_last_joiners_model(
    results: list[dict[str, Gaps]], name: str
) -> None:
    first, second = (by_name[name].final_model for by_name in results)
    assert first == second


def test_only_the_ranks_own_backwards_count_as_steps(results: list[dict[str, Gaps]]) -> None:
    assert [by_name["join_method"].steps for by_name in results] == list(BATCHES)


# ----------------------------------------------------------------- throw_on_early_termination


def _throwing(model: nn.Module, raw: nn.Module, rank: int) -> tuple[str, int]:
    """The error each rank raises, and how many batches it completed first."""
    assert isinstance(model, (ReplicateModule, DistributedDataParallel))
    done = 0
    try:
        with model.join(throw_on_early_termination=True):
            for index in range(BATCHES[rank]):
                model(_batch(rank, index)).sum().backward()
                done += 1
    except RuntimeError as error:
        return str(error), done
    return "", done


def _throw_job(rank: int, world_size: int) -> tuple[tuple[str, int], tuple[str, int]]:
    mine = replicate(_model())
    ours = _throwing(mine, mine, rank)
    raw = _model()
    theirs = _throwing(DistributedDataParallel(raw, find_unused_parameters=True), raw, rank)
    return ours, theirs


def test_throw_on_early_termination_raises_on_every_rank_as_ddp() -> None:
    for ours, theirs in run_distributed(_throw_job, 2, timeout=120):
        assert ours == theirs
        assert "exhausted" in ours[0]
