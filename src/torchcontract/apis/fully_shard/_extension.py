"""FSDP2's all-gather extensions of a parameter: ``fsdp_pre_all_gather``, ``fsdp_post_all_gather``.

A shard's local tensor (a tensor subclass such as torchao's float8 or NF4
weights, or any tensor with the two methods set on it) may say what is
all-gathered and how the unsharded parameter is made from it, as FSDP2 defines
the protocol (``FSDPParam.all_gather_inputs`` / ``init_unsharded_param``):

- ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)``
  (or the older ``fsdp_pre_all_gather(mesh)``) returns the all-gather inputs and
  metadata; ``mesh`` is the 1-D shard mesh, ``outer_size`` the unsharded
  (TP-local) shape. On a rank whose shard is padded, every input must have the
  padded shard's shape.
- ``fsdp_post_all_gather(outputs, metadata, param_dtype)`` returns the unsharded
  tensor and the inner tensors to free at reshard, the first time; later gathers
  call it with ``out=`` the unsharded parameter, to refill it in place.

The all-gather outputs are kept, as FSDP2's: allocated once, their storage freed
at reshard and reallocated at the next gather, so an unsharded parameter built
on them (the extension's inner tensors) stays valid for autograd.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from torchcontract import AllGatherExtensionError

__all__ = ["Extension", "defines_hooks"]

_PRE: str = "fsdp_pre_all_gather"
_POST: str = "fsdp_post_all_gather"

_PreHook = Callable[..., tuple[Sequence[Tensor], object]]
_PostHook = Callable[..., tuple[Tensor, Sequence[Tensor]] | None]


def defines_hooks(local: Tensor, where: str) -> bool:
    """Whether ``local`` (a shard's local tensor) defines the all-gather hooks.

    Raises ``AllGatherExtensionError`` (an ``AssertionError``, as FSDP2's) if it
    defines only one of the two; ``where`` names the parameter.
    """
    pre, post = hasattr(local, _PRE), hasattr(local, _POST)
    if pre != post:
        given, missing = (_PRE, _POST) if pre else (_POST, _PRE)
        raise AllGatherExtensionError(
            f"{where}: its local tensor ({type(local).__qualname__}) defines {given} but not "
            f"{missing}; define both to use all-gather extensions (FSDP2: Both "
            "fsdp_pre_all_gather and fsdp_post_all_gather should be defined if using "
            "all-gather extensions), or neither"
        )
    return pre


def _storage_alloc(tensor: Tensor) -> None:
    size = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    if storage.size() != size:
        storage.resize_(size)


def _storage_free(tensor: Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


class Extension:
    """One parameter's all-gather extension state, between its pre- and post-all-gather.

    ``sizes`` and ``dtypes``: the pre-all-gather outputs' (per-rank inputs) shapes
    and dtypes at the last call; ``outputs``: the kept all-gather outputs, flat;
    ``inner``: the tensors the post-all-gather said to free at reshard.
    """

    __slots__ = ("dtypes", "inner", "kept", "made", "mesh", "metadata", "outputs", "sizes", "where")

    def __init__(self, mesh: DeviceMesh, where: str) -> None:
        self.mesh = mesh  # the 1-D shard mesh the pre-all-gather is given
        self.where = where
        self.metadata: object = None
        self.sizes: list[torch.Size] = []
        self.dtypes: list[torch.dtype] = []
        self.outputs: list[Tensor] = []
        self.inner: list[Tensor] = []
        self.kept: list[
            Tensor
        ] = []  # this rank's rows of the outputs, after a post-forward reshard
        self.made = False  # whether the post-all-gather built the unsharded tensor already

    def inputs(
        self,
        local: Tensor,
        shape: torch.Size,
        padded_shape: torch.Size,
        module: nn.Module | None,
        mp_policy: MixedPrecisionPolicy,
    ) -> list[Tensor]:
        """Call the pre-all-gather: this rank's all-gather inputs, flat, as FSDP2 calls it.

        ``shape``: the unsharded (TP-local) shape; ``padded_shape``: the padded shard's.
        Raises ``AllGatherExtensionError`` for a hook of another arity, or inputs of
        another shape than the padded shard's on a rank whose shard is padded.
        """
        hook = cast(_PreHook, getattr(local, _PRE))
        count = len(inspect.signature(hook).parameters)
        if count not in (1, 5):
            raise AllGatherExtensionError(
                f"{self.where}: {_PRE} takes {count} arguments; define "
                f"{_PRE}(self, mesh, outer_size, outer_stride, module, mp_policy) (or the "
                f"older {_PRE}(self, mesh))"
            )
        if count == 1:
            inputs, self.metadata = hook(self.mesh)
        else:
            stride = _contiguous_stride(shape)
            inputs, self.metadata = hook(self.mesh, shape, stride, module, mp_policy)
            if local.shape != padded_shape and any(
                tensor.shape != padded_shape for tensor in inputs
            ):
                raise AllGatherExtensionError(
                    f"{self.where}: {_PRE} returned inputs of shapes "
                    f"{[tuple(tensor.shape) for tensor in inputs]} for a shard padded to "
                    f"{tuple(padded_shape)} (unsharded shape {tuple(shape)}, "
                    f"{self.mesh.size()} ranks); pad each input to the padded shard's shape"
                )
        self.sizes = [tensor.size() for tensor in inputs]
        self.dtypes = [tensor.dtype for tensor in inputs]
        return [tensor.reshape(-1) for tensor in inputs]

    def allocated_outputs(self, world: int, device: torch.device) -> list[Tensor]:
        """The kept all-gather outputs (``world`` inputs each), storage allocated, flat."""
        numels = [world * size.numel() for size in self.sizes]
        if [tensor.numel() for tensor in self.outputs] != numels or [
            tensor.dtype for tensor in self.outputs
        ] != self.dtypes:
            self.outputs = [
                torch.empty(numel, dtype=dtype, device=device)
                for numel, dtype in zip(numels, self.dtypes, strict=True)
            ]
            self.made = False  # other outputs: the post-all-gather builds a new tensor on them
        for tensor in self.outputs:
            _storage_alloc(tensor)
        return self.outputs

    def unshard(self, local: Tensor, param_dtype: torch.dtype, out: Tensor | None) -> Tensor | None:
        """Call the post-all-gather on the outputs: the new unsharded tensor, or None if refilled.

        The first time (or after the outputs changed) it builds the tensor; later it
        refills ``out``, the unsharded parameter, in place (FSDP2's ``out=`` form).
        """
        hook = cast(_PostHook, getattr(local, _POST))
        outputs = tuple(
            tensor.view(-1, *size[1:])
            for tensor, size in zip(self.outputs, self.sizes, strict=True)
        )
        if self.made and out is not None:
            for tensor in self.inner:
                _storage_alloc(tensor)
            hook(outputs, self.metadata, param_dtype, out=out)
            return None
        result = hook(outputs, self.metadata, param_dtype)
        if result is None:
            raise AllGatherExtensionError(
                f"{self.where}: {_POST} without out= returned None; return (unsharded tensor, "
                "tensors to free at reshard)"
            )
        tensor, inner = result
        self.inner = list(inner)
        self.made = True
        return tensor

    def keep(self, rank: int, size: int) -> None:
        """Keep rank ``rank`` of ``size``'s rows of each output (a post-forward reshard); free."""
        kept: list[Tensor] = []
        for tensor in self.outputs:
            rows = tensor.view(size, -1)
            kept.append(rows[rank].clone())
        self.kept = kept
        self.free()

    def take_kept(self) -> list[Tensor]:
        """What ``keep`` kept, for the all-gather over the post-forward mesh."""
        kept, self.kept = self.kept, []
        return kept

    def free(self) -> None:
        """Free the outputs' and the inner tensors' storage (reshard)."""
        for tensor in (*self.outputs, *self.inner):
            _storage_free(tensor)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride: list[int] = []
    running = 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))
