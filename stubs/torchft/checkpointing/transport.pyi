from typing import Generic, TypeVar

T = TypeVar("T")

class CheckpointTransport(Generic[T]): ...
