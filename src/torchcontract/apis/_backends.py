"""The backend serving a device in a process group, looked up once per group and device type.

A group's backends are fixed when c10d makes it, so the answer is kept for as long as
the group lives (weakly: a destroyed group's entry goes with it). Collectives ask on
every call, whether the backend averages (``_torch.averages_in_collectives``) and
whether it runs them on threads of its own (``_let_go``); a lookup costs more than the
collective's Python around it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Final, cast

import attrs
import torch
import torch.distributed as dist

__all__ = ["ServingBackend", "serving_backend"]


@attrs.frozen
class ServingBackend:
    """What these APIs need to know of the backend serving a device in a group.

    Attributes:
        name: Its name (``"gloo"``, ``"nccl"``, ...); else the group's own, where a
            group written in Python names itself; else ``""``.
        on_gloo_threads: Whether it is c10d's gloo backend, which runs each collective
            on a thread of its own.
    """

    name: str
    on_gloo_threads: bool


_FOUND: Final[weakref.WeakKeyDictionary[dist.ProcessGroup, dict[str, ServingBackend]]] = (
    weakref.WeakKeyDictionary()
)


def serving_backend(group: dist.ProcessGroup, device: torch.device) -> ServingBackend:
    """The backend serving ``device`` in ``group`` (a ``"cpu:gloo,cuda:nccl"`` group is both)."""
    by_device = _FOUND.get(group)
    if by_device is None:
        by_device = _FOUND.setdefault(group, {})
    found = by_device.get(device.type)
    if found is None:
        found = by_device[device.type] = _look_up(group, device)
    return found


_get_backend: Final = cast(Callable[[dist.ProcessGroup], object], dist.get_backend)
#: What ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps each backend in (``wrapped_pg`` inside).
_WRAPPER: Final = cast("type | None", vars(dist.distributed_c10d).get("_ProcessGroupWrapper"))


def _look_up(group: dist.ProcessGroup, device: torch.device) -> ServingBackend:
    if isinstance(group, dist.ProcessGroupGloo):  # a backend used as a group (from a store)
        return ServingBackend("gloo", True)
    try:
        backend = cast(Callable[[torch.device], Any], group._get_backend)(device)
        wrapped = _WRAPPER is not None and isinstance(backend, _WRAPPER)
        backend = backend.wrapped_pg if wrapped else backend
        return ServingBackend(str(backend.name()), isinstance(backend, dist.ProcessGroupGloo))
    except (RuntimeError, NotImplementedError, AttributeError, ValueError):
        pass  # a group written in Python, or a backend torch 2.6 cannot look up by device
    try:
        return ServingBackend(str(_get_backend(group)), False)  # what c10d made it with
    except (RuntimeError, ValueError, TypeError):  # one c10d did not make
        pass
    try:
        return ServingBackend(group.name(), False)
    except (RuntimeError, NotImplementedError):
        return ServingBackend("", False)
