"""DDP's parameters and buffers to ignore: the FQNs a model names for data parallelism to skip.

``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)``
sets ``module._ddp_params_and_buffers_to_ignore`` (tensor parallelism and sharded
embeddings set it for parameters that are not replicas). DDP reads it once, at
construction, and so does ``replicate``: a parameter named there is neither compared
across ranks, broadcast nor averaged, and a buffer named there is never broadcast; each
rank keeps its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from torch import Tensor, nn

from torchcontract import InvalidTargetError, module_label

__all__ = ["IGNORE_ATTRIBUTE", "ignored_names", "kept_buffers", "kept_parameters"]

#: Where DDP's ``_set_params_and_buffers_to_ignore_for_model`` puts the FQNs.
IGNORE_ATTRIBUTE = "_ddp_params_and_buffers_to_ignore"


def ignored_names(module: nn.Module) -> frozenset[str]:
    """The FQNs ``module`` asks data parallelism to ignore (none if it names none)."""
    names: object = module.__dict__.get(IGNORE_ATTRIBUTE, ())
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise InvalidTargetError(
            f"replicate on {module_label(module)}: {IGNORE_ATTRIBUTE} must be a collection of "
            f"parameter and buffer FQNs, got {type(names).__qualname__}; set it with "
            "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model"
        )
    values = cast("Iterable[object]", names)
    return frozenset(str(name) for name in values)


def kept_parameters(module: nn.Module, ignored: frozenset[str]) -> list[tuple[str, nn.Parameter]]:
    """``module``'s named parameters, those in ``ignored`` left out."""
    return [(name, p) for name, p in module.named_parameters() if name not in ignored]


def kept_buffers(module: nn.Module, ignored: frozenset[str]) -> list[Tensor]:
    """``module``'s buffers, read now (a forward may replace one), those in ``ignored`` left out."""
    if not ignored:
        return list(module.buffers())
    return [buffer for name, buffer in module.named_buffers() if name not in ignored]
