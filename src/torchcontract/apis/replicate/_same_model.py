"""The check, at apply, that every rank holds the same model, as DDP makes at construction.

DDP's ``_verify_param_shape_across_processes`` compares the parameters over the
group (where only their shapes differ, on 2 gloo ranks it raised on one rank and
left the other waiting in its first broadcast); without a check, the first
broadcast or all-reduce of differently sized tensors aborts the process or hangs.
Here each rank sums up what apply will broadcast and reduce (every parameter's
and buffer's name, shape and dtype, and whether it requires grad, in order) as a
32-byte digest, and one all-gather of the digests tells every rank whether they
agree. Only when they differ are the summaries themselves gathered, to name the
first difference. Every rank takes the same branch, so every rank raises and none
is left waiting.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final, cast

import torch
import torch.distributed as dist
from torch import nn

from torchcontract import ContractError, module_label

from .. import _objects, _torch

__all__ = ["ModelMismatchError", "check_same_model"]

_DIGEST_BYTES: Final = 32

#: One parameter or buffer: its kind, FQN, shape, dtype, and (parameters) whether it trains.
_Entry = tuple[str, str, tuple[int, ...], str, bool]


class ModelMismatchError(ContractError):
    """``replicate``: the ranks of the group hold different models (raised on every rank).

    The message names the first parameter or buffer that differs and both ranks'
    name, shape, dtype and ``requires_grad`` for it.
    """


def _summarize(module: nn.Module, ignored: frozenset[str]) -> list[_Entry]:
    """What apply broadcasts and reduces, in order: parameters, then buffers (not ``ignored``)."""
    entries: list[_Entry] = [
        ("parameter", name, tuple(p.shape), str(p.dtype), p.requires_grad)
        for name, p in module.named_parameters()
        if name not in ignored
    ]
    entries.extend(
        ("buffer", name, tuple(b.shape), str(b.dtype), False)
        for name, b in module.named_buffers()
        if name not in ignored
    )
    return entries


def check_same_model(
    module: nn.Module,
    group: dist.ProcessGroup,
    device: torch.device,
    ignored: frozenset[str] = frozenset(),
) -> None:
    """Raise ``ModelMismatchError`` on every rank of ``group`` unless all hold the same model.

    One all-gather of 32 bytes per rank when the models agree; a second, of the
    summaries, when they do not. A collective: every rank of ``group`` must call it,
    its tensors on ``device`` (the parameters', as DDP's check: NCCL takes no CPU tensor).
    """
    entries = _summarize(module, ignored)
    digest = hashlib.sha256(repr(entries).encode()).digest()
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(device)
    every = torch.empty(_DIGEST_BYTES * group.size(), dtype=torch.uint8, device=device)
    _torch.all_gather_into(every, mine, group)
    if bool(torch.all(every.view(group.size(), _DIGEST_BYTES) == mine)):
        return
    # Each rank sent the list _summarize() made.
    summaries = [
        cast("list[_Entry]", summary)
        for summary in _objects.all_gather_objects(entries, group, device=device)
    ]
    raise ModelMismatchError(_describe_difference(module, group, summaries))


def _describe_difference(
    module: nn.Module, group: dist.ProcessGroup, summaries: Sequence[list[_Entry]]
) -> str:
    """Where the first rank that differs from the group's first rank differs, in one sentence."""
    first = summaries[0]
    ranks = _rank_labels(group)
    other = next(index for index, summary in enumerate(summaries) if summary != first)
    theirs = summaries[other]
    position = next(
        index
        for index in range(max(len(first), len(theirs)))
        if index >= len(first) or index >= len(theirs) or first[index] != theirs[index]
    )
    a = first[position] if position < len(first) else None
    b = theirs[position] if position < len(theirs) else None
    counts = (
        ""
        if len(first) == len(theirs)
        else f"{ranks[0]} has {_count(first)}, {ranks[other]} {_count(theirs)}; "
    )
    if a is not None and b is not None and a[:2] == b[:2]:
        difference = (
            f"{a[0]} {a[1]!r} is {_describe(a)} on {ranks[0]} but {_describe(b)} on {ranks[other]}"
        )
    else:
        difference = (
            f"where {ranks[0]} has {_name_and_describe(a)}, "
            f"{ranks[other]} has {_name_and_describe(b)}"
        )
    return (
        f"replicate on {module_label(module)}: the ranks hold different models: {counts}"
        f"{difference}; build the same model on every rank before replicate"
    )


def _rank_labels(group: dist.ProcessGroup) -> list[str]:
    """``rank N`` by global rank; ``group rank N`` where torch.distributed never registered it."""
    try:
        return [f"rank {dist.get_global_rank(group, index)}" for index in range(group.size())]
    except ValueError:  # a group torch.distributed does not know (torchft's, or one from a store)
        return [f"group rank {index}" for index in range(group.size())]


def _count(entries: list[_Entry]) -> str:
    parameters = sum(1 for entry in entries if entry[0] == "parameter")
    return f"{parameters} parameters and {len(entries) - parameters} buffers"


def _describe(entry: _Entry) -> str:
    kind, _, shape, dtype, requires_grad = entry
    trains = "" if kind == "buffer" else (", requires grad" if requires_grad else ", frozen")
    return f"{dtype.removeprefix('torch.')} of shape {shape}{trains}"


def _name_and_describe(entry: _Entry | None) -> str:
    if entry is None:
        return "nothing more"
    return f"{entry[0]} {entry[1]!r} ({_describe(entry)})"
