"""The demo: train a small GPT on N gloo processes, replicated, then sharded.

    python -m torchcontract.demo [--nproc N] [--steps S] [--hsdp]
        [--checkpoint-dir DIR] [--checkpoint-every K] [--pause-after-checkpoint STEP]

First ``replicate`` on the whole model and ``checkpoint`` on each transformer
block; the first step also runs a ``DistributedDataParallel`` copy of the
model on the same batch and compares gradients. Then ``fully_shard`` on each
block and on the root, side by side with PyTorch's own ``fully_shard`` on a
copy for the first step (with ``--hsdp``, this phase alone, as HSDP). For each,
rank 0 draws a progress bar with the loss averaged over ranks, prints
``final (PHASE): step N loss X parameters SHA`` once, then ``describe(model)``;
each rank's API records and the comparison with DDP follow the first, the
per-rank parameter bytes and the comparison of first-step losses with PyTorch's
``fully_shard`` the second. Last, rank 0 says whether both phases ended with the
same parameters, and why (on 2 ranks they do: same start, data and dropout, and
a sum of two gradients does not depend on its order).

With ``--checkpoint-dir``, each phase saves its checkpoints in a subdirectory of
its own and resumes from the newest complete one (``_checkpoints``); a resumed
run ends with the uninterrupted run's final line (``_loop``).

Launched by ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set), each process joins the
``env://`` group torchrun describes and ``--nproc`` is ignored; otherwise the demo
starts ``--nproc`` ranks on this machine itself.
"""

from __future__ import annotations

from ._loop import Settings
from ._main import main
from ._model import GPT, GPTConfig, synthetic_batch
from ._replicated import Outcome, train
from ._sharded import ShardedOutcome, local_parameter_bytes, train_sharded

__all__ = [
    "GPT",
    "GPTConfig",
    "Outcome",
    "Settings",
    "ShardedOutcome",
    "local_parameter_bytes",
    "main",
    "synthetic_batch",
    "train",
    "train_sharded",
]
