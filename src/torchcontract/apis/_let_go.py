"""Collectives on gloo end only once gloo's thread has let go of their tensors.

Gloo runs each collective on a thread of its own, which drops its references to the
collective's tensors after marking it done: often after ``wait()`` has returned (about
one time in ten on an idle machine, more under load). A tensor whose Python object
dies first is given that object to keep, and gloo's thread must then take the GIL to
free it. While the interpreter exits it cannot, and the process aborts ("terminate
called without an active exception"). Device meshes keep a gloo group, and its
threads, alive past ``destroy_process_group``, so the last collectives of a script are
exposed, FSDP2's and DDP's among them.

So these APIs hand gloo aliases of their dense tensors (``detach()``: the same memory,
in a tensor object that nothing else holds), and wait, after the collective, until
gloo's thread has dropped each alias. Then no tensor of theirs is freed on that thread.
Where torch keeps a collective's work after its end (collectives as graph inputs,
``allow_inflight_collective_as_graph_input_ctx``), nothing is aliased or waited for.

PyTorch's own collectives (checkpoints', ``Join``'s, a barrier's neighbours) still
leave tensors to gloo's threads. So once these APIs ran a collective on gloo, the
process gives gloo's threads the GIL for a moment at exit (``EXIT_GRACE_SECONDS``),
before the interpreter finalizes: they free what they hold while they still can.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Final, Protocol, cast, final

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist
from torch import Tensor

from ._backends import serving_backend

__all__ = ["EXIT_GRACE_SECONDS", "Collective", "Waitable", "hand_over", "let_go"]

#: How long to wait for gloo's thread to drop a finished collective's tensors. It drops
#: them as soon as it runs again; past this, the wait stops for good (with a warning).
LET_GO_SECONDS: Final = 2.0


#: At exit, how long gloo's threads get the GIL to free what collectives left them. A
#: starved thread (lowest priority, its core busy) freed everything within 10 ms.
EXIT_GRACE_SECONDS: Final = 0.05


class _ExitGrace:
    """Whether the exit grace is registered: once per process, at the first gloo collective."""

    registered = False

    @classmethod
    def register(cls) -> None:
        if not cls.registered:
            cls.registered = True
            # Callbacks run before the interpreter finalizes, when a thread may still take
            # the GIL; sleeping releases it.
            atexit.register(time.sleep, EXIT_GRACE_SECONDS)


class Waitable(Protocol):
    """What a started collective returns: ``wait()`` ends it (``dist.Work``, ``Collective``)."""

    def wait(self) -> object: ...


#: True while torch keeps collectives' works after their end, for compiled graphs.
_inflight_as_graph_inputs: Final = cast(
    Callable[[], bool],
    vars(c10d).get("_allow_inflight_collective_as_graph_input", bool),
)


class _Waiting:
    """Whether collectives wait for gloo's thread; off for good once a wait ran out."""

    enabled = True


def hand_over(group: dist.ProcessGroup, *tensors: Tensor) -> tuple[Tensor, ...] | None:
    """Aliases of ``tensors`` to give ``group``'s collective, if gloo runs it; else None.

    Pass the aliases to the collective, then ``let_go(aliases)`` once it has ended.
    None (give the tensors themselves) off gloo, for a sparse tensor (whose collective
    replaces its members rather than writing into them), and where torch keeps the work.
    On gloo, the first call registers the exit grace (``EXIT_GRACE_SECONDS``).
    """
    if not serving_backend(group, tensors[0].device).on_gloo_threads:
        return None
    _ExitGrace.register()
    if (
        not _Waiting.enabled
        or any(tensor.layout != torch.strided for tensor in tensors)
        or _inflight_as_graph_inputs()
    ):
        return None
    return tuple(tensor.detach() for tensor in tensors)


#: How many C++ references a tensor object has (torch leaves the method out of its stubs).
_use_count: Final = cast(Callable[[Tensor], int], getattr(Tensor, "_use_count"))  # noqa: B009

if sys.platform == "win32":

    def _hand_the_gil_over() -> None:
        time.sleep(0)

else:
    # Releases the GIL (gloo's thread may need it) and the CPU, without sleep(0)'s timer:
    # a wait that takes one costs about what the collective does.
    _hand_the_gil_over = os.sched_yield


def let_go(aliases: tuple[Tensor, ...]) -> None:
    """Return once nothing but these objects holds ``aliases``: gloo's thread dropped them.

    Call it after the collective's ``wait()``, its ``Work`` dropped (which holds them too).
    After ``LET_GO_SECONDS`` it warns, returns, and no collective waits again.
    """
    deadline = 0.0
    for alias in aliases:
        while _use_count(alias) > 1:
            now = time.monotonic()
            if not deadline:
                deadline = now + LET_GO_SECONDS
            elif now > deadline:
                _give_up()
                return
            _hand_the_gil_over()


def _give_up() -> None:
    _Waiting.enabled = False
    warnings.warn(
        f"torchcontract: gloo still held a collective's tensors {LET_GO_SECONDS:g} s after "
        "it ended, so fully_shard and replicate no longer wait for gloo's thread in this "
        "process; a script that ends right after a gloo collective may now abort at exit",
        RuntimeWarning,
        stacklevel=4,
    )


@final
class Collective:
    """A collective started: ``wait()`` ends it, gloo's thread having let go of its tensors.

    ``wait()`` raises what the collective's does; once it returned, it returns at once.
    """

    __slots__ = ("_aliases", "_work")

    def __init__(self, work: dist.Work, aliases: tuple[Tensor, ...] | None) -> None:
        self._work: dist.Work | None = work
        self._aliases = aliases

    def wait(self) -> None:
        work = self._work
        if work is None:
            return
        work.wait()
        self._work = None
        del work  # the work holds the aliases until it is freed
        aliases, self._aliases = self._aliases, None
        if aliases is not None:
            let_go(aliases)
