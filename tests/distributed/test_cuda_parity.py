"""Parity on one CUDA device: what a GPU user runs first (`make test-gpu`, marker ``gpu``).

The rest of the suite runs on gloo and CPU. These tests run the same comparisons on one
CUDA device with NCCL, world size 1, in this process: ``fully_shard`` against PyTorch's
``fully_shard`` (FSDP2) plain, under bfloat16 mixed precision and with explicit
prefetching; ``CPUOffloadPolicy``, which ``fully_shard`` refuses on an accelerator mesh;
and ``replicate`` against ``DistributedDataParallel``, also as GPU scripts call it,
``device_ids=[0]`` with batches left on the CPU. Each trains the same seeded GPT
on the same batches with Adam and compares losses and parameters. Without CUDA every test
here is skipped; ``make test`` and CI deselect the marker.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from fully_shard_models import (
    GPT,
    batch,
    full_parameters,
    gpt,
    largest_gap,
    loss_on,
    one_rank_cuda_mesh,
)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn.parallel import DistributedDataParallel

from torchcontract.apis import fully_shard, replicate
from torchcontract.apis.fully_shard import (
    set_modules_to_backward_prefetch,
    set_modules_to_forward_prefetch,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not dist.is_nccl_available(), reason="needs a torch built with NCCL"),
]

STEPS = 3
#: As on gloo (tests/distributed/test_fully_shard_gloo.py): the same kernels on both sides.
TOLERANCE = 1e-6
#: bfloat16 rounds at 2**-8: both sides run the same casts, so their gap stays far below it.
BFLOAT16_TOLERANCE = 1e-2

Shard = Callable[[GPT, DeviceMesh], None]


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    """A 1-D CUDA mesh of this one process, over NCCL."""
    with one_rank_cuda_mesh() as cuda_mesh:
        yield cuda_mesh


def _train(model: nn.Module) -> list[float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        tokens, targets = (part.cuda() for part in batch(0, step))
        loss = loss_on(model, tokens, targets)
        torch.autograd.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def _ours(policy: MixedPrecisionPolicy) -> Shard:
    def shard(model: GPT, mesh: DeviceMesh) -> None:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)

    return shard


def _torch(policy: MixedPrecisionPolicy) -> Shard:
    def shard(model: GPT, mesh: DeviceMesh) -> None:
        for block in model.blocks:
            torch_fully_shard(block, mesh=mesh, mp_policy=policy)
        torch_fully_shard(model, mesh=mesh, mp_policy=policy)

    return shard


def _compare(
    mesh: DeviceMesh, ours: Shard, theirs: Shard, tolerance: float, *, built_on_cpu: bool = False
) -> None:
    mine, reference = (gpt() if built_on_cpu else gpt().cuda() for _ in range(2))
    ours(mine, mesh)
    theirs(reference, mesh)
    my_losses, their_losses = _train(mine), _train(reference)
    assert max(abs(a - b) for a, b in zip(my_losses, their_losses, strict=True)) <= tolerance
    assert largest_gap(full_parameters(mine), full_parameters(reference)) <= tolerance


def test_fully_shard_matches_fsdp2_on_cuda(mesh: DeviceMesh) -> None:
    policy = MixedPrecisionPolicy()
    _compare(mesh, _ours(policy), _torch(policy), TOLERANCE)


def test_a_model_built_on_the_cpu_is_moved_to_the_meshs_device_as_fsdp2_moves_it(
    mesh: DeviceMesh,
) -> None:
    policy = MixedPrecisionPolicy()
    model = gpt()
    _ours(policy)(model, mesh)
    where = {tensor.device for tensor in [*model.parameters(), *model.buffers()]}
    assert where == {torch.device("cuda", torch.cuda.current_device())}
    _compare(mesh, _ours(policy), _torch(policy), TOLERANCE, built_on_cpu=True)


def test_fully_shard_matches_fsdp2_under_bfloat16_mixed_precision_on_cuda(
    mesh: DeviceMesh,
) -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _compare(mesh, _ours(policy), _torch(policy), BFLOAT16_TOLERANCE)


def test_fully_shard_with_explicit_prefetch_matches_fsdp2_on_cuda(mesh: DeviceMesh) -> None:
    policy = MixedPrecisionPolicy()

    def ours(model: GPT, mesh: DeviceMesh) -> None:
        _ours(policy)(model, mesh)
        first, second = model.blocks
        set_modules_to_forward_prefetch(first, [second])
        set_modules_to_backward_prefetch(second, [first])

    def theirs(model: GPT, mesh: DeviceMesh) -> None:
        _torch(policy)(model, mesh)
        first, second = model.blocks
        assert isinstance(first, FSDPModule)
        assert isinstance(second, FSDPModule)
        first.set_modules_to_forward_prefetch([second])
        second.set_modules_to_backward_prefetch([first])

    _compare(mesh, ours, theirs, TOLERANCE)


def test_cpu_offload_policy_is_refused_on_a_cuda_mesh_and_changes_nothing(
    mesh: DeviceMesh,
) -> None:
    model = gpt().cuda()
    before = {name: parameter.clone() for name, parameter in model.named_parameters()}
    with pytest.raises(NotImplementedError, match="CPUOffloadPolicy"):
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
    assert not fully_shard.is_applied(model)
    after = dict(model.named_parameters())
    assert all(torch.equal(after[name], value) for name, value in before.items())


def test_replicate_matches_distributed_data_parallel_on_cuda(mesh: DeviceMesh) -> None:
    mine = gpt().cuda()
    reference = copy.deepcopy(mine)
    replicate(mine)
    wrapped = DistributedDataParallel(reference, device_ids=[0], find_unused_parameters=True)
    my_losses, their_losses = _train(mine), _train(wrapped)
    assert max(abs(a - b) for a, b in zip(my_losses, their_losses, strict=True)) <= TOLERANCE
    assert largest_gap(dict(mine.named_parameters()), dict(reference.named_parameters())) <= (
        TOLERANCE
    )


def _train_from_cpu_batches(model: nn.Module) -> tuple[list[float], set[torch.device]]:
    """Train on batches left on the CPU: the losses, and the devices the outputs were on."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses: list[float] = []
    devices: set[torch.device] = set()
    for step in range(STEPS):
        tokens, targets = batch(0, step)  # on the CPU: device_ids=[0] copies them over
        logits: torch.Tensor = model(tokens)
        devices.add(logits.device)
        loss = nn.functional.cross_entropy(
            logits.reshape(targets.numel(), -1).float(), targets.cuda().reshape(-1)
        )
        torch.autograd.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses, devices


def test_replicate_with_device_ids_matches_distributed_data_parallel_on_cuda(
    mesh: DeviceMesh,
) -> None:
    """The GPU line, ``replicate(model, device_ids=[local_rank])``, beside DDP's."""
    mine = gpt().cuda()
    reference = copy.deepcopy(mine)
    storages = [parameter.data_ptr() for parameter in mine.parameters()]
    replicate(mine, device_ids=[0])
    assert [parameter.data_ptr() for parameter in mine.parameters()] == storages  # moves nothing
    wrapped = DistributedDataParallel(reference, device_ids=[0])
    (my_losses, my_devices), (their_losses, their_devices) = (
        _train_from_cpu_batches(mine),
        _train_from_cpu_batches(wrapped),
    )
    assert my_devices == their_devices == {torch.device("cuda", 0)}
    assert max(abs(a - b) for a, b in zip(my_losses, their_losses, strict=True)) <= TOLERANCE
    assert largest_gap(dict(mine.named_parameters()), dict(reference.named_parameters())) <= (
        TOLERANCE
    )


def test_device_ids_with_two_devices_is_refused_on_cuda_as_ddp(
    mesh: DeviceMesh,
) -> None:
    """Two devices in device_ids: DDP's ValueError, ours a subclass naming replicate."""
    with pytest.raises(ValueError, match="device_ids"):
        DistributedDataParallel(nn.Linear(2, 2).cuda(), device_ids=[0, 0])
    with pytest.raises(ValueError, match=r"replicate on Linear: device_ids can hold one"):
        replicate(nn.Linear(2, 2).cuda(), device_ids=[0, 0])
