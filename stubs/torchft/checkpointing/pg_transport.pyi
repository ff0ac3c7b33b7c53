from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torchft.checkpointing.transport import CheckpointTransport

T = TypeVar("T")

class PGTransport(CheckpointTransport[T]):
    def __init__(
        self,
        pg: dist.ProcessGroup,
        timeout: timedelta,
        device: torch.device,
        state_dict: Callable[[], object] | None = None,
    ) -> None: ...
