"""A process group written in Python: what every such group of the tests needs.

torch lets a subclass of ``dist.ProcessGroup`` serve as a backend
(``Backend.register_backend``): c10d then calls its Python methods for each
collective. ``PythonGroup`` holds what each needs besides its collectives: the
constructor a Python subclass may call, the backend's name, and the name c10d
registered the group under (which DeviceMesh and functional collectives look up).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, ClassVar, cast

import torch.distributed as dist
from torch._C._distributed_c10d import Store

__all__ = ["PythonGroup", "register"]


class PythonGroup(dist.ProcessGroup):
    """A process group whose collectives its subclass writes in Python."""

    backend: ClassVar[str]

    def __init__(self, rank: int, size: int) -> None:
        # The (rank, size) constructor, the one a Python subclass may call: torch's
        # stubs list only the (store, rank, size) one.
        cast(Any, super()).__init__(rank, size)

    def getBackendName(self) -> str:
        return self.backend

    @property
    def group_name(self) -> Any:  # torch's GroupName: the name c10d registered this group under
        return dist.distributed_c10d._world.pg_names[self]


def register(
    group: type[PythonGroup],
    create: Callable[[Store, int, int, timedelta], PythonGroup],
    devices: Sequence[str],
) -> None:
    """Make ``group.backend`` a backend name ``create`` serves (once per process)."""
    if group.backend.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(group.backend, create, devices=list(devices))
