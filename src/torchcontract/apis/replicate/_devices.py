"""DDP's ``device_ids`` and ``output_device``: its checks, and the inputs it moves.

As ``DistributedDataParallel.__init__``: ``device_ids`` holds at most one device; on
a CPU module, a module on several devices, or with ``device_ids`` None or empty,
neither keyword may name a device (a falsy value, such as ``output_device=0``,
passes, as in DDP). On a module on one accelerator device, ``device_ids=[i]``
moves nothing: it names the device the module is on, and each forward's inputs
are copied there first, as DDP's forward does (``_to_kwargs``, on a side stream
unless ``PYTORCH_DDP_USE_SIDE_STREAM=0``). ``output_device`` (default
``device_ids[0]``) is checked and kept, as DDP keeps it: DDP's forward moves no
output, so the outputs are where the module puts them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, cast

import attrs
import torch
from torch import nn

from torchcontract import ContractError, module_label

from .. import _torch
from ..checkpoint import describe_value
from ._reducer import Reducer

__all__ = ["Devices", "InvalidKeywordError", "MoveInputs", "devices"]


class InvalidKeywordError(ContractError, ValueError):
    """A keyword of DDP's has a value DDP refuses with a ``ValueError`` (``device_ids``, ...)."""


@attrs.frozen
class Devices:
    """What ``device_ids`` and ``output_device`` resolve to, as DDP's attributes of the names.

    ``input_device`` is where each forward's inputs are copied (None: nowhere).
    """

    device_ids: tuple[int, ...] | None
    output_device: int | None
    input_device: torch.device | None


def devices(
    module: nn.Module, parameters: Sequence[nn.Parameter], device_ids: object, output_device: object
) -> Devices:
    """DDP's checks of ``device_ids`` and ``output_device`` against ``parameters``' devices.

    Raises ``InvalidKeywordError`` (a ``ValueError``) where DDP raises its
    ``ValueError``, and ``TypeError`` for a ``device_ids`` that is not a list.
    """
    where = f"replicate on {module_label(module)}"
    listed = _device_list(where, device_ids)
    if listed is not None and len(listed) > 1:
        raise InvalidKeywordError(
            f"{where}: device_ids can hold one device at most (as DistributedDataParallel's), "
            f"got {len(listed)}; pass device_ids=[local_rank], one process per device"
        )
    found = {parameter.device for parameter in parameters}
    kinds = {device.type for device in found}
    if len(kinds) != 1:
        raise InvalidKeywordError(
            f"{where}: the parameters are on devices of several types, {sorted(kinds)}; move "
            "the module to one type of device first (DistributedDataParallel refuses it too)"
        )
    kind = next(iter(kinds))
    if not listed or kind == "cpu" or len(found) > 1:
        if listed or output_device:
            shown = sorted(str(device) for device in found)
            raise InvalidKeywordError(
                f"{where}: device_ids and output_device are for a module on one accelerator "
                f"device, and the parameters are on {shown}; leave both None (the module and "
                "its inputs stay where they are), or move the module to one device"
            )
        return Devices(None, None, None)
    ids = tuple(_torch.device_index(device) for device in listed)
    output = _torch.device_index(listed[0] if output_device is None else output_device)
    return Devices(ids, output, torch.device(kind, ids[0]))


def _device_list(where: str, device_ids: object) -> list[object] | None:
    if device_ids is None:
        return None
    if isinstance(device_ids, (list, tuple)):
        return list(cast("list[object] | tuple[object, ...]", device_ids))
    raise TypeError(
        f"{where}: device_ids takes a list of one device or None, got "
        f"{describe_value(device_ids)}; pass device_ids=[local_rank]"
    )


class MoveInputs:
    """A forward pre-hook (with kwargs) copying the inputs to DDP's ``device_ids[0]``.

    It acts only for the application that installed it (``reducer.record(module)``):
    not after a rolled-back apply, nor on copies and pickles of the module, which get an
    inert hook (the copy gets hooks of its own when replicate is applied to it).
    """

    __slots__ = ("_device", "_reducer", "_side_stream")

    def __init__(self, reducer: Reducer | None, device: torch.device | None) -> None:
        self._reducer = reducer
        self._device = device
        self._side_stream = os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1"

    def __reduce__(self) -> tuple[type[MoveInputs], tuple[None, None]]:
        return MoveInputs, (None, None)

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if self._device is None or self._reducer is None or self._reducer.record(module) is None:
            return None
        return _torch.inputs_to(args, kwargs, self._device, self._side_stream)
