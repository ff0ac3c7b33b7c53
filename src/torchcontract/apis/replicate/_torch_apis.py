"""The check, at the first forward, that torch's replicate or fully_shard came not after ours.

Torch's contract cannot see our rules, so it allowed them; the first forward is the
first moment to say so.
"""

from __future__ import annotations

from torch import nn

from torchcontract import IncompatibleAPIError, module_label, named_tree, torch_registry

__all__ = ["check_no_torch_api"]


def check_no_torch_api(root: nn.Module) -> None:
    """Refuse torch's ``replicate``/``fully_shard`` applied on or inside ``root`` after ours.

    Torch's ``fully_shard`` has replaced the parameters by then, and torch's
    ``replicate`` would average the gradients a second time.
    """
    for fqn, module in named_tree(root):
        for name in ("fully_shard", "replicate"):
            if name in torch_registry(module):
                where = "on it" if not fqn else f"on {type(module).__qualname__} {fqn!r} inside it"
                raise IncompatibleAPIError(
                    f"torchcontract.apis.replicate.replicate on {module_label(root)} cannot be "
                    f"combined with torch's {name}, applied after it {where} (found at the "
                    "first forward); apply only one of them to this part of the model"
                )
