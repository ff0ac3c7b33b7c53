"""The parent's side of ``run_distributed``: wait for every rank's report, name the root cause.

A rank that fails usually takes its peers down with it: they fail in turn, in a
collective or in the closing barrier, with a connection error. So each failure is
reported with where it happened, and the one raised first in cause is raised: an
exception from the rank's function, or a rank that exited without reporting, comes
before a peer's connection error, whichever reached the parent first.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Final

import attrs
import torch.distributed as dist

__all__ = ["DUMP_SIGNAL", "GRACE_SECONDS", "Failure", "RankFailedError", "collect", "stack_path"]

#: How long, by default, the other ranks may still report after a root cause is in,
#: before they are killed: it only gathers their failures for the notes.
GRACE_SECONDS: Final = 1.0
#: How long the other ranks may report while only secondary failures are in: the rank
#: whose failure caused them has failed already, but a busy machine may be slow to
#: show it (its report or its exit), and it must not be killed before it does.
CAUSE_GRACE_SECONDS: Final = 15.0

#: Words of the errors a rank gets when a peer left the group (gloo's transport errors,
#: torch's store and network errors): a consequence, not a cause.
_PEER_ERROR_WORDS: Final = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Connection refused",
    "Socket closed",
    "Timed out",
    "timed out",
)


class RankFailedError(RuntimeError):
    """A rank failed: it died, or raised; its message holds the rank's traceback text.

    Raised as is when the rank's own exception cannot be re-raised (it died, or its
    exception does not pickle); otherwise it is the ``__cause__`` of that exception.
    """


RankFailedError.__module__ = "torchcontract.testing"


def is_peer_error(error: BaseException) -> bool:
    """Whether ``error`` is what a rank gets when another rank left the group."""
    if isinstance(error, dist.DistError):
        return True
    message = str(error)
    return isinstance(error, RuntimeError) and any(w in message for w in _PEER_ERROR_WORDS)


@attrs.frozen
class Failure:
    """How a rank failed: traceback text, the pickled exception if it pickles, when, and
    whether it is likely a consequence of a peer's failure (``secondary``): an error from
    joining the group or from the closing barrier, or a peer's connection error."""

    text: str
    pickled: bytes | None
    raised_at: float
    secondary: bool

    @classmethod
    def of(cls, error: BaseException, *, in_function: bool) -> Failure:
        """The failure of ``error``, raised in the rank's function or around it."""
        raised_at = time.time()
        secondary = not in_function or is_peer_error(error)
        text = "".join(traceback.format_exception(error))
        try:
            pickled = pickle.dumps(error)
            pickle.loads(pickled)
        except Exception:
            return cls(text, None, raised_at, secondary)
        return cls(text, pickled, raised_at, secondary)


def collect(
    fn: Callable[..., object],
    processes: list[BaseProcess],
    readers: list[Connection],
    timeout: float,
    stacks: str,
    *,
    grace: float = GRACE_SECONDS,
) -> dict[int, Any]:
    """Wait for every rank's report; raise the root-cause failure, or TimeoutError at the deadline.

    Once a failure that is not secondary (see ``Failure``) is in, the others have
    ``grace`` seconds to report; while only secondary ones are in,
    ``CAUSE_GRACE_SECONDS`` (or ``grace``, if longer). The one raised is the first,
    by time, of the failures that are not secondary, else the first of all; the
    others are added to it as notes. The TimeoutError ends with where each hung
    rank was: its threads' stacks.
    """
    world_size = len(processes)
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    failures: list[tuple[bool, float, int, BaseException]] = []
    pending = dict(enumerate(readers))
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if failures:
                break
            hung = sorted(pending)
            raise TimeoutError(
                f"run_distributed: ranks {hung} of {world_size} did not finish "
                f"{name_of(fn)} within {timeout:g} s and were killed"
                + _stacks_of(hung, processes, stacks)
            )
        waiting: dict[object, int] = {processes[rank].sentinel: rank for rank in pending}
        waiting.update({reader: rank for rank, reader in pending.items()})
        for item in wait([*pending.values(), *(processes[r].sentinel for r in pending)], remaining):
            rank = waiting[item]
            if rank not in pending:
                continue
            reader = pending[rank]
            if reader.poll():
                try:
                    _, ok, payload = pickle.loads(reader.recv_bytes())
                except EOFError:
                    ok, payload = False, None
            else:
                ok, payload = False, None
            del pending[rank]
            if ok:
                results[rank] = payload
                continue
            if isinstance(payload, Failure):
                secondary, raised_at = payload.secondary, payload.raised_at
            else:  # it died without reporting: a cause, never a consequence
                secondary, raised_at = False, time.time()
            error = _error_of(rank, world_size, processes[rank], payload, stacks)
            failures.append((secondary, raised_at, rank, error))
            wait_more = max(CAUSE_GRACE_SECONDS, grace) if secondary else grace
            deadline = min(deadline, time.monotonic() + wait_more)
    if failures:
        (_, _, _, first), *others = sorted(failures, key=lambda failure: failure[:3])
        for _, _, other_rank, other in others:
            first.add_note(f"then rank {other_rank} failed: {type(other).__name__}: {other}")
        raise first
    return results


def _error_of(
    rank: int, world_size: int, process: BaseProcess, payload: object, stacks: str
) -> BaseException:
    """The exception to raise for a rank that reported ``payload`` (None: it reported nothing).

    A rank that died of a fatal signal left its stacks in its stack file
    (``faulthandler``): they end the message, as a hung rank's do.
    """
    if not isinstance(payload, Failure):
        process.join(5.0)  # it is gone (its pipe closed or its sentinel fired): reap it
        stack = _written_stack(stacks, rank)
        return RankFailedError(
            f"run_distributed: rank {rank} of {world_size} exited with code {process.exitcode} "
            "without reporting a result" + (f"; it was at:\n{stack}" if stack else "")
        )
    remote = RankFailedError(f"rank {rank} of {world_size} raised:\n{payload.text}")
    if payload.pickled is None:
        return remote
    error: BaseException = pickle.loads(payload.pickled)
    error.__cause__ = remote
    error.add_note(f"raised on rank {rank} of {world_size}; the cause above is its traceback")
    return error


def name_of(fn: Callable[..., object]) -> str:
    """``fn``'s qualified name, for messages."""
    return str(getattr(fn, "__qualname__", repr(fn)))


# --------------------------------------------------------------------- hung ranks

#: The signal that makes a rank write its stacks (POSIX only; None elsewhere).
DUMP_SIGNAL: Final[signal.Signals | None] = getattr(signal, "SIGUSR1", None)
#: Lines of stack shown per hung rank, the innermost calls of each thread first.
_STACK_LINES: Final = 60


def stack_path(stacks: str, rank: int) -> str:
    """Where rank ``rank`` writes its threads' stacks when sent ``DUMP_SIGNAL``."""
    return os.path.join(stacks, f"rank-{rank}.txt")


def _written_stack(stacks: str, rank: int) -> str:
    """The first lines rank ``rank`` wrote to its stack file ("" if none)."""
    try:
        with open(stack_path(stacks, rank)) as file:
            return "\n".join(file.read().splitlines()[:_STACK_LINES])
    except OSError:
        return ""


def _stacks_of(ranks: list[int], processes: list[BaseProcess], stacks: str) -> str:
    """Ask each of ``ranks`` for its threads' stacks; the text to append to the error."""
    if DUMP_SIGNAL is None:
        return ""
    for rank in ranks:
        pid = processes[rank].pid
        if pid is not None and processes[rank].is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, DUMP_SIGNAL)
    time.sleep(GRACE_SECONDS)  # faulthandler writes from its signal handler, at once
    parts: list[str] = []
    for rank in ranks:
        shown = _written_stack(stacks, rank) or "(no stack: the rank did not answer)"
        parts.append(f"\nrank {rank} was at:\n{shown}")
    return "".join(parts)
