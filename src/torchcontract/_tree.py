"""Walks of a module tree that end on any tree: every path, and the roots of a module list.

Both read ``_modules`` directly, as ``named_modules`` does, and never recurse, so a
tree of any depth, or one holding a module inside itself, is walked to the end.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from torch import nn

from ._fqn import descendants

__all__ = ["named_tree", "root_modules"]


def named_tree(root: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Every ``(fqn, module)`` of ``root``'s tree, pre-order, ``root`` first (at ``prefix``).

    A module shared at several paths comes at each of them, as with
    ``named_modules(remove_duplicate=False)``. A module already on the path to a
    child (a cycle in the tree) is not entered again, so the walk ends on any tree,
    where ``named_modules`` would recurse forever.

    Args:
        root: The root of the tree.
        prefix: The FQN given to ``root``; its descendants' FQNs start with it.

    Yields:
        ``(fqn, module)`` pairs, as ``named_modules(prefix=prefix, remove_duplicate=False)``
            would on a tree without cycles.
    """
    stack: list[tuple[str, nn.Module, int]] = [(prefix, root, 0)]
    path: list[int] = []  # ids of the modules from the root down to the current one
    while stack:
        fqn, module, depth = stack.pop()
        del path[depth:]
        if id(module) in path:
            continue
        path.append(id(module))
        yield fqn, module
        dot = fqn + "." if fqn else ""
        stack.extend(
            (dot + name, child, depth + 1)
            for name, child in reversed(module._modules.items())
            if child is not None
        )


def root_modules(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """The modules of ``modules`` that no other one of them contains, in their given order.

    The targets of an API applied to a list: ``contract`` installs the record and
    registry entry on these, and an API function that registers hooks or builds a
    group over the list does the same. Each shared subtree is walked once.

    Args:
        modules: The modules an API was given.

    Returns:
        The roots, a new list in the order of ``modules``.
    """
    if len(modules) == 1:
        return list(modules)
    inside: set[int] = set()
    for module in modules:
        for _ in descendants(module, inside):
            pass  # descendants() records every id it visits in ``inside``
    return [module for module in modules if id(module) not in inside]
