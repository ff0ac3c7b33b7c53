"""replicate(): data-parallel training by averaging gradients across a process group.

What ``torch.nn.parallel.DistributedDataParallel`` computes, through hooks
instead of a wrapper module. The frozen record (``ReplicateState``, in
``_state``) holds what is fixed or counted; the runtime bookkeeping lives in a
``Reducer`` (``_reducer``) that only the hooks hold; ``_buckets`` decides which
parameters are reduced together; ``_outputs`` finds the tensors in a forward's
output; ``_same_model`` checks at apply that every rank holds the same model;
``_module`` the class the module becomes (``ReplicateModule``: DDP's methods),
``_join`` its Join hook, ``_comm_hook`` the communication-hook contract,
``_manager_hook`` a hook that averages through torchft's ``Manager``;
``_devices`` DDP's ``device_ids`` and ``output_device``, ``_keywords`` its
keywords that decide no bucket; ``_api`` holds the API, its gradient-sync switch, which
``torchcontract.apis.no_sync`` calls, and ``rank_local``.
"""

from __future__ import annotations

from ._api import rank_local, replicate
from ._devices import InvalidKeywordError
from ._keywords import KeywordNotInThisTorchError, UnsupportedKeywordError
from ._manager_hook import AllReduceManager, manager_allreduce_hook
from ._module import ReplicateModule
from ._same_model import ModelMismatchError
from ._state import ReplicateState

__all__ = [
    "AllReduceManager",
    "InvalidKeywordError",
    "KeywordNotInThisTorchError",
    "ModelMismatchError",
    "ReplicateModule",
    "ReplicateState",
    "UnsupportedKeywordError",
    "manager_allreduce_hook",
    "rank_local",
    "replicate",
]
