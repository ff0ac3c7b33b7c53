"""The mesh's device, and an application's tensors moved onto it at apply, as FSDP2 moves them.

FSDP2 moves what it manages to the device of its mesh before sharding: a model built
on the CPU and sharded over a CUDA mesh trains on the GPU. So does ``fully_shard``:
the parameters it shards and the buffers of the modules it manages (those
``find_parameters`` walks: under the targets, short of modules a nested application
targets), each moved in place (the
same tensor object, its data on the device), tensors on the meta device left for
deferred initialization, ``DTensor`` parameters (tensor parallelism's) left on theirs.
The move is undone if the apply rolls back.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .. import _torch

__all__ = ["Moved", "mesh_device", "move_to"]


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """FSDP2's device for ``mesh``: the CPU, or its accelerator's current device."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def _copy_to(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor``'s data on ``device``, outside autograd."""
    with torch.no_grad():
        return tensor.detach().to(device)


class Moved:
    """The tensors a ``move_to`` moved, and what each held before: calling it moves them back."""

    def __init__(self) -> None:
        self._before: list[tuple[Tensor, Tensor, bool]] = []  # tensor, before, swapped

    def __len__(self) -> int:
        return len(self._before)

    def add(self, tensor: Tensor, device: torch.device) -> None:
        """Move ``tensor`` to ``device`` in place, remembering how to move it back."""
        moved = _copy_to(tensor, device)
        if _torch.is_wrapper_subclass(tensor):
            # A wrapper subclass's data cannot be set: swap its contents, as FSDP2 does.
            other = moved
            if isinstance(tensor, nn.Parameter):
                other = nn.Parameter(moved, tensor.requires_grad)
            _torch.swap_tensors(tensor, other)
            self._before.append((tensor, other, True))
        else:
            before = tensor.data
            tensor.data = moved
            self._before.append((tensor, before, False))

    def __call__(self) -> None:
        """Move every tensor back where it was, the last moved first."""
        while self._before:
            tensor, before, swapped = self._before.pop()
            if swapped:
                _torch.swap_tensors(tensor, before)  # swapping again restores both
            else:
                tensor.data = before


def move_to(device: torch.device, parameters: Iterable[Tensor], buffers: Iterable[Tensor]) -> Moved:
    """Move ``parameters`` and ``buffers`` to ``device`` in place, as FSDP2's apply does.

    Those already there, on the meta device, or ``DTensor``\\ s stay. If a move raises,
    the ones moved before it are moved back.
    """
    moved = Moved()
    try:
        for tensor in chain(parameters, buffers):
            if tensor.device == device or tensor.device.type == "meta":
                continue
            if isinstance(tensor, DTensor):
                continue
            moved.add(tensor, device)
    except BaseException:
        moved()
        raise
    return moved
