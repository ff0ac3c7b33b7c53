"""Who writes a checkpoint of a ``replicate`` model: what docs/save-and-resume.md says.

``dcp.save`` of a model every rank holds whole writes each tensor once, by one of the
ranks: DCP spreads the replicated tensors over them, so every rank writes a file.
"""

from __future__ import annotations

import collections
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict

from torchcontract.apis import replicate
from torchcontract.testing import run_distributed

WORLD = 2


def _save(rank: int, world: int, directory: str) -> None:
    torch.manual_seed(0)
    model = replicate(nn.Sequential(*(nn.Linear(16, 16) for _ in range(4))))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    weights, state = get_state_dict(model, optimizer)
    state_dict_saver.save({"model": weights, "optim": state}, checkpoint_id=directory)


def test_each_tensor_of_a_replicated_model_is_written_once_and_every_rank_writes(
    tmp_path: Path,
) -> None:
    run_distributed(_save, WORLD, args=(str(tmp_path),), timeout=120)
    stored = FileSystemReader(str(tmp_path)).read_metadata().storage_data
    files_of = collections.defaultdict(set)
    for index, info in stored.items():
        files_of[index.fqn].add(info.relative_path)
    assert "model.0.weight" in files_of
    assert {fqn: files for fqn, files in files_of.items() if len(files) != 1} == {}
    written = {file for files in files_of.values() for file in files}
    assert written == {f"__{rank}_0.distcp" for rank in range(WORLD)}
