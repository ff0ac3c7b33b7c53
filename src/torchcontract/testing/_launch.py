"""run_distributed(): run a function on N local ranks of a gloo process group.

The ranks' side is here (join the group, run the function, report); the parent's
wait for the reports, and the choice of which failure to raise, is in ``_collect``.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import random
import shutil
import socket
import tempfile
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Final, Literal, overload

import attrs
import torch
import torch.distributed as dist
from typing_extensions import TypeVar, TypeVarTuple

from ._collect import DUMP_SIGNAL, Failure, collect, name_of, stack_path
from ._main_guard import check_main_guard
from ._torch import barrier

__all__ = ["StartMethod", "free_port", "run_distributed"]

_R = TypeVar("_R")
_Ts = TypeVarTuple("_Ts")

#: How ranks start: ``"forkserver"`` (fast, where the platform has it) or ``"spawn"``.
StartMethod = Literal["forkserver", "spawn"]
"""How ``run_distributed`` starts ranks: ``"forkserver"`` (fast, where the platform has it)
or ``"spawn"``."""

#: Imported once by the fork server, so each rank starts in milliseconds, not seconds.
_PRELOAD: Final = ["torch", "torch.distributed", "torchcontract.apis"]


#: Where ``free_port`` looks first: below the ports the system hands out on its own.
_LOWEST_PORT: Final = 10_000
_EPHEMERAL_RANGE: Final = "/proc/sys/net/ipv4/ip_local_port_range"
_pick: Final = random.SystemRandom()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound and released).

    Drawn at random below the system's ephemeral range where the system says what that
    is (Linux): a port from that range is what every connecting socket and every
    ``bind(0)`` takes, gloo's among them, so one found free there can be taken by
    another process before it is used. Elsewhere, the port the system gives to
    ``bind(0)``.

    Returns:
        The port number; another process may take it before it is used, so bind it
            soon.
    """
    try:
        with open(_EPHEMERAL_RANGE, encoding="ascii") as ranges:
            first_ephemeral = int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = _LOWEST_PORT
    for _ in range(100 if first_ephemeral > _LOWEST_PORT else 0):
        port = _pick.randrange(_LOWEST_PORT, first_ephemeral)
        if _bindable(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        found: int = probe.getsockname()[1]
        return found


def _bindable(port: int) -> bool:
    """Whether a listening socket could bind ``port`` on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@overload
def run_distributed(
    fn: Callable[[int, int], _R],
    world_size: int = ...,
    *,
    timeout: float = ...,
    start_method: StartMethod | None = ...,
    threads_per_rank: int | None = ...,
    grace: float = ...,
) -> list[_R]: ...
@overload
def run_distributed(
    fn: Callable[[int, int, *_Ts], _R],
    world_size: int = ...,
    *,
    timeout: float = ...,
    args: tuple[*_Ts],
    start_method: StartMethod | None = ...,
    threads_per_rank: int | None = ...,
    grace: float = ...,
) -> list[_R]: ...
def run_distributed(
    fn: Callable[..., _R],
    world_size: int = 2,
    *,
    timeout: float = 60.0,
    args: tuple[object, ...] = (),
    start_method: StartMethod | None = None,
    threads_per_rank: int | None = None,
    grace: float = 1.0,  # _collect.GRACE_SECONDS, written out for the reference
) -> list[_R]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks; return results by rank.

    Each rank is a new process in a gloo process group on 127.0.0.1 (a free port,
    ``tcp://`` rendezvous), so ``fn`` and ``args`` must pickle: ``fn`` is a
    module-level function, and so are the results. Each rank destroys the group
    after reporting its result: once every rank's ``fn`` returned (they meet at a
    barrier first: taking a group down while a peer still uses it can hang), or when
    ``fn`` raises; a rank still tearing down when all have reported is stopped.
    ``start_method`` is ``"forkserver"`` where the platform has it (ranks fork from
    a server that imported torch once, with ``spawn``'s isolation, in milliseconds
    instead of seconds; they see the environment variables of when the server
    started) and ``"spawn"`` otherwise. Either way each rank imports the script the
    program started with again, so a script must call ``run_distributed`` under
    ``if __name__ == "__main__":`` (a call that import would reach is refused with
    ``UnguardedMainError``, before any rank starts).
    Each rank uses ``threads_per_rank`` intra-op threads (default: the CPUs
    shared evenly).

    If a rank raises, its exception is re-raised here with a note naming the rank
    and, as ``__cause__``, a ``RankFailedError`` holding the rank's traceback text;
    the other ranks are killed. Of several failures, the root cause is raised (an
    exception from ``fn``, or a rank exiting without a report, before the connection
    errors its peers get when it leaves) and the others are added to it as notes:
    those reported within ``grace`` seconds of the first failure of that kind.

    Args:
        fn: A module-level function ``fn(rank, world_size, *args)``.
        world_size: How many ranks to start.
        timeout: Seconds for all ranks to report; then every rank's stack is shown and
            the ranks are killed.
        args: More arguments for ``fn``, the same on every rank; they must pickle.
        start_method: How ranks start; ``"forkserver"`` where the platform has it.
        threads_per_rank: Intra-op threads per rank; by default the CPUs shared evenly.
        grace: Seconds the other ranks have to report once a rank failed, before they
            are killed: long enough, and the notes show how each of them failed (a
            rank blocked in a collective with a dead peer fails within ``timeout``).

    Returns:
        What ``fn`` returned on each rank, by rank.

    Raises:
        RankFailedError: A rank died without reporting, or its exception does not
            pickle (otherwise the rank's own exception is raised, with this as its
            ``__cause__``).
        TimeoutError: The ranks were not all done within ``timeout`` seconds; the
            message shows every hung rank's stack.
        ValueError: ``world_size`` is less than 1, or ``grace`` is negative.
        TypeError: ``fn`` or ``args`` do not pickle.
        UnguardedMainError: Called from a script's top level outside
            ``if __name__ == "__main__":``, where each rank's import of the script would
            call it again.
    """
    if world_size < 1:
        raise ValueError(f"run_distributed: world_size must be at least 1, got {world_size}")
    if grace < 0:
        raise ValueError(f"run_distributed: grace must be at least 0 seconds, got {grace:g}")
    try:
        pickle.dumps((fn, args))
    except Exception as error:
        raise TypeError(
            f"run_distributed: {name_of(fn)} or its args do not pickle "
            f"({error}); pass a module-level function and picklable arguments"
        ) from error
    context = _context(start_method)
    check_main_guard(context.get_start_method())
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    port = free_port()
    stacks = tempfile.mkdtemp(prefix="run_distributed_stacks_")
    processes: list[BaseProcess] = []
    readers: list[Connection] = []
    try:
        for rank in range(world_size):
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(
                target=_rank_main,
                args=(_Job(fn, args, world_size, port, timeout, threads, stacks), rank, writer),
                name=f"rank-{rank}",
                daemon=True,
            )
            process.start()
            writer.close()
            processes.append(process)
            readers.append(reader)
        outcomes = collect(fn, processes, readers, timeout, stacks, grace=grace)
    finally:
        _stop(processes)
        for reader in readers:
            reader.close()
        shutil.rmtree(stacks, ignore_errors=True)
    return [outcomes[rank] for rank in range(world_size)]


def _context(start_method: StartMethod | None) -> Any:
    if start_method is None:
        available = multiprocessing.get_all_start_methods()
        start_method = "forkserver" if "forkserver" in available else "spawn"
    context = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        context.set_forkserver_preload(_PRELOAD)
    return context


@attrs.frozen
class _Job:
    """What every rank of one ``run_distributed`` call runs, and where the group meets."""

    fn: Callable[..., object]
    args: tuple[object, ...]
    world_size: int
    port: int
    timeout: float
    threads: int
    stacks: str  # the directory where a rank writes its stacks when asked (DUMP_SIGNAL)


def _rank_main(job: _Job, rank: int, writer: Connection) -> None:
    """The body of one rank: join the group, run the function, send back its result or error."""
    torch.set_num_threads(job.threads)
    if DUMP_SIGNAL is not None:
        # Where a hung rank is, for the TimeoutError: every thread's stack, on request.
        stack_file = open(stack_path(job.stacks, rank), "w")  # noqa: SIM115 (lives as the rank)
        faulthandler.register(DUMP_SIGNAL, file=stack_file, all_threads=True)
        # And where a rank that dies of a fatal signal (SIGSEGV, SIGABRT from a native
        # library) was: its stacks, which run_distributed adds to RankFailedError.
        faulthandler.enable(file=stack_file, all_threads=True)
    try:
        try:
            # Pickled here, by value: multiprocessing's own pickler would share a tensor's
            # memory with the parent, which this rank frees as it exits.
            writer.send_bytes(pickle.dumps((rank, *_run_rank(job, rank))))
        except BaseException as error:  # the function's result does not pickle
            writer.send_bytes(pickle.dumps((rank, False, Failure.of(error, in_function=True))))
        finally:
            writer.close()
    finally:
        # Only after the report: a teardown that hangs (torch 2.6's gloo did, now and then)
        # holds up no result, and run_distributed stops the rank once all have reported.
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_rank(job: _Job, rank: int) -> tuple[bool, object]:
    """Join the group and run the function: ``(True, result)`` or ``(False, Failure)``."""
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{job.port}",
            rank=rank,
            world_size=job.world_size,
            timeout=timedelta(seconds=job.timeout),
        )
    except BaseException as error:
        return False, Failure.of(error, in_function=False)
    # Each failure is described here, before the group goes down and the other ranks
    # fail in turn; whether it came from ``fn`` decides which one run_distributed raises.
    try:
        result = job.fn(rank, job.world_size, *job.args)
    except BaseException as error:
        return False, Failure.of(error, in_function=True)
    try:
        # Every rank is done with the group before any takes it down: destroying it
        # while a peer still uses it can hang (torch 2.6's gloo does, now and then).
        barrier()
    except BaseException as error:  # a peer failed or died after its own ``fn``
        return False, Failure.of(error, in_function=False)
    return True, result


def _stop(processes: list[BaseProcess]) -> None:
    """Join finished ranks; terminate, then kill, any still running."""
    for process in processes:
        process.join(0.5)
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join(2.0)
