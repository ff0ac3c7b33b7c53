"""Python objects gathered from every rank of a group, without numpy.

torch's ``all_gather_object`` reads the gathered bytes back through ``Tensor.numpy()``
(``distributed_c10d._tensor_to_object``), so it raises ``RuntimeError: Numpy is not
available`` where numpy is not installed, and torch does not require numpy. Here each
rank pickles its object into a byte tensor; one all-gather of the sizes and one of the
payloads, padded to the longest, and each payload is read back through ``Tensor.tolist()``.
Meant for small objects (summaries, a few lines of text, paths): the read-back makes one
Python int per byte.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from . import _torch

__all__ = ["all_gather_objects"]


def all_gather_objects(
    value: object, group: dist.ProcessGroup | None = None, *, device: torch.device | None = None
) -> list[object]:
    """Every rank's ``value`` (picklable), by rank of ``group`` (default: the world group).

    A collective: every rank of ``group`` must call it. Unpickles what the other ranks
    sent, as ``torch.distributed.all_gather_object`` does: use it among trusted ranks only.
    The bytes travel on ``device``: by default the one ``all_gather_object`` would use
    (the CPU for gloo, the current GPU for NCCL).
    """
    if group is None:
        group = dist.group.WORLD
        if group is None:
            raise RuntimeError("torchcontract: all_gather_objects before init_process_group()")
    on = _torch.object_collective_device(group) if device is None else device
    payload = pickle.dumps(value)
    sizes = torch.empty(group.size(), dtype=torch.int64, device=on)
    length = torch.tensor([len(payload)], dtype=torch.int64, device=on)
    _torch.all_gather_into(sizes, length, group)
    lengths = _torch.to_ints(sizes)
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    every = torch.empty(longest * group.size(), dtype=torch.uint8, device=on)
    _torch.all_gather_into(every, mine.to(on), group)
    flat = _torch.to_ints(every)
    return [
        pickle.loads(bytes(flat[rank * longest : rank * longest + length]))
        for rank, length in enumerate(lengths)
    ]
