"""replicate's communication hooks against DistributedDataParallel's, on 2 gloo ranks.

torch's hooks run unchanged (``allreduce_hook``, ``fp16_compress_hook``,
``powerSGD_hook`` and ``batched_powerSGD_hook`` with ``PowerSGDState``), and a
user hook that reads every method of the bucket and replaces its buffer. The
model's buckets are small (``bucket_cap_mb`` of a few KiB), so there are
several: a hook sees the same buckets (index, size, shapes, last one) as DDP's,
in the same order, and the gradients after every step equal DDP's with the
same hook, parameters used on one rank only included.

torch's hooks also run as DDP is called, with no keyword (DDP's defaults:
``find_unused_parameters=False``, so the buckets are rebuilt after the first
step, in the order gradients arrived, which PowerSGD's random matrices depend
on), every parameter used. The PowerSGD hooks run only so, with the default cap:
DDP's own PowerSGD on gloo hangs with several buckets, and aborts the process
with ``find_unused_parameters=True`` (its callbacks wait for all-reduces on
gloo's threads while DDP launches the next bucket's, or its map of used
parameters, in an order that differs by rank).
Where DDP's hook raises (torch 2.13's ``batched_powerSGD_hook`` hands a 2-D
matrix to a check for 3-D ones), replicate's raises the same error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import attrs
import pytest
import torch
from replicate_hook_recorder import CAP_MB, Net, Recorder, Seen, recording_hook, seeded_net
from torch import Tensor, nn
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from torchcontract.apis import _compat, replicate
from torchcontract.apis.replicate import ReplicateModule
from torchcontract.testing import run_distributed

STEPS: Final = 4


def _power_sgd(min_compression_rate: float = 2) -> powerSGD_hook.PowerSGDState:
    return powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=1,
        start_powerSGD_iter=2,
        min_compression_rate=min_compression_rate,
        random_seed=0,
    )


#: By name: a fresh state and the hook.
HOOKS: Final[dict[str, Callable[[], tuple[object, Callable[[Any, GradBucket], Any]]]]] = {
    "allreduce_hook": lambda: (None, default_hooks.allreduce_hook),
    "allreduce_hook, no keyword": lambda: (None, default_hooks.allreduce_hook),
    "fp16_compress_hook": lambda: (None, default_hooks.fp16_compress_hook),
    "fp16_compress_hook, no keyword": lambda: (None, default_hooks.fp16_compress_hook),
    "powerSGD_hook": lambda: (_power_sgd(), powerSGD_hook.powerSGD_hook),
    # Every bucket compressed: where DDP's defaults were not ours, this gave another result.
    "powerSGD_hook, min_compression_rate=0.5": lambda: (
        _power_sgd(0.5),
        powerSGD_hook.powerSGD_hook,
    ),
    "batched_powerSGD_hook": lambda: (_power_sgd(), powerSGD_hook.batched_powerSGD_hook),
    "recording_hook": lambda: (Recorder(), recording_hook),
    # DDP then starts from one bucket and rebuilds them in the order gradients arrived.
    "recording_hook, find_unused_parameters=False": lambda: (Recorder(), recording_hook),
}
if "bucket_cap_mb_list" in _compat.DDP_KEYWORDS:  # DDP 2.13 on; ours refuses it elsewhere
    HOOKS["recording_hook, bucket_cap_mb_list"] = lambda: (Recorder(), recording_hook)


def _keywords(name: str) -> tuple[dict[str, Any], bool]:
    """The keywords both sides take for ``name``, and whether every rank uses ``side``."""
    if "powerSGD" in name or name.endswith("no keyword"):
        return {}, True
    if name.endswith("find_unused_parameters=False"):
        return {"bucket_cap_mb": CAP_MB, "find_unused_parameters": False}, True
    if name.endswith("bucket_cap_mb_list"):
        return {"bucket_cap_mb_list": [CAP_MB / 2, CAP_MB], "find_unused_parameters": True}, False
    return {"bucket_cap_mb": CAP_MB, "find_unused_parameters": True}, False


def _train(model: nn.Module, raw: Net, rank: int, everywhere: bool) -> list[list[Tensor]]:
    """Train ``STEPS`` steps; ``side`` used on rank 0 only unless ``everywhere``."""
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
    grads: list[list[Tensor]] = []
    for step in range(STEPS):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * rank + step))
        model(x, everywhere or rank == 0).pow(2).mean().backward()
        grads.append([p.grad.clone() for p in raw.parameters() if p.grad is not None])
        optimizer.step()
        optimizer.zero_grad()
    return grads


@attrs.frozen
class Result:
    gap: float
    ours_seen: list[Seen]
    theirs_seen: list[Seen]
    #: The error each side raised (type and message), or ``""``.
    ours_error: str = ""
    theirs_error: str = ""


def _attempt(train: Callable[[], list[list[Tensor]]]) -> list[list[Tensor]] | str:
    try:
        return train()
    except Exception as error:  # compared with DDP's, whatever it is
        return f"{type(error).__name__}: {error}"


def _run(name: str, rank: int) -> Result:
    keywords, everywhere = _keywords(name)
    mine = replicate(seeded_net(), **keywords)
    assert isinstance(mine, ReplicateModule)
    our_state, hook = HOOKS[name]()
    mine.register_comm_hook(our_state, hook)
    ours = _attempt(lambda: _train(mine, mine, rank, everywhere))
    raw = seeded_net()
    ddp = DistributedDataParallel(raw, **keywords)
    their_state, hook = HOOKS[name]()
    ddp.register_comm_hook(their_state, hook)
    theirs = _attempt(lambda: _train(ddp, raw, rank, everywhere))
    if isinstance(ours, str) or isinstance(theirs, str):
        return Result(float("inf"), [], [], str(ours)[:200], str(theirs)[:200])
    gap = 0.0
    for a, b in zip(ours, theirs, strict=True):
        assert len(a) == len(b)
        gap = max(gap, *(float((x - y).abs().max()) for x, y in zip(a, b, strict=True)))
    seen = (
        (our_state.seen, their_state.seen)
        if isinstance(our_state, Recorder) and isinstance(their_state, Recorder)
        else ([], [])
    )
    return Result(gap, *seen)


def _job(rank: int, world_size: int) -> dict[str, Result]:
    return {name: _run(name, rank) for name in HOOKS}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Result]]:
    return run_distributed(_job, 2, timeout=120)


@pytest.mark.parametrize("name", list(HOOKS))
def test_gradients_equal_ddps_with_the_same_hook(
    results: list[dict[str, Result]], name: str
) -> None:
    for by_name in results:
        result = by_name[name]
        if result.theirs_error:
            assert result.ours_error == result.theirs_error
        else:
            assert not result.ours_error
            assert result.gap == 0.0, f"gradients differ from DDP's by {result.gap}"


@pytest.mark.parametrize("name", [name for name in HOOKS if name.startswith("recording")])
def test_a_hook_sees_ddps_buckets_in_ddps_order(
    results: list[dict[str, Result]], name: str
) -> None:
    for by_name in results:
        result = by_name[name]
        assert result.ours_seen == result.theirs_seen
        # Several buckets a step (after the first, which may hold one), or the order is untested.
        assert len(result.ours_seen) >= 1 + 3 * (STEPS - 1)
        last = [seen[0] for seen in result.ours_seen if seen[1]]
        assert len(last) == STEPS  # one last bucket a step
