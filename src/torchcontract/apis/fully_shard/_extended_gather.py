"""A group's all-gather when some shard defines FSDP2's all-gather extension hooks.

``detect`` runs once per group at its lazy init (the root's first forward, or an
``unshard`` before it), where FSDP2's ``FSDPParam`` looks at init: a group with no
hooks keeps the flat per-dtype path of ``_collectives`` and pays nothing more.

A group with hooks sends, as FSDP2's ``foreach_all_gather``, one collective: every
parameter's all-gather inputs (the pre-all-gather's for a hooked shard, the padded
shard in the parameter dtype for the others) concatenated, as bytes (``uint8``)
where their dtypes differ. Each output is then copied into its parameter's kept
all-gather outputs and the post-all-gather makes or refills the unsharded
parameter. After a post-forward reshard (an int ``reshard_after_forward``) each
rank sends its kept rows of the outputs over the smaller mesh instead, and the
pre-all-gather is not called again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from .._let_go import Waitable
from . import _comms
from ._collectives import PendingGather, on_stream
from ._comms import AllGatherComm
from ._extension import Extension, defines_hooks
from ._sharding import ManagedParameter
from ._streams import CommStreams

__all__ = ["ExtendedGather", "detect", "start_extended_gather"]


def detect(parameters: Sequence[ManagedParameter], where: str) -> bool:
    """Give each parameter whose shard defines the hooks its ``Extension``; whether any does.

    ``where`` names the application (``fully_shard on <module>``). Raises
    ``AllGatherExtensionError`` for a shard with one hook only, or hooks on a
    parameter split on another dim than 0 (FSDP2 chunk-concatenates those; not here).
    """
    found = False
    for parameter in parameters:
        named = f"{where}: parameter {parameter.fqn!r}"
        if not defines_hooks(parameter.local_tensor(), named):
            parameter.extension = None
            continue
        if parameter.dim != 0:
            raise NotImplementedError(
                f"{named} defines fsdp_pre_all_gather and is split on dim {parameter.dim}; "
                "all-gather extensions take dim-0 shards only here: return Shard(0) or None "
                "from shard_placement_fn for it"
            )
        if parameter.extension is None:
            parameter.extension = Extension(_shard_mesh(parameter.mesh), named)
        found = True
    return found


def _shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D shard mesh the pre-all-gather is given: the last dim of an HSDP mesh."""
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    if names is None:  # fully_shard refuses unnamed 2-D meshes; kept total for the types
        raise ValueError("fully_shard: an HSDP mesh without dim names")
    return mesh[names[-1]]


def start_extended_gather(
    parameters: Sequence[ManagedParameter],
    group: dist.ProcessGroup,
    *,
    async_op: bool,
    post_forward: bool = False,
    comm: AllGatherComm | None,
    mp_policy: MixedPrecisionPolicy,
    streams: CommStreams | None = None,
) -> PendingGather:
    """Start the all-gather of ``parameters`` over ``group``, some of which have the hooks.

    FSDP2's single collective of every parameter's inputs; ``mp_policy`` goes to
    the pre-all-gathers, ``comm`` (``set_custom_all_gather``) runs it if given.
    With ``streams`` (an accelerator), as FSDP2's ``foreach_all_gather``: the
    pre-all-gathers and the copy-in run on the copy-in stream, the collective on the
    all-gather stream, and ``finish`` orders the copy-out after it.
    """
    with on_stream(streams.copying_in() if streams is not None else None):
        inputs = [_inputs(parameter, post_forward, mp_policy) for parameter in parameters]
        flat_inputs = [tensor for each in inputs for tensor in each]
        if streams is not None and post_forward:
            streams.hold_for_copy_in(flat_inputs)
        dtype = flat_inputs[0].dtype
        if any(tensor.dtype != dtype for tensor in flat_inputs):
            dtype = torch.uint8
            flat_inputs = [tensor.view(torch.uint8) for tensor in flat_inputs]
        flat = torch.cat(flat_inputs)
        world = group.size()
        gathered = _comms.allocate(comm, world * flat.numel(), dtype, flat.device)
    with on_stream(streams.gathering() if streams is not None else None):
        work = _comms.all_gather(comm, gathered, flat, group, async_op=async_op and streams is None)
        event = None if streams is None else streams.gathered()
    sizes = [tensor.numel() for tensor in flat_inputs]
    works = [] if work is None else [work]
    return ExtendedGather(
        parameters,
        flat,
        gathered,
        works=works,
        sizes=sizes,
        world=world,
        ordered=None if streams is None or event is None else (streams, event),
    )


def _inputs(
    parameter: ManagedParameter, post_forward: bool, mp_policy: MixedPrecisionPolicy
) -> list[Tensor]:
    """``parameter``'s all-gather inputs, flat: the pre-all-gather's, or the padded shard."""
    extension = parameter.extension
    if extension is None:
        return [parameter.post_forward_input() if post_forward else parameter.gather_input()]
    if post_forward:
        return extension.take_kept()
    module_ref = parameter.locations[0][0]
    with torch.no_grad():
        return extension.inputs(
            parameter.local_tensor(),
            parameter.shape,
            parameter.padded_shard_shape,
            module_ref(),
            mp_policy,
        )


class ExtendedGather(PendingGather):
    """An extended all-gather in flight: ``finish()`` waits, copies out, runs the post-hooks.

    ``ordered``: on an accelerator, the streams and the all-gather stream's event the
    copy-out waits for.
    """

    __slots__ = ("_extended", "_flat", "_ordered")

    def __init__(
        self,
        parameters: Sequence[ManagedParameter],
        flat: Tensor,
        gathered: Tensor,
        *,
        works: list[Waitable],
        sizes: list[int],
        world: int,
        ordered: tuple[CommStreams, torch.Event] | None = None,
    ) -> None:
        super().__init__([], works)
        self._flat = flat  # the collective reads it (on gloo's thread) until finished
        self._extended = (parameters, gathered, sizes, world)
        self._ordered = ordered

    def discard(self) -> None:
        """Wait, and drop the result; on an accelerator, as ``PendingGather.discard``."""
        self.wait()
        ordered, self._ordered = self._ordered, None
        if ordered is not None:
            streams, event = ordered
            streams.drop_gather(event)

    def finish(self, *, keep: bool = False) -> None:
        """Wait, copy each output into place, and make or refill the unsharded parameters.

        On an accelerator, as ``PendingGather.finish``: the copy-out waits for the
        gather, and its two buffers (the input is a tensor of its own) go after it.
        """
        self.wait()
        ordered, self._ordered = self._ordered, None
        if ordered is not None:
            ordered[0].copy_out_after(ordered[1])
        self._copy_out()
        if ordered is not None:
            ordered[0].copied_out((self._extended[1], self._flat), keep=keep)

    def _copy_out(self) -> None:
        parameters, gathered, sizes, world = self._extended
        pieces = iter(torch.split(gathered.view(world, -1), sizes, dim=1))
        with torch.no_grad():
            for parameter in parameters:
                extension = parameter.extension
                if extension is None:
                    piece = next(pieces)
                    rows = torch.empty(
                        parameter.world * parameter.padded_shard_numel,
                        dtype=parameter.param_dtype,
                        device=gathered.device,
                    )
                    _copy_into(rows, piece, world)
                    parameter.unshard_from(rows.view(parameter.world, -1))
                    continue
                outputs = extension.allocated_outputs(parameter.world, gathered.device)
                for output in outputs:  # one tensor a context: torch 2.6's takes no tuple
                    with _unsafe_preserve_version_counter(output):
                        _copy_into(output, next(pieces), world)
                parameter.unshard_extended(extension)


def _copy_into(output: Tensor, piece: Tensor, world: int) -> None:
    """Copy ``piece`` (``world`` rows of the gathered buffer) into the flat ``output``."""
    rows = output.view(world, -1)
    if piece.dtype != rows.dtype:  # the buffer is bytes: mixed dtypes
        rows = rows.view(torch.uint8)
    rows.copy_(piece)
