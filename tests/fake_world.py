"""PyTorch's fake process group: this process plays rank 0 of a world of any size.

Collectives move nothing, so a test can build meshes of thousands of ranks on meta or
CPU tensors and check layout, placements and bytes without starting a process.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

__all__ = ["fake_mesh", "fake_ranks"]


@contextmanager
def fake_ranks(world: int) -> Iterator[None]:
    """The default process group, fake, of ``world`` ranks, for the block; taken down after."""
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextmanager
def fake_mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> Iterator[DeviceMesh]:
    """A CPU mesh of ``shape`` (dims named ``names``) over a fake world of its size."""
    with fake_ranks(math.prod(shape)):
        yield init_device_mesh("cpu", shape, mesh_dim_names=names)
