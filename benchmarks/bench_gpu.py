"""``make bench-gpu``: fully_shard beside FSDP2 on one GPU, step time and peak memory.

A llama-style model (RMSNorm, attention, SwiGLU feed-forward), bf16 parameters and
fp32 reduction, every block sharded then the root, AdamW; each row alternates runs
of the two libraries (ours first, then torch's, ``--runs`` times), each run a fresh
model trained on the same batches, with ``gc.collect()`` and an emptied cache between
runs (FSDP2's modules sit in reference cycles and would otherwise inflate the next
run's memory). A run's step time is the median of its timed steps; a row's, the
median over its runs. Peak memory is the most allocated during a run's steps, and
the most the caching allocator reserved: a buffer freed while another stream still
reads it (``record_stream``) leaves the allocated count at once but stays reserved,
where FSDP2 keeps such buffers referenced until it is done with them.

Rows: (a) 8 blocks, dim 512, sequence 512, one NCCL rank; (b) the same with each
block compiled; (c) 16 blocks, dim 2048 (0.94B parameters), one NCCL rank;
(d) 32 blocks, dim 4096 (6.7B), a fake 8-rank group (backend ``fake``: collectives
are free, so the row measures everything else). The compiled row runs last: it needs
a C compiler for triton, which a machine may lack. A row that fails is reported as
failed and the others still run; the table is written after each row. Writes a
markdown table with the machine, torch and date to ``benchmarks/results/gpu.md``,
which the performance page includes. Sized to finish in under 4 minutes on one H200.

Plain python, torch and this package only: ``PYTHONPATH=src python3
benchmarks/bench_gpu.py``. ``--smoke`` runs every row in a tiny size on the CPU
(gloo for NCCL, ``eager`` for the compiler), as ``make test`` checks.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn import functional

from torchcontract.apis import fully_shard

OUTPUT = Path(__file__).resolve().parent / "results" / "gpu.md"
LIBRARIES = ("torchcontract", "torch")
POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
VOCABULARY = 32000


@dataclass(frozen=True)
class Row:
    """One row of the table: the model, the group it runs on, how long it runs."""

    blocks: int
    dim: int
    sequence: int
    batch: int
    world: int  # 1: a real one-rank group (NCCL); more: a fake group of that many ranks
    compiled: bool = False
    warmup: int = 3
    steps: int = 10

    @property
    def vocabulary(self) -> int:
        return VOCABULARY if self.dim >= 256 else 256

    @property
    def label(self) -> str:
        with torch.device("meta"):
            parameters = sum(
                p.numel() for p in Llama(self.blocks, self.dim, self.vocabulary).parameters()
            )
        compiled = ", blocks compiled" if self.compiled else ""
        return (
            f"{self.blocks} blocks, dim {self.dim}, seq {self.sequence}, batch {self.batch} "
            f"({parameters / 1e9:.2f}B){compiled}"
        )


ROWS = (
    Row(8, 512, 512, 8, 1),
    Row(16, 2048, 512, 4, 1, warmup=2, steps=6),
    Row(32, 4096, 1024, 1, 8, warmup=2, steps=4),
    Row(8, 512, 512, 8, 1, compiled=True),
)


def _smoke(row: Row) -> Row:
    return Row(2, 32, 16, 2, row.world, row.compiled, warmup=1, steps=2)


# ----------------------------------------------------------------- the model


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        batch, sequence, dim = x.shape
        q, k, v = self.qkv(x).view(batch, sequence, 3, self.heads, -1).unbind(2)
        attended = functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return cast(Tensor, self.out(attended.transpose(1, 2).reshape(batch, sequence, dim)))


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        hidden = 256 * math.ceil(int(8 * dim / 3) / 256)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return cast(Tensor, self.down(functional.silu(self.gate(x)) * self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, max(1, dim // 128))
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        return cast(Tensor, x + self.feed_forward(self.ffn_norm(x)))


class Llama(nn.Module):
    def __init__(self, blocks: int, dim: int, vocabulary: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocabulary, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return cast(Tensor, self.head(self.norm(x)))


# ----------------------------------------------------------------- one run


def _sharded(row: Row, library: str, mesh: DeviceMesh, vocabulary: int) -> Llama:
    """The model on meta, sharded by ``library``, then materialized on the mesh's device."""
    with torch.device("meta"):
        model = Llama(row.blocks, row.dim, vocabulary)
    apply: Callable[..., Any] = torch_fully_shard if library == "torch" else fully_shard
    for block in model.blocks:
        if row.compiled:
            block.compile(backend="eager" if mesh.device_type == "cpu" else "inductor")
        apply(block, mesh=mesh, mp_policy=POLICY)
    apply(model, mesh=mesh, mp_policy=POLICY)
    model.to_empty(device=mesh.device_type)
    generator = torch.Generator(device=mesh.device_type).manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
            if local.ndim == 1:
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02, generator=generator)
    return model


def _synchronize(device: str) -> None:
    if device != "cpu":
        torch.get_device_module(device).synchronize()


Batch = tuple[Tensor, Tensor]


#: Peak bytes of a run: the most allocated, the most reserved (None on the CPU).
Peak = tuple[int, int] | None


def _run(
    row: Row, library: str, mesh: DeviceMesh, batches: list[Batch], vocabulary: int
) -> tuple[float, Peak]:
    """One run: a fresh model, warm-up steps, timed steps; (median seconds, peak bytes)."""
    device = mesh.device_type
    _collect(device)
    if device != "cpu":
        torch.get_device_module(device).reset_peak_memory_stats()
    model = _sharded(row, library, mesh, vocabulary)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    times: list[float] = []
    for index in range(row.warmup + row.steps):
        tokens, targets = batches[index % len(batches)]
        _synchronize(device)
        started = time.perf_counter()
        _step(model, optimizer, tokens, targets)
        _synchronize(device)
        if index >= row.warmup:
            times.append(time.perf_counter() - started)
    peak: Peak = None
    if device != "cpu":
        module = torch.get_device_module(device)
        peak = (module.max_memory_allocated(), module.max_memory_reserved())
    del model, optimizer
    _collect(device)
    return statistics.median(times), peak


def _step(
    model: nn.Module, optimizer: torch.optim.Optimizer, tokens: Tensor, targets: Tensor
) -> None:
    """Forward, cross-entropy, backward and the optimizer's step (nothing kept after)."""
    logits: Tensor = model(tokens)
    loss = functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    torch.autograd.backward(loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _collect(device: str) -> None:
    gc.collect()
    if device != "cpu":
        torch.get_device_module(device).empty_cache()


# ----------------------------------------------------------------- groups


@contextmanager
def _group(row: Row, device: str) -> Iterator[DeviceMesh]:
    """A real one-rank group (NCCL, or gloo on the CPU), or a fake one of ``row.world`` ranks."""
    if row.world == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        backend = "gloo" if device == "cpu" else "nccl"
        dist.init_process_group(backend, rank=0, world_size=1)
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=row.world)
    try:
        yield init_device_mesh(device, (row.world,))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ----------------------------------------------------------------- the table


@dataclass(frozen=True)
class Result:
    """A row's figures per library, or why the row failed (``failure``)."""

    row: Row
    seconds: dict[str, float]
    peaks: dict[str, Peak]
    failure: str | None = None


def measure(row: Row, device: str, runs: int) -> Result:
    """Both libraries on ``row``, alternating runs on the same batches."""
    vocabulary = row.vocabulary
    generator = torch.Generator().manual_seed(0)

    def tokens() -> Tensor:
        shape = (row.batch, row.sequence)
        return torch.randint(0, vocabulary, shape, generator=generator).to(device)

    batches = [(tokens(), tokens()) for _ in range(2)]
    times: dict[str, list[float]] = {library: [] for library in LIBRARIES}
    peaks: dict[str, Peak] = dict.fromkeys(LIBRARIES)
    with _group(row, device) as mesh:
        for _ in range(runs):
            for library in LIBRARIES:
                seconds, peak = _run(row, library, mesh, batches, vocabulary)
                times[library].append(seconds)
                if peak is not None:
                    allocated, reserved = peaks[library] or (0, 0)
                    peaks[library] = (max(allocated, peak[0]), max(reserved, peak[1]))
    return Result(
        row, {library: statistics.median(found) for library, found in times.items()}, peaks
    )


def _gib(peak: Peak) -> str:
    """``allocated / reserved`` in GiB."""
    return "n/a" if peak is None else f"{peak[0] / 2**30:.2f} / {peak[1] / 2**30:.2f} GiB"


def table(results: list[Result], device: str, runs: int) -> str:
    """The markdown table, with the machine, torch and date it was measured on."""
    if device == "cpu":
        machine = f"CPU ({platform.processor() or platform.machine()}), smoke size"
    else:
        module = torch.get_device_module(device)
        machine = f"{module.get_device_name()} ({device})"
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"Measured by `make bench-gpu` on {machine}, torch {torch.__version__}, {date}: "
        f"bf16 parameters, fp32 reduction, AdamW; median step of {runs} alternating runs "
        "per library, each on a fresh model and the same batches.",
        "",
        "| model (bf16 params, fp32 reduce) | ranks | FSDP2 step | ours | ratio "
        "| FSDP2 peak, allocated / reserved | ours |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        row = result.row
        ranks = "1 (NCCL)" if row.world == 1 else f"{row.world} (fake group: collectives free)"
        if device == "cpu" and row.world == 1:
            ranks = "1 (gloo)"
        if result.failure is not None:
            lines.append(f"| {row.label} | {ranks} | failed: {result.failure} | | | | |")
            continue
        theirs, ours = result.seconds["torch"], result.seconds["torchcontract"]
        lines.append(
            f"| {row.label} | {ranks} | {theirs * 1e3:.1f} ms | {ours * 1e3:.1f} ms | "
            f"{ours / theirs:.2f} | {_gib(result.peaks['torch'])} | "
            f"{_gib(result.peaks['torchcontract'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--runs", type=int, default=2, help="runs per library and row")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    arguments = parser.parse_args(argv)
    device = "cpu" if arguments.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device; run with --smoke on the CPU", file=sys.stderr)
        return 2
    if device == "cuda":
        torch.cuda.set_device(0)
    rows = [_smoke(row) for row in ROWS] if arguments.smoke else list(ROWS)
    results: list[Result] = []
    arguments.output.parent.mkdir(parents=True, exist_ok=True)
    for row in rows:
        started = time.perf_counter()
        try:
            results.append(measure(row, device, arguments.runs))
        except Exception as error:  # the other rows still run; the exit status says so
            first_line = (str(error).splitlines() or [""])[0][:200]
            results.append(Result(row, {}, {}, f"{type(error).__name__}: {first_line}"))
            _collect(device)
        print(f"{row.label}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        arguments.output.write_text(table(results, device, arguments.runs))
    print(arguments.output.read_text())
    return 1 if any(result.failure is not None for result in results) else 0


if __name__ == "__main__":
    sys.exit(main())
