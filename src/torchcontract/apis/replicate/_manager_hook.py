"""A communication hook that averages each bucket through a fault-tolerant manager.

torchft's ``Manager`` all-reduces over the replica groups that take part in a
step and decides whether the step commits; torchft's own
``DistributedDataParallel`` registers such a hook under a private name. This is
the same hook under a public one, for ``replicate``'s ``register_comm_hook``
(DDP's accepts it too). It needs only ``manager.allreduce``, so torchft is not
imported here.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import Tensor
from torch._C._distributed_c10d import GradBucket

__all__ = ["AllReduceManager", "manager_allreduce_hook"]


class _ReducedFuture(Protocol):
    def wait(self) -> Tensor: ...


class _AllReduceWork(Protocol):
    def wait(self) -> object: ...

    def get_future(self) -> _ReducedFuture: ...


class AllReduceManager(Protocol):
    """What the hook needs of its state: torchft's ``Manager.allreduce``.

    ``allreduce(tensor)`` averages ``tensor`` over the replica groups taking part
    in the step and returns torchft's work: ``wait()``, then ``get_future().wait()``
    gives the averaged tensor (after a failure, one the manager will not commit).
    """

    def allreduce(self, tensor: Tensor, /) -> object: ...


def manager_allreduce_hook(
    manager: AllReduceManager, bucket: GradBucket
) -> torch.futures.Future[Tensor]:
    """Average ``bucket`` over the replica groups through ``manager.allreduce``.

    Register it with ``model.register_comm_hook(manager, manager_allreduce_hook)``
    on a module ``replicate`` was applied to with torchft's one-rank group
    (``process_group=ProcessGroupDummy(0, 1)``) and ``find_unused_parameters=True``,
    as torchft's ``DistributedDataParallel`` does: its buckets are then never
    rebuilt, so a replica group that recovers mid-run reduces the same buckets as
    its peers. The all-reduce is waited for here, as torchft's own hook does;
    the future returned is done.
    """
    work = cast("_AllReduceWork", manager.allreduce(bucket.buffer()))
    work.wait()  # torchft's future gives its tensor only once the work has ended
    averaged = work.get_future().wait()
    done: torch.futures.Future[Tensor] = torch.futures.Future()
    done.set_result(averaged)
    return done


# DDP compares a hook's annotations with its own types, as objects; this module's are
# strings (PEP 563).
manager_allreduce_hook.__annotations__ = {
    "manager": AllReduceManager,
    "bucket": GradBucket,
    "return": torch.futures.Future[Tensor],
}
