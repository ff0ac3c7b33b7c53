"""torchft replica groups on 127.0.0.1 for the torchft tests: one Lighthouse, a process per rank.

``run_replica_groups(plan)`` starts a torchft Lighthouse in this process and one
process per rank of each replica group; each rank trains a tiny model under a
torchft ``Manager`` (gloo, checkpoints sent live over the manager's group with
``PGTransport``) with one of four data-parallel paths:

- ``"replicate"``: ours, over torchft's ``ProcessGroupDummy(0, 1)``, with the
  communication hook torchft's ``DistributedDataParallel`` registers;
- ``"ddp"``: ``torchft.DistributedDataParallel``;
- ``"fully_shard"`` / ``"fsdp2"``: HSDP as torchft runs it, ours or PyTorch's
  ``fully_shard`` on the group's own 1-D mesh (its ranks form the default group),
  each module's ``set_all_reduce_hook`` averaging over the replica groups through
  ``manager.allreduce``.

With ``plan.kill_group`` set, every rank of that group SIGKILLs itself once its
manager has committed ``plan.kill_at`` steps; the group is started again and
recovers live from its peer. Each rank reports the losses of its committed steps,
its manager's step and its parameters (its shards under HSDP) at the end.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Final, cast

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._C._distributed_c10d import TCPStore

from torchcontract.apis.replicate import ReplicateModule, manager_allreduce_hook
from torchcontract.testing import free_port

if TYPE_CHECKING:
    from torchft.manager import Manager

KINDS: Final = ("replicate", "ddp", "fully_shard", "fsdp2")
INPUT: Final = 8


@attrs.frozen
class Plan:
    """One run: the path, the replica groups, the steps, who dies when, the settings."""

    kind: str
    steps: int = 6
    groups: int = 2
    ranks_per_group: int = 1
    kill_group: int | None = None
    kill_at: int = 2
    use_async_quorum: bool = False
    timeout: float = 60.0


@attrs.frozen
class RankReport:
    """What one rank of one start of a replica group measured."""

    group: int
    rank: int
    attempt: int
    losses: dict[int, float]  # committed step -> this rank's loss at it
    step: int
    batches_committed: int
    parameters: list[float]  # every parameter (its local shard under HSDP), flattened
    error: str = ""


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(INPUT, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )


def _batch(group: int, rank: int, step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(10_000 * group + 100 * rank + step)
    return torch.randn(4, INPUT, generator=generator), torch.randn(4, 4, generator=generator)


def _local(tensor: Tensor) -> Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _wrap(kind: str, model: nn.Sequential, manager: Manager, ranks: int) -> nn.Module:
    """Apply the plan's data-parallel path to ``model``; return what to call forward on."""
    from torchft.ddp import DistributedDataParallel as FTDistributedDataParallel
    from torchft.process_group import ProcessGroupDummy

    if kind == "ddp":
        return FTDistributedDataParallel(manager, model)
    if kind == "replicate":
        from torchcontract.apis import replicate

        # find_unused_parameters=True, as torchft's DistributedDataParallel passes it: the
        # buckets are then never rebuilt, so a recovering replica's equal its peers'.
        replicated = replicate(
            model, process_group=ProcessGroupDummy(0, 1), find_unused_parameters=True
        )
        # What torchft's DistributedDataParallel registers, under a public name: an
        # all-reduce through the manager, averaged over the replica groups in the step.
        cast(ReplicateModule, replicated).register_comm_hook(manager, manager_allreduce_hook)
        return replicated
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ranks,))
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        shard: Callable[..., object] = torch_fully_shard
    else:
        from torchcontract.apis import fully_shard

        shard = fully_shard
    for layer in model:
        if isinstance(layer, nn.Linear):
            shard(layer, mesh=mesh)
    shard(model, mesh=mesh)

    def all_reduce_hook(output: Tensor) -> None:
        manager.allreduce(output).wait()

    for module in model.modules():
        set_hook = getattr(module, "set_all_reduce_hook", None)
        if set_hook is not None:
            set_hook(all_reduce_hook)
    return model


@attrs.frozen
class _Start:
    """One rank of one start of a replica group, and where its peers meet."""

    plan: Plan
    group: int
    rank: int
    attempt: int  # 0, or 1 once the group was killed and started again
    store_port: int  # the group's store (and, under HSDP, its default group)
    lighthouse: str


def _train(start: _Start) -> RankReport:
    plan, group, rank, attempt = start.plan, start.group, start.rank, start.attempt
    store_port, lighthouse = start.store_port, start.lighthouse
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    timeout = timedelta(seconds=plan.timeout)
    store = TCPStore(
        "127.0.0.1",
        store_port,
        plan.ranks_per_group,
        is_master=rank == 0,
        wait_for_workers=False,
        timeout=timeout,
    )
    if plan.ranks_per_group > 1:
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=plan.ranks_per_group, timeout=timeout
        )
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def state_dict() -> dict[str, object]:
        # What a user writes; under HSDP each rank sends its own shards.
        return {"model": {name: _local(value) for name, value in model.state_dict().items()}}

    def load_state_dict(state: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                _local(parameter).copy_(state["model"][name])

    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg,
        min_replica_size=plan.groups,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=str(group),
        store_addr="127.0.0.1",
        store_port=store_port,
        rank=rank,
        world_size=plan.ranks_per_group,
        lighthouse_addr=lighthouse,
        hostname="127.0.0.1",
        use_async_quorum=plan.use_async_quorum,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")),
    )
    try:
        wrapped = _wrap(plan.kind, model, manager, plan.ranks_per_group)
        ft_optimizer = OptimizerWrapper(manager, optimizer)
        losses: dict[int, float] = {}
        while manager.current_step() < plan.steps:
            ft_optimizer.zero_grad()
            step = manager.current_step()
            x, y = _batch(group, rank, step)
            out: Tensor = wrapped(x)
            loss = (out - y).pow(2).mean()
            torch.autograd.backward(loss)
            ft_optimizer.step()  # steps the optimizer only if the manager commits
            if manager.current_step() == step + 1:
                losses[step] = loss.item()
            if plan.kill_group == group and attempt == 0 and manager.current_step() == plan.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        parameters = torch.cat(
            [_local(p).detach().reshape(-1) for p in model.parameters()]
        ).tolist()
        return RankReport(
            group,
            rank,
            attempt,
            losses,
            manager.current_step(),
            manager.batches_committed(),
            parameters,
        )
    finally:
        _leave_together(store, rank, plan)
        manager.shutdown(wait=False)


def _leave_together(store: TCPStore, rank: int, plan: Plan) -> None:
    """Hold the group's rank 0 until every rank of the group is past its last request.

    The group's manager server and its store live in rank 0's process: were rank 0 to
    shut them down as soon as its own last ``should_commit`` returned, a peer whose reply
    was still on the wire would fail with gRPC's "transport error". A rank that died
    meanwhile is waited for ``plan.timeout`` at most; a failed barrier hides no error of
    the training, which the rank has already raised or returned.
    """
    try:
        store.set(f"left/{rank}", "1")
        if rank == 0:
            keys = [f"left/{peer}" for peer in range(plan.ranks_per_group)]
            store.wait(keys, timedelta(seconds=plan.timeout))
    except RuntimeError:  # rank 0 (and its store) gone, or a peer that never came
        pass


def _rank_main(start: _Start, writer: Connection) -> None:
    torch.set_num_threads(1)
    # Where a rank hangs, on its stderr, before the parent gives up on it.
    faulthandler.dump_traceback_later(1.5 * start.plan.timeout, exit=False)
    try:
        report = _train(start)
    except BaseException as error:  # reported, not raised: the parent decides
        report = RankReport(
            start.group,
            start.rank,
            start.attempt,
            {},
            -1,
            -1,
            [],
            f"{type(error).__name__}: {error}",
        )
    writer.send(report)
    writer.close()
    # A peer may still be in the manager's last collectives: leave without tearing down.
    os._exit(0)


def _receive(reader: Connection) -> RankReport | None:
    """The rank's report if it sent one; None while it runs, or once it died without one."""
    try:
        if reader.poll(0.05):
            report: RankReport = reader.recv()
            return report
    except (EOFError, OSError):  # the rank died: its exit code tells how
        pass
    return None


def run_replica_groups(plan: Plan) -> list[RankReport]:
    """Run ``plan``; return the final report of every rank of every group, by (group, rank).

    Raises ``RuntimeError`` naming the ranks that failed or did not report within
    ``3 * plan.timeout`` seconds (they are killed).
    """
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=plan.groups, join_timeout_ms=1000
    )
    context = multiprocessing.get_context("spawn")
    running: dict[tuple[int, int], tuple[multiprocessing.process.BaseProcess, Connection, int]] = {}
    reports: dict[tuple[int, int], RankReport] = {}

    def start(group: int, attempt: int) -> None:
        port = free_port()
        for rank in range(plan.ranks_per_group):
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(
                target=_rank_main,
                args=(_Start(plan, group, rank, attempt, port, lighthouse.address()), writer),
                daemon=True,
            )
            process.start()
            writer.close()
            running[(group, rank)] = (process, reader, attempt)

    deadline = time.monotonic() + 3 * plan.timeout
    try:
        for group in range(plan.groups):
            start(group, 0)
        while running and time.monotonic() < deadline:
            restart: set[tuple[int, int]] = set()
            for key, (process, reader, attempt) in list(running.items()):
                report = _receive(reader)
                if report is not None:
                    reports[key] = report
                    process.join(5)
                    del running[key]
                elif not process.is_alive():
                    del running[key]
                    if process.exitcode == -signal.SIGKILL and attempt == 0:
                        restart.add((key[0], attempt + 1))
                    else:
                        reports[key] = RankReport(
                            *key, attempt, {}, -1, -1, [], f"exited with {process.exitcode}"
                        )
            for group, attempt in restart:
                # Start the group again once all of its ranks are gone.
                if not any(key[0] == group for key in running):
                    start(group, attempt)
                else:
                    for key in [k for k in running if k[0] == group]:
                        running[key][0].kill()
            time.sleep(0.05)
    finally:
        for process, reader, _ in running.values():
            process.kill()
            reader.close()
        lighthouse.shutdown()
    missing = sorted(running)
    failed = [report for report in reports.values() if report.error]
    if missing or failed:
        raise RuntimeError(
            f"torchft run {plan}: "
            + "; ".join(
                [f"group {g} rank {r} did not report in time" for g, r in missing]
                + [f"group {f.group} rank {f.rank}: {f.error}" for f in failed]
            )
        )
    return [reports[key] for key in sorted(reports)]
