"""Typed views of the few torch functions the testing helpers call that torch leaves unannotated."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Final, cast

import torch
import torch.distributed as dist

__all__ = ["barrier", "fork_rng", "manual_seed"]

#: ``fork_rng(devices, enabled, device_type=...)``: restores the RNG states on exit.
fork_rng: Final = cast(Callable[..., AbstractContextManager[None]], torch.random.fork_rng)

#: ``torch.manual_seed(seed)``: seeds every device's default generator.
manual_seed: Final = cast(Callable[[int], object], torch.manual_seed)

_barrier: Final = cast(Callable[[], object], dist.barrier)


def barrier() -> None:
    """Wait until every rank of the default group reaches this call."""
    _barrier()
