"""replicate against DistributedDataParallel(find_unused_parameters=True), off the happy path.

Each scenario is a plan of micro-steps per optimizer step: forwards and backwards
inside and outside ``no_sync``, parameters used on some ranks only, gradients
already present, backwards that never went through the model's forward, a second
backward through a retained graph, a backward on one rank alone, evaluation
forwards (on every rank, or on rank 0 alone through the replicated module, as
DDP's wrapper allows), BatchNorm buffers. Both models run the same plan on the
same data, one after the other; after every micro-step the gradients, and after
every optimizer step the parameters and buffers, must equal DDP's, and the ranks
must agree. One job per world size runs every scenario (starting ranks is the
slow part).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator
from typing import Final

import attrs
import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from torchcontract.apis import no_sync, replicate
from torchcontract.testing import run_distributed

TOLERANCE: Final = 1e-6
STEPS: Final = 6
FEATURES: Final = 6


class TwoPaths(nn.Module):
    """BatchNorm, then two branches ``a`` and ``b`` a forward may use or skip, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(FEATURES)
        self.a = nn.Linear(FEATURES, FEATURES)
        self.b = nn.Linear(FEATURES, FEATURES)
        self.head = nn.Linear(FEATURES, 1)

    def forward(self, x: Tensor, use: str = "ab") -> Tensor:
        h = self.norm(x)
        out: Tensor = self.head(sum((getattr(self, name)(h) for name in use), torch.zeros_like(h)))
        return out


#: How one micro-step runs: ``sync`` (forward and backward outside no_sync),
#: ``local`` (both inside), ``forward_local`` (forward inside, backward outside),
#: ``backward_local`` (forward outside, backward inside), ``retained`` (forward
#: outside, then two backwards through the same graph), ``direct`` (a backward
#: from a parameter, never through the forward), ``direct_rank0`` (the same, on
#: rank 0 alone), ``eval`` (a forward in eval mode without grad), ``eval_rank0``
#: (the same, on rank 0 alone, through the replicated module: DDP's wrapper serves it too).
KINDS: Final = (
    "sync",
    "local",
    "forward_local",
    "backward_local",
    "retained",
    "direct",
    "direct_rank0",
    "eval",
    "eval_rank0",
)


@attrs.frozen
class Micro:
    kind: str
    use: Callable[[int], str] = lambda rank: "ab"


@attrs.frozen
class Scenario:
    name: str
    plan: tuple[Micro, ...]
    # Build the model as a deep copy of a replicated prototype, which carries the
    # prototype's hooks along (torch copies hooks), then apply replicate to the copy.
    from_replicated_copy: bool = False


def _b_on_rank0(rank: int) -> str:
    return "ab" if rank == 0 else "a"


SCENARIOS: Final = (
    Scenario("plain", (Micro("sync"),)),
    Scenario("no_sync_unused", (Micro("local", lambda rank: "b"), Micro("sync", lambda r: "a"))),
    Scenario("grads_present", (Micro("sync"), Micro("sync", _b_on_rank0))),
    Scenario("unused_on_some_ranks", (Micro("sync", _b_on_rank0),)),
    Scenario("forward_local", (Micro("forward_local"), Micro("sync", lambda rank: "a"))),
    Scenario("backward_local", (Micro("backward_local"),)),
    Scenario("direct", (Micro("direct"), Micro("sync"))),
    Scenario("direct_rank0", (Micro("direct_rank0"), Micro("sync"))),
    Scenario("retained", (Micro("retained"), Micro("sync", lambda rank: "b"))),
    # After an evaluation forward DDP skips the next broadcast of buffers; so does replicate.
    Scenario("eval", (Micro("eval"), Micro("sync"))),
    # Rank 0's forward broadcasts buffers, met by the other ranks' next forward, in both.
    Scenario("eval_rank0", (Micro("eval_rank0"), Micro("sync"))),
    Scenario("deep_copy", (Micro("local", lambda rank: "b"), Micro("sync")), True),
)


def _model() -> TwoPaths:
    torch.manual_seed(0)
    return TwoPaths()


def _inputs(rank: int, step: int, micro: int) -> Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(8, FEATURES, generator=generator) * (rank + 1)


def _micro_step(
    model: nn.Module,
    sync_off: Callable[[], contextlib.AbstractContextManager[None]],
    raw: TwoPaths,
    micro: Micro,
    *,
    x: Tensor,
    rank: int,
) -> None:
    """Run one micro-step on ``model`` (replicated, or DDP around ``raw``)."""
    use = micro.use(rank)

    def loss() -> Tensor:
        out: Tensor = model(x, use)
        return out.pow(2).mean()

    kind = micro.kind
    if kind == "sync":
        torch.autograd.backward(loss())
    elif kind == "local":
        with sync_off():
            torch.autograd.backward(loss())
    elif kind == "forward_local":
        with sync_off():
            value = loss()
        torch.autograd.backward(value)
    elif kind == "backward_local":
        value = loss()
        with sync_off():
            torch.autograd.backward(value)
    elif kind == "retained":
        value = loss()
        torch.autograd.backward(value, retain_graph=True)
        torch.autograd.backward(value)
    elif kind == "direct" or (kind == "direct_rank0" and rank == 0):
        torch.autograd.backward(raw.a.weight.sum() * (rank + 1) / 100)
    elif kind == "eval" or (kind == "eval_rank0" and rank == 0):
        raw.eval()
        with torch.no_grad():
            model(x, use)
        raw.train()


def _gap(mine: list[Tensor | None], theirs: list[Tensor | None]) -> float:
    gap = 0.0
    for a, b in zip(mine, theirs, strict=True):
        if (a is None) != (b is None):
            return float("inf")  # a gradient on one side only
        if a is not None and b is not None:
            gap = max(gap, float((a.detach() - b.detach()).abs().max()))
    return gap


def _rank_spread(tensors: list[Tensor]) -> float:
    """The largest difference of these tensors between this rank and rank 0."""
    flat = torch.cat([tensor.detach().reshape(-1) for tensor in tensors])
    first = flat.clone()
    dist.broadcast(first, 0)
    return float((flat - first).abs().max())


@attrs.frozen
class Gaps:
    """The largest differences seen over a scenario, on one rank."""

    grads: float
    params: float
    buffers: float
    ranks_params: float
    # After a final evaluation forward, which broadcasts rank 0's buffers in both.
    ranks_buffers: float
    eval_output: float
    steps: int


def _snapshot(tensors: Iterable[Tensor | None]) -> list[Tensor | None]:
    return [None if tensor is None else tensor.detach().clone() for tensor in tensors]


@attrs.frozen
class Trace:
    """What one model went through: gradients after every micro-step, parameters and
    buffers after every optimizer step, then an evaluation forward's output."""

    grads: list[list[Tensor | None]]
    params: list[list[Tensor | None]]
    buffers: list[list[Tensor | None]]
    eval_output: Tensor
    ranks_params: float
    ranks_buffers: float


def _train(
    model: nn.Module,
    sync_off: Callable[[], contextlib.AbstractContextManager[None]],
    raw: TwoPaths,
    scenario: Scenario,
    rank: int,
) -> Trace:
    """Run the scenario's plan on ``model`` (replicated, or DDP around ``raw``)."""
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1, momentum=0.9)
    grads: list[list[Tensor | None]] = []
    params: list[list[Tensor | None]] = []
    buffers: list[list[Tensor | None]] = []
    ranks_params = 0.0
    for step in range(STEPS):
        for index, micro in enumerate(scenario.plan):
            _micro_step(model, sync_off, raw, micro, x=_inputs(rank, step, index), rank=rank)
            grads.append(_snapshot(p.grad for p in raw.parameters()))
        optimizer.step()
        optimizer.zero_grad()
        params.append(_snapshot(raw.parameters()))
        buffers.append(_snapshot(raw.buffers()))
        ranks_params = max(ranks_params, _rank_spread(list(raw.parameters())))
    raw.eval()
    with torch.no_grad():
        eval_output: Tensor = model(_inputs(rank, STEPS, 0))
    buffers.append(_snapshot(raw.buffers()))
    return Trace(
        grads, params, buffers, eval_output, ranks_params, _rank_spread(list(raw.buffers()))
    )


def _largest_gap(mine: list[list[Tensor | None]], theirs: list[list[Tensor | None]]) -> float:
    return max(_gap(a, b) for a, b in zip(mine, theirs, strict=True))


def _run(scenario: Scenario, rank: int) -> Gaps:
    """The scenario on replicate, then on DDP; the largest differences between the two.

    One model after the other, not micro-step by micro-step: where ranks run different
    forwards (eval_rank0) the two models' collectives would otherwise meet in different
    orders on different ranks.
    """
    mine, raw = _model(), _model()
    if scenario.from_replicated_copy:
        replicate(mine, find_unused_parameters=True)
        mine = copy.deepcopy(mine)
        assert len(mine._forward_hooks) == 1  # the prototype's, inherited
    replicate(mine, find_unused_parameters=True)
    ours = _train(mine, lambda: no_sync(mine), mine, scenario, rank)
    ddp = DistributedDataParallel(raw, find_unused_parameters=True)
    theirs = _train(ddp, ddp.no_sync, raw, scenario, rank)
    return Gaps(
        _largest_gap(ours.grads, theirs.grads),
        _largest_gap(ours.params, theirs.params),
        _largest_gap(ours.buffers, theirs.buffers),
        ours.ranks_params,
        ours.ranks_buffers,
        float((ours.eval_output - theirs.eval_output).abs().max()),
        replicate.state(mine).step,
    )


def _job(rank: int, world_size: int) -> dict[str, Gaps]:
    return {scenario.name: _run(scenario, rank) for scenario in SCENARIOS}


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def results(request: pytest.FixtureRequest) -> list[dict[str, Gaps]]:
    world_size: int = request.param
    return run_distributed(_job, world_size, timeout=120)


def _each(results: list[dict[str, Gaps]], name: str) -> Iterator[Gaps]:
    for by_scenario in results:
        yield by_scenario[name]


@pytest.mark.parametrize("name", [scenario.name for scenario in SCENARIOS])
def test_gradients_parameters_and_buffers_equal_ddp(
    results: list[dict[str, Gaps]], name: str
) -> None:
    for gaps in _each(results, name):
        assert gaps.grads <= TOLERANCE, f"gradients differ from DDP's by {gaps.grads}"
        assert gaps.params <= TOLERANCE, f"parameters differ from DDP's by {gaps.params}"
        assert gaps.buffers <= TOLERANCE, f"buffers differ from DDP's by {gaps.buffers}"
        assert gaps.eval_output <= TOLERANCE


@pytest.mark.parametrize("name", [scenario.name for scenario in SCENARIOS])
def test_ranks_stay_equal(results: list[dict[str, Gaps]], name: str) -> None:
    for gaps in _each(results, name):
        assert gaps.ranks_params <= TOLERANCE
        assert gaps.ranks_buffers <= TOLERANCE


def test_step_counts_only_synchronizing_backwards(results: list[dict[str, Gaps]]) -> None:
    per_step = {  # synchronizing backwards per optimizer step, by scenario
        "plain": 1,
        "no_sync_unused": 1,
        "grads_present": 2,
        "forward_local": 1,
        "backward_local": 1,
        "direct": 1,
        "direct_rank0": 1,
        "retained": 2,
        "eval": 1,
        "eval_rank0": 1,
        "deep_copy": 1,
    }
    for name, count in per_step.items():
        for gaps in _each(results, name):
            assert gaps.steps == count * STEPS, name
