"""replicate over a process group torch.distributed never registered, as DDP takes one.

torchft hands DDP such groups (its ``ProcessGroupDummy(0, 1)``, its reconfigurable
gloo group): a ``ProcessGroup`` built from a store, with a backend registered on
it, that ``new_group`` never saw, so ``dist.get_rank(group)`` and
``dist.get_global_rank(group, ...)`` refuse it. DDP calls the group's own methods
and works; so does replicate, with the same numbers, with its check that the ranks
hold the same model kept (its message names group ranks), and with no default
group at all (a group of one rank, built in this process). A destroyed group is
still refused.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Final

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import HashStore, PrefixStore, Store
from torch.nn.parallel import DistributedDataParallel

from torchcontract import NoProcessGroupError
from torchcontract.apis import ModelMismatchError, replicate
from torchcontract.testing import run_distributed

STEPS: Final = 3
TIMEOUT: Final = 120.0
Results = dict[str, Any]


#: Every group built here, alive until the process ends. torch 2.6's ProcessGroupGloo joins
#: its worker threads in its destructor with the GIL held, while a worker that is still
#: dropping the last reference to a collective's tensor waits for the GIL: a group freed
#: right after a collective (at the end of a rank's job) deadlocks there, about one run in
#: ten. By the time the process ends, its workers hold nothing.
_KEPT: Final[list[dist.ProcessGroup]] = []


def unregistered_gloo_group(store: Store, rank: int, size: int) -> dist.ProcessGroup:
    """A gloo group built as torchft builds its own: from a store, never registered."""
    group = dist.ProcessGroup(store, rank, size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    backend = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=TIMEOUT))
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    _KEPT.append(group)
    return group


def _model(seed: int, width: int = 8) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 1))


def _train(model: nn.Module, raw: nn.Module, rank: int) -> list[float]:
    """Every parameter's values after each of ``STEPS`` steps, each rank on its own data."""
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
    seen: list[float] = []
    for step in range(STEPS):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * rank + step))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        seen.extend(torch.cat([p.detach().reshape(-1) for p in raw.parameters()]).tolist())
    return seen


def _job(rank: int, world_size: int) -> Results:
    store = PrefixStore("unregistered", dist.distributed_c10d._get_default_store())
    group = unregistered_gloo_group(store, rank, world_size)
    results: Results = {}
    # Different seeds: the broadcast from the group's first rank must make them agree.
    mine = _model(seed=rank)
    replicate(mine, process_group=group)
    results["mine"] = _train(mine, mine, rank)
    raw = _model(seed=rank)
    results["ddp"] = _train(DistributedDataParallel(raw, process_group=group), raw, rank)
    world = _model(seed=rank)
    replicate(world)
    results["world"] = _train(world, world, rank)
    try:
        replicate(_model(seed=0, width=8 + rank), process_group=group)
    except ModelMismatchError as error:
        results["mismatch"] = str(error)
    return results


@pytest.fixture(scope="module")
def ranks() -> list[Results]:
    return run_distributed(_job, world_size=2, timeout=TIMEOUT)


def test_replicate_over_an_unregistered_group_equals_ddp_over_it(ranks: list[Results]) -> None:
    for rank in ranks:
        assert len(rank["mine"]) == STEPS * sum(p.numel() for p in _model(0).parameters())
        assert rank["mine"] == rank["ddp"]


def test_replicate_over_an_unregistered_group_equals_replicate_over_the_world(
    ranks: list[Results],
) -> None:
    for rank in ranks:
        assert rank["mine"] == rank["world"]
    assert ranks[0]["mine"] == ranks[1]["mine"]


def test_different_models_over_an_unregistered_group_raise_naming_group_ranks(
    ranks: list[Results],
) -> None:
    for rank in ranks:
        message = rank["mismatch"]
        assert message.startswith("replicate on Sequential: the ranks hold different models")
        assert "float32 of shape (8, 4), requires grad on group rank 0" in message
        assert "float32 of shape (9, 4), requires grad on group rank 1" in message


# ----------------------------------------------------------------- in this process, no ranks


def test_replicate_takes_a_group_of_one_without_a_default_group() -> None:
    """torchft's DDP path: no init_process_group, a group of one rank that DDP takes."""
    assert not dist.is_initialized()
    mine, raw = _model(seed=0), _model(seed=0)
    replicate(mine, process_group=unregistered_gloo_group(HashStore(), 0, 1))
    ddp = DistributedDataParallel(raw, process_group=unregistered_gloo_group(HashStore(), 0, 1))
    assert _train(mine, mine, 0) == _train(ddp, raw, 0)
    assert replicate.state(mine).process_group is not None
    assert replicate.state(mine).step == STEPS


def test_replicate_without_a_group_still_needs_a_default_group() -> None:
    """As DDP, which raises a ValueError when there is no default group and no process_group."""
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"Default process group has not been initialized"):
        DistributedDataParallel(_model(seed=0))
    model = _model(seed=0)
    with pytest.raises(NoProcessGroupError, match=r"on Sequential: no default process group"):
        replicate(model)
    assert not replicate.is_applied(model)
