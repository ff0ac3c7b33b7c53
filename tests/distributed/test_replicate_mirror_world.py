"""replicate beside DDP in a world of identical ranks (``mirror_group``), on the CPU and on CUDA.

In a mirror world every collective computes what it would if each rank held this
one's tensors, so both APIs train as on one process, and their parameters must be
equal bitwise. The group takes tensors on the model's device only, as NCCL does:
on CUDA (marker ``gpu``), a CPU tensor in any collective of replicate's own (the model
check at apply, the bucket rebuild, the used-parameter all-reduce, Join's flags)
raises, as it would under NCCL from 2 ranks up. Each case runs 3 steps:
plain, with an unused layer under ``find_unused_parameters``, ``static_graph``, a
communication hook with ``find_unused_parameters``, the fp16 compression hook,
``gradient_as_bucket_view`` (with and without ``static_graph``), and under ``Join``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from mirror_group import MirrorGroup, mirror_world
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from torchcontract.apis import replicate
from torchcontract.apis._compat import TORCH_VERSION

#: torch 2.6's DDP waits forever in its parameter check on a process group written in
#: Python; 2.11 and later's do not (the releases between are not tested, so not assumed).
needs_ddp_on_a_python_group = pytest.mark.skipif(
    TORCH_VERSION < (2, 11),
    reason=f"DDP waits forever on a process group written in Python with torch {torch.__version__}",
)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


class Net(nn.Module):
    """Two layers, and a third that only some cases use."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 6)
        self.second = nn.Linear(6, 2)
        self.spare = nn.Linear(6, 2)

    def forward(self, x: Tensor, use_spare: bool = False) -> Tensor:
        hidden = torch.relu(self.first(x))
        out: Tensor = self.second(hidden)
        return out + self.spare(hidden) if use_spare else out


def _comm_hook(model: Any) -> None:
    model.register_comm_hook(None, default_hooks.allreduce_hook)


def _fp16_hook(model: Any) -> None:
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)


#: name: (keywords, whether the spare layer runs, what is done to the wrapped model)
CASES: dict[str, tuple[dict[str, Any], bool, Callable[[Any], None] | None]] = {
    "plain": ({}, True, None),
    "unused layer": ({"find_unused_parameters": True}, False, None),
    "static graph": ({"static_graph": True}, False, None),
    "comm hook, unused layer": ({"find_unused_parameters": True}, False, _comm_hook),
    "fp16 hook": ({}, True, _fp16_hook),
    "bucket view": ({"gradient_as_bucket_view": True}, True, None),
    "bucket view, static graph": (
        {"gradient_as_bucket_view": True, "static_graph": True},
        False,
        None,
    ),
    "join": ({}, True, None),
}


@pytest.fixture(params=DEVICES)
def world(request: pytest.FixtureRequest) -> Iterator[MirrorGroup]:
    device_type: str = request.param
    if device_type == "cuda":
        torch.cuda.set_device(0)
    with mirror_world(device_type) as group:
        yield group


def _train(model: Any, device: torch.device, use_spare: bool, joined: bool) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model]) if joined else _nothing():
        for step in range(3):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step)).to(device)
            torch.autograd.backward(model(x, use_spare=use_spare).square().mean())
            optimizer.step()
            optimizer.zero_grad()


class _nothing:  # noqa: N801 (a context manager named as contextlib's)
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@needs_ddp_on_a_python_group
@pytest.mark.parametrize("case", CASES)
def test_replicate_trains_as_ddp(world: MirrorGroup, case: str) -> None:
    keywords, use_spare, configure = CASES[case]
    device = torch.device("cuda", 0) if world.device_type == "cuda" else torch.device("cpu")
    on_device: dict[str, Any] = {"device_ids": [0]} if world.device_type == "cuda" else {}
    models: list[Any] = []
    for wrap in (replicate, DistributedDataParallel):
        torch.manual_seed(0)
        model = wrap(Net().to(device), **on_device, **keywords)
        if configure is not None:
            configure(model)
        _train(model, device, use_spare, joined=case == "join")
        models.append(model)
    ours, theirs = (dict(model.named_parameters()) for model in models)
    prefix = "module."  # DDP's names
    for name, parameter in ours.items():
        assert torch.equal(parameter, theirs[prefix + name]), name
    assert {"all_gather", "all_reduce"} <= set(world.calls)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_inputs_reach_the_modules_own_pre_hooks_on_the_device() -> None:
    """As under DDP, whose forward moves the inputs before the module's forward runs."""
    torch.cuda.set_device(0)
    seen: list[str] = []
    with mirror_world("cuda"):
        net = Net().cuda()
        net.register_forward_pre_hook(lambda module, args: seen.append(args[0].device.type))
        model: Any = replicate(net, device_ids=[0])
        model(torch.randn(4, 6))
    assert seen == ["cuda"]
