"""FullyShardState: the frozen record of one ``fully_shard`` application."""

from __future__ import annotations

import attrs
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

__all__ = ["FullyShardState"]


def _mesh_repr(mesh: DeviceMesh | None) -> str:
    if mesh is None:
        return "None"
    return f"<DeviceMesh {mesh.device_type} {tuple(mesh.shape)}>"


@attrs.frozen
class FullyShardState:
    """The record of ``fully_shard`` on a module (shared by every module of a list).

    ``mesh``: the data-parallel mesh parameters are sharded over, 1-D or, for
    HSDP, 2-D ``(replicate, shard)`` (with ``dp_mesh_dims``, the one its names make
    of the full mesh; tensor parallelism's dims are not in it). ``managed``: the FQNs,
    relative to the module that holds them, of the parameters this application
    shards (a tied parameter once, under its first name; parameters a nested
    application manages are not listed). ``reshard_after_forward``: as FSDP2 reads
    it, True, False or None (an int is recorded as the bool it means).
    ``mp_policy`` and ``offload_policy``: the apply's policies, torch's classes.
    ``ignored``: the FQNs of the ``ignored_params`` found under the module(s).
    ``forwards``: forward calls of the module(s) so far. ``backwards``: backward
    passes whose gradients this application reduce-scattered. ``sync_gradients``:
    False while gradients only accumulate locally (``no_sync``,
    ``set_requires_gradient_sync(False)``). The other fields are what the
    ``FSDPModule`` setters of the same names set, with FSDP2's defaults. What the
    setters take from the user (an all-reduce hook, custom collectives) is not kept
    here: a record must not hold its module, and FSDP2 takes hooks that do.
    """

    mesh: DeviceMesh | None = attrs.field(default=None, repr=_mesh_repr)
    managed: tuple[str, ...] = ()
    reshard_after_forward: bool | None = None
    mp_policy: MixedPrecisionPolicy = attrs.field(factory=MixedPrecisionPolicy)
    offload_policy: OffloadPolicy = attrs.field(factory=OffloadPolicy)
    ignored: tuple[str, ...] = ()
    forwards: int = 0
    backwards: int = 0
    sync_gradients: bool = True
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True
    requires_all_reduce: bool = True
    gradient_divide_factor: float | None = None
    force_sum_reduction: bool = False
    reduce_scatter_unused_params: bool = False
    reduce_scatter_max_input_buffers: int = 1
    is_last_backward: bool = True
