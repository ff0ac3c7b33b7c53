"""FSDP2's stream design on CUDA (`make test-gpu`, marker ``gpu``): kernels off the compute stream.

On an accelerator ``fully_shard`` copies into its all-gather on a stream of its own
and reduce-scatters on another (``_streams``); ``tests/test_fully_shard_streams.py``
checks the order of the waits and events on a fake stream API. These run it on a
CUDA device: with torch's profiler, the all-gather's copy-in and the reduce-scatter's
kernels run on streams other than the one the matmuls run on; training with
``set_post_optim_event`` and the streams gives FSDP2's losses. The ranks are PyTorch's
fake process group (2 ranks, collectives free), so one device shows both directions;
the parity run uses NCCL on one rank. Without CUDA every test here is skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fully_shard_models import GPT, batch, fake_cuda_mesh_of_two, gpt, loss_on, one_rank_cuda_mesh
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.profiler import ProfilerActivity, profile

from torchcontract.apis import fully_shard

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@pytest.fixture
def fake_cuda_mesh() -> Iterator[DeviceMesh]:
    with fake_cuda_mesh_of_two() as mesh:
        yield mesh


def _ours(model: GPT, mesh: DeviceMesh) -> GPT:
    for module in [*model.blocks, model]:
        fully_shard(module, mesh=mesh, mp_policy=BF16)
    return model


def _kernel_streams(trace: Path) -> dict[str, set[int]]:
    """The streams each kernel name ran on, from a chrome trace."""
    events = json.loads(trace.read_text())["traceEvents"]
    streams: dict[str, set[int]] = {}
    for event in events:
        if event.get("cat") == "kernel":
            streams.setdefault(event["name"], set()).add(int(event["args"]["stream"]))
    return streams


_COMPUTE_KERNELS = ("gemm", "sm90", "nvjet", "cutlass", "nll_loss", "log_softmax")


def test_copy_in_and_reduce_scatter_run_off_the_compute_stream(
    fake_cuda_mesh: DeviceMesh, tmp_path: Path
) -> None:
    model = _ours(gpt().cuda(), fake_cuda_mesh)
    tokens, targets = (part.cuda() for part in batch(0, 0))
    torch.autograd.backward(loss_on(model, tokens, targets))  # warm-up: lazy init
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        torch.autograd.backward(loss_on(model, tokens, targets))
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    profiler.export_chrome_trace(str(trace))
    streams = _kernel_streams(trace)
    # The caller's stream: its matmuls (cuBLAS names them gemm, sm90_* or nvjet_* on
    # Hopper; CUTLASS, cutlass_*) and the loss's kernels.
    compute = {
        stream
        for name, found in streams.items()
        if any(key in name.lower() for key in _COMPUTE_KERNELS)
        for stream in found
    }
    assert compute, f"no matmul or loss kernel found among {sorted(streams)}"
    others = {stream for found in streams.values() for stream in found} - compute
    # The copy-in stream (the all-gather's inputs cast to bf16) and the reduce-scatter
    # stream (the reduced shards copied into the gradients) at least.
    assert len(others) >= 2, f"kernels by stream: {streams}"


@pytest.fixture
def nccl_mesh() -> Iterator[DeviceMesh]:
    """A 1-D CUDA mesh of this one process, over NCCL."""
    with one_rank_cuda_mesh() as cuda_mesh:
        yield cuda_mesh


def _train_with_post_optim_event(model: GPT, module: FSDPModule) -> list[float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        tokens, targets = (part.cuda() for part in batch(0, step))
        loss = loss_on(model, tokens, targets)
        torch.autograd.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        event = torch.cuda.current_stream().record_event()
        module.set_post_optim_event(event)
        losses.append(float(loss))
    return losses


def test_post_optim_event_training_matches_fsdp2(nccl_mesh: DeviceMesh) -> None:
    mine = _ours(gpt().cuda(), nccl_mesh)
    reference = gpt().cuda()
    for module in [*reference.blocks, reference]:
        torch_fully_shard(module, mesh=nccl_mesh, mp_policy=BF16)
    assert isinstance(mine, FSDPModule)
    assert isinstance(reference, FSDPModule)
    ours = _train_with_post_optim_event(mine, mine)
    theirs = _train_with_post_optim_event(reference, reference)
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) <= 1e-2
