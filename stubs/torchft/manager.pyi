from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import Tensor
from torchft.checkpointing.transport import CheckpointTransport

class Manager:
    def __init__(
        self,
        pg: dist.ProcessGroup,
        load_state_dict: Callable[[Any], None] | None,
        state_dict: Callable[[], Any] | None,
        min_replica_size: int,
        use_async_quorum: bool = True,
        timeout: timedelta = ...,
        quorum_timeout: timedelta = ...,
        connect_timeout: timedelta = ...,
        rank: int | None = None,
        world_size: int | None = None,
        store_addr: str | None = None,
        store_port: int | None = None,
        lighthouse_addr: str | None = None,
        replica_id: str | None = None,
        port: int | None = None,
        hostname: str = ...,
        checkpoint_transport: CheckpointTransport[Any] | None = None,
        init_sync: bool = True,
    ) -> None: ...
    def allreduce(self, tensor: Tensor, should_quantize: bool = False) -> dist.Work: ...
    def current_step(self) -> int: ...
    def batches_committed(self) -> int: ...
    def start_quorum(self) -> None: ...
    def should_commit(self, timeout: timedelta | None = None) -> bool: ...
    def shutdown(self, wait: bool = True) -> None: ...
