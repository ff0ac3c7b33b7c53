"""Which groups fully_shard asks to average (``ReduceOp.AVG``), and which it sums then divides.

FSDP2 passes ``ReduceOp.AVG``; the backend serving the tensors' device decides
whether that works: the accelerators' libraries and gloo from torch 2.13 average,
torch 2.6's gloo sums silently in a reduce-scatter. A group of several backends
(``"cpu:gloo,cuda:gloo"``) is named after none of them: the CPU tensors' backend
decides. A group written in Python is judged by its own name.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from python_group import PythonGroup

from torchcontract.apis import _compat, _torch

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("default_group", "averages"),
    [
        ("gloo", _compat.GLOO_AVERAGES),
        ("cpu:gloo,cuda:gloo", _compat.GLOO_AVERAGES),
        ("fake", True),
    ],
    indirect=["default_group"],
)
def test_the_backend_serving_the_device_decides(
    default_group: dist.ProcessGroup, averages: bool
) -> None:
    assert _torch.averages_in_collectives(default_group, CPU) is averages


class _Named(PythonGroup):
    backend = "mirror"


class _Gloo(PythonGroup):
    backend = "delayed_gloo"


class _Unnamed(PythonGroup):
    def getBackendName(self) -> str:
        raise NotImplementedError("not implemented")


@pytest.mark.parametrize(
    ("group", "averages"),
    [(_Named, False), (_Gloo, _compat.GLOO_AVERAGES), (_Unnamed, False)],
)
def test_a_group_written_in_python_is_judged_by_its_name(
    group: type[PythonGroup], averages: bool
) -> None:
    """Unknown (or unnamed, as torchft's base class raises): summed, then divided."""
    assert _torch.averages_in_collectives(group(0, 2), CPU) is averages
