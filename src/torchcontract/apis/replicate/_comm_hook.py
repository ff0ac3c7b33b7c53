"""Communication hooks: DDP's ``register_comm_hook`` contract, and the bucket a hook receives.

A hook is ``hook(state, bucket) -> torch.futures.Future[Tensor]``, called once per
bucket in launch order with the bucket's flat buffer holding this rank's
gradients (not divided: the hook reduces and divides, as torch's hooks do); the
tensor the future gives is copied back into the parameters' ``.grad``.
torch's own hooks (``default_hooks.allreduce_hook``, ``fp16_compress_hook``,
``powerSGD_hook.powerSGD_hook`` with ``PowerSGDState``, ...) run unchanged:
``Bucket`` answers every method of torch's ``GradBucket`` they call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeAlias

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._C._distributed_c10d import GradBucket

from torchcontract import ContractError, module_label

from .. import _torch

__all__ = ["Bucket", "CommHook", "check_comm_hook", "hook_result"]

#: ``hook(state, bucket)``: a future of the bucket's reduced buffer, as DDP's hooks are
#: typed (``bucket`` is a ``Bucket`` at run time, answering ``GradBucket``'s methods).
#: The state is ``Any``: torch's own hooks annotate it ``ProcessGroup`` and are
#: registered with ``None`` (the default group), as DDP's documentation does.
CommHook: TypeAlias = Callable[[Any, GradBucket], "torch.futures.Future[Tensor]"]

_BF16_HOOKS: Final = ("bf16_compress_hook", "bf16_compress_wrapper_hook")


class Bucket:
    """What a communication hook is given: torch's ``GradBucket`` methods, on our bucket."""

    __slots__ = ("_buffer", "_gradients", "_index", "_is_last", "_parameters")

    def __init__(
        self,
        index: int,
        buffer: Tensor,
        gradients: Sequence[Tensor],
        parameters: Sequence[Tensor],
        *,
        is_last: bool,
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._gradients = list(gradients)
        self._parameters = list(parameters)
        self._is_last = is_last

    def index(self) -> int:
        """The bucket's position in launch order (0 is launched first)."""
        return self._index

    def buffer(self) -> Tensor:
        """The flat buffer: every gradient of the bucket, one after the other."""
        return self._buffer

    def gradients(self) -> list[Tensor]:
        """Each parameter's gradient as a view of ``buffer()``, in the parameter's shape.

        As ``GradBucket``'s: contiguous views of the buffer as it is now (after
        ``set_buffer``, a hook wrapping another and compressing first, of the new one),
        whatever the parameters' own strides.
        """
        views: list[Tensor] = []
        offset = 0
        for gradient in self._gradients:
            views.append(self._buffer[offset : offset + gradient.numel()].view(gradient.shape))
            offset += gradient.numel()
        return views

    def parameters(self) -> list[Tensor]:
        """The bucket's parameters, in the order of ``gradients()``."""
        return list(self._parameters)

    def is_last(self) -> bool:
        """Whether this is the last bucket of the backward (a hook's per-step work goes here)."""
        return self._is_last

    def set_buffer(self, buffer: Tensor) -> None:
        """Replace the flat buffer (a hook that compresses in place of the original may)."""
        self._buffer = buffer


def check_comm_hook(module: nn.Module, hook: object) -> None:
    """Refuse what DDP's ``_check_comm_hook`` refuses, with its exception types.

    ``TypeError`` for a hook that is not callable, or a bf16 hook without NCCL or
    XCCL (the message is DDP's); ``ValueError`` for a ``bucket`` or return
    annotation other than DDP's.
    """
    if not callable(hook):
        raise TypeError(
            f"replicate on {module_label(module)}: register_comm_hook takes a callable "
            f"hook(state, bucket) -> torch.futures.Future[Tensor], got {type(hook).__qualname__}"
        )
    signature = _signature(hook)
    bucket = signature.parameters.get("bucket")
    if bucket is not None and bucket.annotation not in (inspect.Parameter.empty, GradBucket):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    if signature.return_annotation not in (
        inspect.Signature.empty,
        torch.futures.Future[torch.Tensor],
    ):
        raise ValueError(
            "Communication hook: return annotation should be torch.futures.Future[torch.Tensor]."
        )
    if getattr(hook, "__name__", None) in _BF16_HOOKS and not _bf16_supported():
        raise TypeError(
            "BF16 all reduce communication hook required CUDA 11+ and NCCL 2.10+ or XPU and XCCL"
        )


def _signature(hook: Callable[..., object]) -> inspect.Signature:
    """``hook``'s signature, its annotations evaluated where they are strings (PEP 563).

    DDP compares the annotations as written, so it refuses a correct hook from a
    module with ``from __future__ import annotations``; evaluated, they compare.
    """
    try:
        return inspect.signature(hook, eval_str=True)
    except Exception:  # an annotation that does not evaluate: compare it as written
        return inspect.signature(hook)


def _bf16_supported() -> bool:
    """DDP's condition for its bf16 hooks: CUDA or HIP with NCCL 2.10+, or XPU with XCCL."""
    cuda = torch.version.cuda is not None or torch.version.hip is not None
    nccl = cuda and dist.is_nccl_available() and _torch.nccl_version() >= (2, 10)
    xccl = bool(getattr(dist, "is_xccl_available", lambda: False)()) and torch.xpu.is_available()
    return nccl or xccl


def hook_result(where: Callable[[], str], position: int, flat: Tensor, result: object) -> Tensor:
    """What a hook's future gave for bucket ``position``, checked: a tensor of its size.

    ``where()`` names the application, in the error only.
    """
    if not isinstance(result, Tensor) or result.numel() != flat.numel():
        given = (
            f"a tensor of {result.numel()} elements"
            if isinstance(result, Tensor)
            else type(result).__qualname__
        )
        raise ContractError(
            f"{where()}: the communication hook's future for bucket {position} gave "
            f"{given}, not a tensor of the bucket buffer's {flat.numel()} elements; return "
            "a future of the reduced bucket.buffer()"
        )
    return result
