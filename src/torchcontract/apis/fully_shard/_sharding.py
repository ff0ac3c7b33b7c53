"""One managed parameter: its shard as a DTensor, and the unsharded tensor in forward.

As PyTorch's ``FSDPParam``: rank ``r`` of ``W`` keeps rows
``[r * c, min((r + 1) * c, d0))`` of dim 0, ``c = ceil(d0 / W)``, the split of
``torch.chunk`` that ``DTensor``'s ``Shard(0)`` uses (the last ranks may hold
fewer rows, or none). Collectives move padded shards of ``c`` rows. Another dim
(``shard_placement_fn``) splits evenly, as FSDP2 requires; gathered shards are
copied into place. The tensor split, its dim and its ``DTensor`` forms (tensor
parallelism's included) are the parameter's ``Layout`` (``_layout``).

The unsharded parameter is one ``nn.Parameter`` per managed parameter, made at
the first all-gather and kept: autograd's graph refers to it between forward and
backward. Resharding frees its storage (``resize_(0)``) and unsharding
reallocates and refills it in place, preserving its version counter, so tensors
saved for backward stay valid; this is how ``FSDPParam`` does it.

Dtypes are read from the sharded parameter at each gather, not recorded at
apply: ``model.to(torch.bfloat16)`` or ``model.half()`` after sharding casts the
shards (``nn.Module._apply`` swaps a DTensor parameter's contents in place), and
the next gather makes an unsharded parameter, and its gradient, of the new dtype.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchcontract import ReplacedParameterError

from .. import _torch
from ._extension import Extension
from ._layout import Layout, local_tensor

__all__ = ["Location", "ManagedParameter", "as_dtensor", "new_origin"]

#: Where a parameter is registered: a module (weakly) and the name in its ``_parameters``.
Location = tuple["weakref.ref[nn.Module]", str]

_ORIGINS = itertools.count()


def new_origin() -> int:
    """A new origin: what identifies the user's parameter a shard was made from (FSDP2's uid)."""
    return next(_ORIGINS)


class ManagedParameter:
    """A parameter sharded over a mesh's last dim, and its unsharded form when gathered.

    On a 2-D ``(replicate, shard)`` mesh (HSDP) every replica holds the same shards:
    the rows are split over the inner dim only. ``layout`` (``_layout.layout_of``)
    says which tensor is split on which dim and what DTensors the shard and the
    unsharded parameter are; ``shape`` is that tensor's (the
    TP-local one under tensor parallelism), ``layout.shape`` the parameter's.
    """

    def __init__(
        self,
        fqn: str,
        parameter: nn.Parameter,
        locations: Sequence[Location],
        mesh: DeviceMesh,
        param_dtype: torch.dtype | None,
        *,
        post_forward_mesh: DeviceMesh | None = None,
        layout: Layout,
        origin: int | None = None,
    ) -> None:
        self.fqn = fqn
        self.original = weakref.ref(parameter)
        # Two applications that shard one parameter share it; the first forward refuses them.
        self.origin = new_origin() if origin is None else origin
        self.locations = tuple(locations)
        self.layout = layout
        self.world = mesh.size(mesh.ndim - 1)
        self.rank = mesh.get_local_rank(mesh.ndim - 1)
        self.dim = self.layout.dim
        self.shape = self.layout.local_shape  # of the tensor split (TP-local under TP)
        # The mixed-precision dtype of the gathered parameter; None: the parameter's own.
        floating = parameter.dtype.is_floating_point
        self.mixed_dtype = param_dtype if floating else None
        # "Rows" are the slices along the sharded dim.
        self.rows = self.shape[self.dim]
        self.row_numel = math.prod(self.shape) // max(self.rows, 1)
        self.chunk_rows = -(-self.rows // self.world)  # ceil
        self.local_rows = max(0, min(self.chunk_rows, self.rows - self.rank * self.chunk_rows))
        self.padded_shard_numel = self.chunk_rows * self.row_numel
        self.shard_shape = self._with_rows(self.local_rows)
        self.shard_stride = _contiguous_stride(self.shard_shape)
        start = min(self.rank * self.chunk_rows, self.rows)
        with torch.no_grad():
            whole = local_tensor(parameter).detach()
            # torch.chunk and new_zeros + copy_, as FSDP2 splits and copies: tensor subclasses
            # implement those (NF4's clone would quantize its data again).
            chunks = torch.chunk(whole, self.world, dim=self.dim)
            if self.rank < len(chunks):
                chunk = chunks[self.rank]
            else:
                chunk = whole.narrow(self.dim, start, self.local_rows)
            if type(chunk) is Tensor:
                local = chunk.contiguous().clone()
            else:
                local = chunk.new_zeros(chunk.shape)
                local.copy_(chunk)
            sharded = self.layout.sharded(local)
        self.sharded = nn.Parameter(sharded, requires_grad=parameter.requires_grad)
        # FSDP2's post-forward mesh (an int reshard_after_forward): after forward, each
        # rank keeps 1/N of the gathered padded rows, registered as a DTensor
        # (Replicate(), Shard(0)) on a (W/N, N) mesh, and backward gathers over N ranks.
        self.post_forward_mesh = post_forward_mesh
        self._post_forward_data: Tensor | None = None
        if post_forward_mesh is not None:
            size = post_forward_mesh.size(1)
            self.post_forward_rank = post_forward_mesh.get_local_rank(1)
            self.post_forward_numel = self.world // size * self.padded_shard_numel
            rows = -(-self.rows // size)  # torch.chunk's split, as FSDP2's registered shape
            rows = max(0, min(rows, self.rows - self.post_forward_rank * rows))
            self.post_forward_shape = torch.Size((rows, *self.shape[1:]))
        self._gathered: Tensor | None = None
        # Views of ``_gathered`` made once with it: as ``(world, padded)`` rows (the
        # all-gather's copy-out) and as the split tensor's shape (a world of one's copy-in).
        self._gathered_rows: Tensor | None = None
        self._gathered_data: Tensor | None = None
        # The shard's local tensor and its flat view, made once per local tensor.
        self._source: Tensor | None = None
        self._flat_source: Tensor | None = None
        self.unsharded: nn.Parameter | None = None
        # The data-parallel mesh, and the all-gather extension of the shard's local tensor
        # (its fsdp_pre/post_all_gather), found at lazy init (``_extended_gather.detect``).
        self.mesh = mesh
        self.extension: Extension | None = None
        # Gradients kept unreduced (no_sync) in the reduce dtype, when it differs.
        self._accumulated: Tensor | None = None

    def _with_rows(self, rows: int) -> torch.Size:
        """The split tensor's shape with ``rows`` slices along the sharded dim."""
        return torch.Size((*self.shape[: self.dim], rows, *self.shape[self.dim + 1 :]))

    @property
    def orig_dtype(self) -> torch.dtype:
        """The dtype of the sharded parameter, its gradient and the optimizer's view of it."""
        return self.sharded.dtype

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype of the gathered parameter: ``param_dtype`` if given, else the shard's."""
        return self.orig_dtype if self.mixed_dtype is None else self.mixed_dtype

    @property
    def is_meta(self) -> bool:
        """Whether the shard is still on the meta device (never materialized)."""
        return self.sharded.is_meta

    # ----------------------------------------------------------------- placement

    def install(self, parameter: nn.Parameter) -> None:
        """Register ``parameter`` under every name this parameter has, bypassing ``__setattr__``."""
        for module_ref, name in self.locations:
            module = module_ref()
            if module is not None:
                module._parameters[name] = parameter

    def adopt_registered(self) -> None:
        """Take as the shard a new sharded parameter registered in place of ours (a load).

        Loading with ``assign=True`` replaces parameter objects; the group must
        gather the new ones. Anything else registered there is left alone.
        """
        module = self.locations[0][0]()
        if module is None:
            return
        current = module._parameters.get(self.locations[0][1])
        if current is None or current is self.sharded or current is self.unsharded:
            return
        if isinstance(current, DTensor) and current.shape == self.layout.shape:
            self.sharded = current
            self.install(current)

    def adopt_replaced(self, where: str) -> None:
        """Take as the shard a parameter registered in place of ours since apply (lazy init).

        FSDP2 re-reads each parameter from its first module at its lazy init
        (``reset_sharded_param``) and shards what it finds there from then on: so
        does this, for a ``DTensor`` of the shard's mesh, placements, shape and
        local shape (e.g. one computed from other shards, or made with
        ``distribute_tensor`` after ``to_empty``). Raises ``ReplacedParameterError``
        (``where`` names the module applied to) for another tensor: one that is not
        a ``DTensor`` (FSDP2 fails with ``AttributeError``), or laid out otherwise.
        """
        module = self.locations[0][0]()
        if module is None:
            return
        name = self.locations[0][1]
        current = module._parameters.get(name)
        if current is None or current is self.sharded or current is self.unsharded:
            return
        fix = (
            "assign a DTensor laid out as the shard it replaces, e.g. "
            "nn.Parameter(distribute_tensor(full, old.device_mesh, old.placements)), or set "
            "it before fully_shard"
        )
        if not isinstance(current, DTensor):
            raise ReplacedParameterError(
                f"fully_shard on {where}: parameter {self.fqn!r} was replaced after fully_shard "
                f"by a {type(current).__qualname__} that is not a DTensor, so it cannot be taken "
                "as its shard (FSDP2: 'Parameter' object has no attribute '_local_tensor'); "
                f"{fix}"
            )
        layout = self.layout
        local = current.to_local()
        if (
            current.device_mesh != layout.mesh
            or tuple(current.placements) != layout.placements
            or current.shape != layout.shape
            or local.shape != self.shard_shape
        ):
            raise ReplacedParameterError(
                f"fully_shard on {where}: parameter {self.fqn!r} was replaced after fully_shard "
                f"by a DTensor of shape {tuple(current.shape)}, placements "
                f"{tuple(current.placements)} and local shape {tuple(local.shape)}, where its "
                f"shard has shape {tuple(layout.shape)}, placements {layout.placements} and "
                f"local shape {tuple(self.shard_shape)} on its mesh; {fix}"
            )
        self.sharded = current
        self.install(current)

    def local_shard(self) -> Tensor:
        """This rank's rows of the sharded parameter (no autograd)."""
        with torch.no_grad():
            return as_dtensor(self.sharded).to_local()

    def local_tensor(self) -> Tensor:
        """The shard's local tensor object itself, where extension hooks are defined (FSDP2's).

        Not ``to_local()``: on a ``Parameter`` of a ``DTensor`` newer torch returns a
        view of it there, which does not carry the hooks set on the tensor.
        """
        return as_dtensor(self.sharded)._local_tensor

    # ----------------------------------------------------------------- all-gather

    def gather_input(self) -> Tensor:
        """This rank's shard, padded to ``chunk_rows`` rows, flat, in the parameter dtype."""
        local = self.local_shard()
        padded = torch.zeros(self.padded_shard_numel, dtype=self.param_dtype, device=local.device)
        padded[: local.numel()].copy_(local.reshape(-1))
        return padded

    def shard_data(self) -> Tensor:
        """This rank's rows of the sharded parameter, as the ``DTensor`` holds them (no op)."""
        return as_dtensor(self.sharded)._local_tensor

    def flat_shard(self) -> Tensor:
        """``shard_data()`` flat; the view is made once per local tensor, not per gather."""
        local = self.shard_data()
        if local is self._source and self._flat_source is not None:
            return self._flat_source
        if not local.is_contiguous():  # a copy: made again each time, never stale
            self._source = self._flat_source = None
            return local.reshape(-1)
        self._source, self._flat_source = local, local.view(-1)
        return self._flat_source

    def prepare_gathered(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The storage the gathered rows go to, allocated; a new parameter if needed.

        Returns ``_gathered`` itself, whose version counter a caller writing into it
        preserves (``_unsafe_preserve_version_counter``): autograd saved the
        unsharded parameter, a view of it, for backward.
        """
        gathered = self._gathered
        if gathered is None or gathered.dtype != dtype or gathered.device != device:
            # First gather, or the model was cast or moved since: a new unsharded parameter.
            gathered = torch.empty(self.world * self.padded_shard_numel, dtype=dtype, device=device)
            self._gathered = gathered
            self._gathered_rows = gathered.view(self.world, self.padded_shard_numel)
            self._gathered_data = gathered[: self.rows * self.row_numel].view(self.shape)
            self.unsharded = nn.Parameter(
                self.layout.unsharded(self._gathered_data),
                requires_grad=self.sharded.requires_grad,
            )
        else:
            storage = gathered.untyped_storage()
            size = gathered.numel() * gathered.element_size()
            if storage.size() != size:
                storage.resize_(size)
        assert self.unsharded is not None
        if self.unsharded.requires_grad != self.sharded.requires_grad:
            self.unsharded.requires_grad_(self.sharded.requires_grad)
        return gathered

    def gathered_rows(self) -> Tensor:
        """``_gathered`` as ``(world, padded_shard_numel)``: where the copy-out writes."""
        assert self._gathered_rows is not None, "prepare_gathered first"
        return self._gathered_rows

    def gathered_data(self) -> Tensor:
        """``_gathered``'s rows as the split tensor's shape: the unsharded parameter's data."""
        assert self._gathered_data is not None, "prepare_gathered first"
        return self._gathered_data

    def unshard_from(self, gathered: Tensor) -> None:
        """Fill the unsharded parameter from its ``(world, padded_shard_numel)`` gathered slice."""
        storage = self.prepare_gathered(gathered.dtype, gathered.device)
        with torch.no_grad(), _unsafe_preserve_version_counter(storage):
            if self.dim == 0:
                self.gathered_rows().copy_(gathered)
            else:  # rank r's slices go to [r * c, (r + 1) * c) of the dim (even: no padding)
                self._split_view(storage).copy_(
                    gathered.view(self.world, *self.shard_shape).movedim(0, self.dim)
                )
        self.install_unsharded()

    def install_unsharded(self) -> None:
        """Register the unsharded parameter under every name (after its data is in place)."""
        assert self.unsharded is not None
        self.install(self.unsharded)

    @property
    def padded_shard_shape(self) -> torch.Size:
        """The split tensor's shape with ``chunk_rows`` slices: a padded shard's."""
        return self._with_rows(self.chunk_rows)

    def unshard_extended(self, extension: Extension) -> None:
        """Make or refill the unsharded parameter with the post-all-gather, and register it.

        ``extension``'s outputs hold the gathered data. The first time the hook's
        tensor becomes the unsharded parameter (the TP ``DTensor`` of it under tensor
        parallelism), as FSDP2's ``init_unsharded_param``; then it refills it in place.
        """
        made = extension.unshard(self.local_tensor(), self.param_dtype, self.unsharded)
        if made is not None:
            stride = torch.empty(self.shape, device="meta").stride()
            unsharded = torch.as_strided(made, self.shape, stride, 0)
            self.unsharded = nn.Parameter(
                self.layout.unsharded(unsharded), requires_grad=self.sharded.requires_grad
            )
        assert self.unsharded is not None
        if self.unsharded.requires_grad != self.sharded.requires_grad:
            self.unsharded.requires_grad_(self.sharded.requires_grad)
        self.install(self.unsharded)

    def _split_view(self, tensor: Tensor) -> Tensor:
        """``tensor`` (of the split tensor's numel) with the sharded dim as ``(world, c)``."""
        shape = (*self.shape[: self.dim], self.world, self.chunk_rows, *self.shape[self.dim + 1 :])
        return tensor.view(shape)

    def follow_cast(self) -> None:
        """Cast the shard as the model was cast while this parameter was unsharded.

        ``model.to(dtype)`` while unsharded (a root between a forward without
        gradients and the next one, or after ``unshard``) replaced the unsharded
        parameter's data and left the shard, which no module held, as it was;
        FSDP2 reshards before a cast, so the shard takes the new dtype too.
        """
        unsharded, gathered = self.unsharded, self._gathered
        if unsharded is None or gathered is None or unsharded.dtype == gathered.dtype:
            return
        sharded = self.sharded
        grad, sharded.grad = sharded.grad, None
        with torch.no_grad():
            converted = nn.Parameter(
                sharded.detach().to(unsharded.dtype), requires_grad=sharded.requires_grad
            )
        _torch.swap_tensors(sharded, converted)
        if grad is not None:
            sharded.grad = grad.to(unsharded.dtype)
        # The unsharded parameter holds its own data now; the next gather makes new ones.
        self._gathered = self._gathered_rows = self._gathered_data = None

    def reshard(self) -> None:
        """Register the sharded parameter again and free the unsharded storage."""
        self.install(self.sharded)
        self._post_forward_data = None
        if self._gathered is not None:
            self._gathered.untyped_storage().resize_(0)
        if self.extension is not None:
            self.extension.kept = []
            self.extension.free()

    def reshard_post_forward(self) -> None:
        """Keep this rank's 1/N of the gathered rows, register them, free the rest (FSDP2's)."""
        mesh, gathered = self.post_forward_mesh, self._gathered
        if mesh is not None and self.extension is not None:
            # The gathered pre-all-gather outputs are kept (FSDP2 refuses this at backward);
            # the sharded parameter stands registered until backward gathers them again.
            self.extension.keep(self.post_forward_rank, mesh.size(1))
            self.install(self.sharded)
            return
        if mesh is None or gathered is None:
            raise RuntimeError(f"fully_shard: {self.fqn!r} has no post-forward mesh or gather")
        start = self.post_forward_rank * self.post_forward_numel
        data = gathered[start : start + self.post_forward_numel].clone()
        local = data[: self.post_forward_shape.numel()].view(self.post_forward_shape)
        with torch.no_grad():
            registered = DTensor.from_local(
                local,
                mesh,
                (Replicate(), Shard(0)),
                run_check=False,
                shape=self.layout.shape,
                stride=self.sharded.stride(),
            )
        self.install(nn.Parameter(registered, requires_grad=self.sharded.requires_grad))
        self._post_forward_data = data
        gathered.untyped_storage().resize_(0)

    def post_forward_input(self) -> Tensor:
        """What this rank contributes to the all-gather over the post-forward mesh: flat."""
        if self._post_forward_data is None:
            raise RuntimeError(f"fully_shard: {self.fqn!r} is not resharded post-forward")
        data, self._post_forward_data = self._post_forward_data, None
        return data

    # ----------------------------------------------------------------- gradients

    def take_unsharded_grad(self) -> Tensor | None:
        """The unsharded gradient accumulated since the last reduction, taken off the parameter.

        Under tensor parallelism a ``Partial`` gradient is summed over the
        tensor-parallel ranks once, here, after the backwards kept without sync were
        added to it in the reduce dtype (FSDP2's ``unsharded_accumulated_grad_data``).
        """
        grad = None
        if self.unsharded is not None:
            grad, self.unsharded.grad = self.unsharded.grad, None
        accumulated, self._accumulated = self._accumulated, None
        if accumulated is not None:
            if grad is not None:
                accumulated.add_(grad)
            grad = accumulated
        return None if grad is None else self.layout.local_grad(grad)

    def unsharded_zero_grad(self) -> Tensor | None:
        """Zeros as the unsharded gradient of a parameter gathered but unused (None if never)."""
        unsharded = self.unsharded
        if unsharded is None or not unsharded.requires_grad:
            return None
        return torch.zeros(self.shape, dtype=unsharded.dtype, device=unsharded.device)

    def keep_unsharded_grad(self, reduce_dtype: torch.dtype | None) -> None:
        """Keep the gradient for a later reduction, in ``reduce_dtype`` if that differs.

        As FSDP2 does without gradient sync: gradients of several backwards add up
        in the reduce dtype, not in the (lower) parameter dtype. A tensor-parallel
        gradient stays as autograd made it (a ``DTensor``, maybe ``Partial``): it is
        redistributed once, at the reduction (``take_unsharded_grad``).
        """
        if self.unsharded is None or self.unsharded.grad is None:
            return
        grad = self.unsharded.grad
        if reduce_dtype is None or grad.dtype == reduce_dtype:
            return  # autograd keeps adding to it
        self.unsharded.grad = None
        if self._accumulated is None:
            self._accumulated = grad.to(reduce_dtype)
        else:
            self._accumulated.add_(grad)

    def scatter_input(self, grad: Tensor, dtype: torch.dtype) -> Tensor:
        """``grad`` padded to ``world * chunk_rows`` rows, as ``(world, padded_shard_numel)``."""
        padded = torch.zeros(self.world * self.padded_shard_numel, dtype=dtype, device=grad.device)
        if self.dim == 0:
            padded[: grad.numel()].copy_(grad.reshape(-1))
        else:  # rank-major: rank r's slices of the dim, contiguous
            padded.view(self.world, *self.shard_shape).copy_(
                self._split_view(grad.contiguous()).movedim(self.dim, 0)
            )
        return padded.view(self.world, self.padded_shard_numel)

    def accumulate_shard_grad(self, reduced: Tensor) -> None:
        """Add this rank's averaged rows (a padded flat slice) to the sharded ``.grad``."""
        local = reduced[: self.local_rows * self.row_numel].to(self.orig_dtype, copy=True)
        self.add_shard_grad(local.view(self.shard_shape))

    def add_shard_grad(self, local: Tensor) -> None:
        """Add ``local`` (this rank's rows, in the shard's dtype) to ``.grad``, or make it that.

        A new ``.grad`` holds ``local`` itself, not a copy (FSDP2's view of its flat output).
        Then the shard's post-accumulate-grad hooks run, as FSDP2 runs them once it wrote
        ``.grad`` (an optimizer stepping in backward registers them).
        """
        grad = self.sharded.grad
        with torch.no_grad():
            if grad is None:
                self.sharded.grad = self._sharded_grad(local)
            else:
                as_dtensor(grad)._local_tensor.add_(local)
        hooks = _torch.post_accumulate_grad_hooks(self.sharded)
        if hooks:
            for hook in hooks:
                hook(self.sharded)

    def _sharded_grad(self, local: Tensor) -> DTensor:
        """``local`` as the shard's ``.grad``: a ``DTensor`` of the shard's spec.

        Made directly, as FSDP2's ``_from_local_no_grad``, without ``from_local``'s
        view, where ``local`` has the shard's local shape and dtype (the spec's).
        """
        sharded = as_dtensor(self.sharded)
        shard = sharded._local_tensor
        if local.dtype == shard.dtype and local.shape == shard.shape:
            return _torch.dtensor_like(local, sharded)
        return self.layout.sharded(local)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def as_dtensor(tensor: Tensor) -> DTensor:
    """``tensor``, typed as the ``DTensor`` it is (a sharded parameter or its gradient)."""
    if not isinstance(tensor, DTensor):
        raise TypeError(
            f"fully_shard: expected a DTensor, got {type(tensor).__qualname__}; a sharded "
            "parameter or its .grad was replaced by a plain tensor"
        )
    return tensor
