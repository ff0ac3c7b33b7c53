"""The collectives fully_shard and FSDP2 issue and the unsharded parameters they hold, recorded.

Shared by the fully_shard gloo tests that compare more than numbers: ours is observed
through the functions its collectives go through (``apis._torch``), FSDP2 through
``torch.distributed``'s; both replaced only inside the rank, for the block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from torchcontract.apis import _torch
from torchcontract.apis._let_go import Collective as Handle

#: One collective: (kind, input elements), in the order issued.
Collective = tuple[str, int]


class Recorder:
    """The collectives issued, the unsharded parameters seen, while a model trains.

    Ours is observed through the two functions its collectives go through
    (``apis._torch``), FSDP2 through ``torch.distributed``'s; both replaced only
    inside this rank, for the block.
    """

    def __init__(self) -> None:
        self.collectives: list[Collective] = []
        self.unsharded: dict[int, Tensor] = {}

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        saved: dict[tuple[object, str], Callable[..., Any]] = {
            (_torch, name): getattr(_torch, name)
            for name in (
                "all_gather_into",
                "all_gather_into_async",
                "reduce_scatter_average",
                "reduce_scatter_sum",
            )
            if hasattr(_torch, name)  # the asynchronous gather serves prefetching
        }
        for name in ("all_gather_single", "reduce_scatter_single"):
            if hasattr(dist, name):
                saved[(dist, name)] = getattr(dist, name)

        def wrap(kind: str, function: Callable[..., Any], position: int) -> Callable[..., Any]:
            def recorded(*args: Any, **kwargs: Any) -> Any:
                tensor = args[position] if len(args) > position else kwargs["input"]
                self.collectives.append((kind, tensor.numel()))
                return function(*args, **kwargs)

            return recorded

        kinds = {"all_gather": "all_gather", "reduce_scatter": "reduce_scatter"}
        try:
            for (owner, name), function in saved.items():
                kind = next(kind for prefix, kind in kinds.items() if name.startswith(prefix))
                setattr(owner, name, wrap(kind, function, 1))
            yield
        finally:
            for (owner, name), function in saved.items():
                setattr(owner, name, function)

    def watch(self, module: nn.Module) -> None:
        """Keep every parameter registered unsharded when ``module``'s forward starts.

        The pre-hook runs after the API's own (registered first, or prepended), so
        the parameters are gathered by then.
        """

        def seen(_: nn.Module, args: tuple[Any, ...]) -> None:
            for parameter in module.parameters():
                if not isinstance(parameter, DTensor):
                    self.unsharded[id(parameter)] = parameter

        module.register_forward_pre_hook(seen)

    def alive_bytes(self) -> int:
        """The bytes of storage the unsharded parameters seen so far still hold."""
        return sum(tensor.untyped_storage().nbytes() for tensor in self.unsharded.values())


@contextlib.contextmanager
def recording_all_reduces(found: list[int]) -> Iterator[None]:
    """Append the bytes of each all-reduce either API issues to ``found``, inside the block."""
    ours, ours_average, theirs = _torch.all_reduce, _torch.all_reduce_average, dist.all_reduce

    def record(tensor: Tensor) -> None:
        found.append(tensor.numel() * tensor.element_size())

    def recorded_ours(tensor: Tensor, group: dist.ProcessGroup) -> Handle:
        record(tensor)
        return ours(tensor, group)

    def recorded_ours_average(tensor: Tensor, group: dist.ProcessGroup) -> None:
        record(tensor)
        ours_average(tensor, group)

    def recorded_theirs(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        record(tensor)
        return theirs(tensor, *args, **kwargs)

    _torch.all_reduce, _torch.all_reduce_average = recorded_ours, recorded_ours_average
    dist.all_reduce = recorded_theirs
    try:
        yield
    finally:
        _torch.all_reduce, _torch.all_reduce_average, dist.all_reduce = ours, ours_average, theirs
