"""Bucket buffers and their views: one flat buffer per bucket, one view per parameter.

A bucket's buffer holds its parameters' gradients one after another; each
parameter's view has the parameter's shape, made once with the buffer and kept across
backwards, as DDP's. Gradients are copied in scaled; the averages are written back into
``.grad``, or, with ``gradient_as_bucket_view``, ``.grad`` is left as the view itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .. import _torch

__all__ = ["ParameterOf", "copy_in", "new_buffer", "point_into_bucket", "split", "write_back"]

#: The parameter at an index of the reducer's list: ``ContractError`` if it was freed.
ParameterOf = Callable[[int], Tensor]


def new_buffer(bucket: Sequence[int], parameter: ParameterOf) -> tuple[Tensor, list[Tensor]]:
    """A bucket's flat buffer and its views."""
    first = parameter(bucket[0])
    size = sum(parameter(index).numel() for index in bucket)
    flat = torch.empty(size, dtype=first.dtype, device=first.device)
    return flat, split(bucket, parameter, flat)


def split(bucket: Sequence[int], parameter: ParameterOf, flat: Tensor) -> list[Tensor]:
    """Views of a bucket-sized ``flat``, one per parameter in its shape.

    As DDP's bucket views: with the parameter's strides where it is dense (a
    ``channels_last`` weight's gradient keeps that layout), else contiguous.
    """
    views: list[Tensor] = []
    offset = flat.storage_offset()
    for each in (parameter(index) for index in bucket):
        if _dense(each):
            views.append(flat.as_strided(each.shape, each.stride(), offset))
        else:
            start = offset - flat.storage_offset()
            views.append(flat[start : start + each.numel()].view(each.shape))
        offset += each.numel()
    return views


def _dense(tensor: Tensor) -> bool:
    """Whether ``tensor``'s elements fill its memory once each, in some order of its dims."""
    if tensor.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted(zip(tensor.stride(), tensor.shape, strict=True)):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def copy_in(
    bucket: Sequence[int],
    grads: Sequence[Tensor | None],
    views: Sequence[Tensor],
    scale: float,
    sparse: Callable[[int], Exception],
) -> None:
    """Copy scaled gradients into the bucket one by one: zeros where there is none.

    ``sparse(index)`` is the error for a sparse gradient, which is not averaged.
    """
    for index, grad, view in zip(bucket, grads, views, strict=True):
        if grad is None:
            view.zero_()
        elif grad.is_sparse:
            raise sparse(index)
        else:
            torch.mul(grad, scale, out=view)


def write_back(
    bucket: Sequence[int], parameter: ParameterOf, views: Sequence[Tensor], used: Sequence[bool]
) -> None:
    """Each used parameter's average into its ``.grad``: copied in, or a clone where none."""
    grads: list[Tensor] = []
    averages: list[Tensor] = []
    for index, average in zip(bucket, views, strict=True):
        if not used[index]:
            continue
        each = parameter(index)
        grad = each.grad
        if grad is None:
            each.grad = average.clone()
        else:
            grads.append(grad)
            averages.append(average)
    if grads:
        _torch.copy_each(grads, averages)  # one call for the whole bucket


def point_into_bucket(
    bucket: Sequence[int],
    parameter: ParameterOf,
    flat: Tensor,
    reduced: Tensor,
    *,
    views: Sequence[Tensor],
    used: Sequence[bool],
) -> None:
    """``gradient_as_bucket_view``: each used parameter's ``.grad`` becomes its bucket view.

    As DDP's: the averages stay in the bucket buffer (a hook's own tensor is
    copied in first) and ``.grad`` is a view of it, so no gradient-sized
    tensor is kept besides the buckets; the next backward accumulates into
    the view in place, and the next launch scales it where it lies.
    """
    if reduced is not flat:
        flat.copy_(reduced)
    for index, view in zip(bucket, views, strict=True):
        if not used[index]:
            continue
        each = parameter(index)
        if each.grad is not view:
            each.grad = view
