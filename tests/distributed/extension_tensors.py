"""Tensors that define FSDP2's all-gather extension hooks, for the extension tests.

``ScaledInt8Weight``: a float32 weight all-gathered as int8 with one float32 scale
per rank (the inputs mix dtypes, so both APIs send bytes), dequantized after the
all-gather; it counts its hook calls. ``BFloat16Gathered``: gathered in bfloat16,
padded by its own pre-all-gather, as in PyTorch's own extension tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

#: Hook calls by kind, in this process (each rank is one).
CALLS: dict[str, int] = {"pre": 0, "post": 0, "post_out": 0}


class _Wrapper(torch.Tensor):
    """A wrapper subclass over a plain ``_data`` tensor: every op runs on ``_data``."""

    _data: Tensor

    @staticmethod
    def __new__(cls, data: Tensor) -> Any:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            data.stride(),
            data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(self, data: Tensor) -> None:
        self._data = data

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's stub lacks func
        cls, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        out = func(
            *pytree.tree_map_only(cls, lambda x: x._data, args),
            **pytree.tree_map_only(cls, lambda x: x._data, kwargs or {}),
        )
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    def __repr__(self) -> str:  # type: ignore[override]
        return f"{type(self).__name__}({self._data})"


def _padded(tensor: Tensor, outer_size: torch.Size, mesh: DeviceMesh) -> Tensor:
    rows = math.ceil(outer_size[0] / mesh.size())
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[: tensor.shape[0]].copy_(tensor)
    return padded


class ScaledInt8Weight(_Wrapper):
    """All-gathered as int8 data and one float32 scale per rank; dequantized to ``param_dtype``."""

    def fsdp_pre_all_gather(
        self,
        mesh: DeviceMesh,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: MixedPrecisionPolicy,
    ) -> tuple[tuple[Tensor, ...], Any]:
        CALLS["pre"] += 1
        data = _padded(self._data, outer_size, mesh)
        scale = data.abs().amax().clamp(min=1e-12).reshape(1) / 127
        quantized = (data / scale).round().clamp(-127, 127).to(torch.int8)
        return (quantized, scale), (mesh.size(),)

    @torch.no_grad()
    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: Tensor | None = None,
    ) -> tuple[Tensor, tuple[Tensor, ...]] | None:
        quantized, scales = all_gather_outputs
        (world,) = metadata
        rows = quantized.view(world, -1).float() * scales.view(world, 1)
        dequantized = rows.view(quantized.shape).to(param_dtype)
        if out is not None:
            CALLS["post_out"] += 1
            with _unsafe_preserve_version_counter(out):
                out.copy_(dequantized[: out.shape[0]])
            return None
        CALLS["post"] += 1
        return dequantized, (dequantized,)


class BFloat16Gathered(_Wrapper):
    """Gathered in bfloat16, padded by its own pre-all-gather (as PyTorch's test tensor)."""

    def fsdp_pre_all_gather(
        self,
        mesh: DeviceMesh,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: MixedPrecisionPolicy,
    ) -> tuple[tuple[Tensor, ...], Any]:
        CALLS["pre"] += 1
        return (_padded(self._data, outer_size, mesh).to(torch.bfloat16),), None

    @torch.no_grad()
    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: Tensor | None = None,
    ) -> tuple[Tensor, tuple[Tensor, ...]] | None:
        (tensor,) = all_gather_outputs
        if out is not None:
            CALLS["post_out"] += 1
            with _unsafe_preserve_version_counter(out):
                out.copy_(tensor[: out.shape[0]])
            return None
        CALLS["post"] += 1
        upcast = tensor.to(param_dtype)
        return upcast, (tensor, upcast)


def plain(tensor: Tensor) -> Tensor:
    """``tensor`` without the wrapper, for comparing values."""
    return tensor._data if isinstance(tensor, _Wrapper) else tensor
