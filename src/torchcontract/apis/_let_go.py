"""Collectives on gloo end only once gloo's thread has let go of their tensors.

Gloo runs each collective on a thread of its own, which drops its references to the
collective's tensors after marking it done: often after ``wait()`` has returned (about
one time in ten on an idle machine, more under load). A tensor whose Python object
dies first is given that object to keep, and gloo's thread must then take the GIL to
free it. While the interpreter exits it cannot, and the process aborts ("terminate
called without an active exception"). Device meshes keep a gloo group, and its
threads, alive past ``destroy_process_group``, so the last collectives of a script are
exposed, FSDP2's and DDP's among them.

So these APIs hand gloo aliases of their tensors (``detach()``: the same memory, in a
tensor object that nothing else holds), and wait, after the collective, until gloo's
thread has dropped each alias. Then no tensor of theirs is ever freed on gloo's thread.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Final, Protocol, cast, final

import torch.distributed as dist
from torch import Tensor

from ._backends import serving_backend

__all__ = ["Collective", "Waitable", "hand_over", "let_go"]

#: How long to wait for gloo's thread to drop a finished collective's tensors. It drops
#: them as soon as it runs again; past this, the call returns anyway, as torch's would.
LET_GO_SECONDS: Final = 10.0


class Waitable(Protocol):
    """What a started collective returns: ``wait()`` ends it (``dist.Work``, ``Collective``)."""

    def wait(self) -> object: ...


def hand_over(group: dist.ProcessGroup, *tensors: Tensor) -> tuple[Tensor, ...] | None:
    """Aliases of ``tensors`` to give ``group``'s collective, if gloo runs it; else None.

    Pass the aliases to the collective, then ``let_go(aliases)`` once it has ended.
    """
    if not serving_backend(group, tensors[0].device).on_gloo_threads:
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
    """
    deadline = 0.0
    for alias in aliases:
        while _use_count(alias) > 1:
            now = time.monotonic()
            if not deadline:
                deadline = now + LET_GO_SECONDS
            elif now > deadline:
                return
            _hand_the_gil_over()


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
