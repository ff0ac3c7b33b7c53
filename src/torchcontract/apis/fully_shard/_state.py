"""FullyShardState: the frozen record of one ``fully_shard`` application."""

from __future__ import annotations

import attrs
import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["FullyShardState"]


def _mesh_repr(mesh: DeviceMesh | None) -> str:
    if mesh is None:
        return "None"
    return f"<DeviceMesh {mesh.device_type} {tuple(mesh.shape)}>"


@attrs.frozen
class FullyShardState:
    """The record of ``fully_shard`` on a module (shared by every module of a list).

    The unsharded tensors, the phase of the iteration and the root live in a group
    that only the hooks hold, not here.

    Attributes:
        mesh: The 1-D mesh parameters are sharded over.
        managed: The FQNs, relative to the module that holds them, of the parameters
            this application shards (a tied parameter once, under its first name;
            parameters a nested application manages are not listed).
        reshard_after_forward: As FSDP2 reads it, True, False or None (an int is
            recorded as the bool it means).
        param_dtype: The ``param_dtype`` of the apply.
        reduce_dtype: The ``reduce_dtype`` of the apply.
        forwards: Forward calls of the module(s) so far.
        backwards: Backward passes whose gradients this application reduce-scattered.
        sync_gradients: False while gradients only accumulate locally
            (``torchcontract.apis.no_sync``).
    """

    mesh: DeviceMesh | None = attrs.field(default=None, repr=_mesh_repr)
    managed: tuple[str, ...] = ()
    reshard_after_forward: bool | None = None
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    forwards: int = 0
    backwards: int = 0
    sync_gradients: bool = True
