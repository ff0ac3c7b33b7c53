"""module_label(): the short name every error gives a module, never its repr.

A large model's repr runs to thousands of lines; a label is one line. It reads the
registry (to name the applied module around the labelled one), so it sits above
``_registry``; the store and the registry, which raise errors naming modules too,
take the label function as an argument instead of importing it.
"""

from __future__ import annotations

from torch import nn

from ._registry import REGISTRY
from ._tree import named_tree

__all__ = ["module_label"]


def module_label(module: nn.Module) -> str:
    """A short name for errors: ``Linear 'layers.0.fc' of Model`` inside an applied module.

    The first module with an API applied that contains ``module`` (at any depth)
    names it by its path there; otherwise the label is the class name alone,
    ``Linear``. Ends on any tree, a cyclic one included. Thread-safe: reads a copy
    of the applied modules.

    Args:
        module: The module to name.

    Returns:
        One line, never the module's repr (which runs to thousands of lines on a
            large model).
    """
    name = type(module).__qualname__
    for root in REGISTRY.modules():
        if root is module:
            continue
        for fqn, candidate in named_tree(root):
            if candidate is module:
                return f"{name} {fqn!r} of {type(root).__qualname__}"
    return name
