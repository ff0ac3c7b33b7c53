"""DDP's keywords that decide no bucket: buffer syncing, deprecated ones, ones not implemented.

``broadcast_buffers`` and ``forward_sync_buffers`` resolve as DDP resolves them
(``DistributedDataParallel.__init__``): ``forward_sync_buffers``, where given, says
whether buffers are synced before each forward, and rank 0's buffers are copied at
apply; else ``broadcast_buffers`` (None: True) says both. Where this torch's DDP
deprecates ``broadcast_buffers`` (it takes ``forward_sync_buffers``), passing it warns
as DDP warns, with a ``FutureWarning``. A keyword this torch's DDP lacks is refused
with a ``TypeError``, as DDP refuses it, where given another value than its default (at
its default it asks for nothing that DDP does not do).
"""

from __future__ import annotations

import warnings

import attrs
import torch
from torch import nn

from torchcontract import ContractError, module_label

from .. import _compat
from ..checkpoint import require_bool

__all__ = [
    "BufferSync",
    "KeywordNotInThisTorchError",
    "UnsupportedKeywordError",
    "buffer_sync",
    "refuse_unsupported",
    "require_ddp_keyword",
    "warn_check_reduction",
]


class KeywordNotInThisTorchError(ContractError, TypeError):
    """A keyword of a newer ``DistributedDataParallel`` than the installed torch's."""


class UnsupportedKeywordError(ContractError, NotImplementedError):
    """A keyword of DDP's given a value ``replicate`` does not implement."""


def require_ddp_keyword(module: nn.Module, keyword: str, given: bool) -> None:
    """Refuse a keyword of DDP's that this torch's DDP does not take, as DDP: a TypeError."""
    if given and keyword not in _compat.DDP_KEYWORDS:
        raise KeywordNotInThisTorchError(
            f"replicate on {module_label(module)}: {keyword}= is a keyword of a newer "
            f"DistributedDataParallel than torch {torch.__version__}'s, which replicate "
            "follows; upgrade torch, or leave it out"
        )


@attrs.frozen
class BufferSync:
    """Whether buffers are synced before each forward, and whether at apply."""

    forward: bool
    at_apply: bool


def buffer_sync(
    module: nn.Module, broadcast_buffers: object, forward_sync_buffers: object
) -> BufferSync:
    """DDP's resolution of its two buffer keywords, with DDP's deprecation warnings."""
    require_ddp_keyword(module, "forward_sync_buffers", forward_sync_buffers is not None)
    where = f"replicate on {module_label(module)}"
    if broadcast_buffers is not None:
        require_bool("replicate", module, "broadcast_buffers", broadcast_buffers)
        if "forward_sync_buffers" in _compat.DDP_KEYWORDS:
            warnings.warn(_deprecation(where, forward_sync_buffers), FutureWarning, stacklevel=4)
    if forward_sync_buffers is not None:
        require_bool("replicate", module, "forward_sync_buffers", forward_sync_buffers)
        return BufferSync(forward=bool(forward_sync_buffers), at_apply=True)
    synced = broadcast_buffers is not False
    return BufferSync(forward=synced, at_apply=synced)


def _deprecation(where: str, forward_sync_buffers: object) -> str:
    if forward_sync_buffers is not None:
        return (
            f"{where}: both broadcast_buffers and forward_sync_buffers were given; "
            "broadcast_buffers is deprecated (as in DistributedDataParallel) and its value "
            "is ignored: leave it out"
        )
    return (
        f"{where}: broadcast_buffers is deprecated, as in DistributedDataParallel; use "
        "forward_sync_buffers. Unlike broadcast_buffers=False, forward_sync_buffers=False "
        "still copies rank 0's buffers at apply: keep broadcast_buffers=False where "
        "buffers must stay rank-local"
    )


def warn_check_reduction(module: nn.Module, check_reduction: object) -> None:
    """DDP's warning for its deprecated ``check_reduction``, which changes nothing."""
    if check_reduction:
        warnings.warn(
            f"replicate on {module_label(module)}: check_reduction is deprecated in "
            "DistributedDataParallel and does nothing; leave it out",
            FutureWarning,
            stacklevel=4,
        )


def refuse_unsupported(module: nn.Module, keyword: str, given: bool, instead: str) -> None:
    """Refuse a value of DDP's ``keyword`` that replicate does not implement."""
    require_ddp_keyword(module, keyword, given)
    if given:
        raise UnsupportedKeywordError(
            f"replicate on {module_label(module)}: {keyword}= is not implemented; {instead}"
        )
