"""replicate(): data-parallel training by averaging gradients across a process group.

What ``torch.nn.parallel.DistributedDataParallel`` computes, through hooks
instead of a wrapper module. The frozen record (``ReplicateState``, in
``_state``) holds what is fixed or counted; the runtime bookkeeping lives in a
``Reducer`` (``_reducer``) that only the hooks hold; ``_buckets`` decides which
parameters are reduced together; ``_api`` holds the API and its gradient-sync
switch, which ``torchcontract.apis.no_sync`` calls.
"""

from __future__ import annotations

from ._api import replicate
from ._state import ReplicateState

__all__ = ["ReplicateState", "replicate"]
