"""describe(): the module tree with the APIs applied where; and short module labels for errors.

Neither ever prints a module's repr: a large model's repr runs to thousands of lines.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

__all__ = ["describe", "module_label"]


def module_label(module: nn.Module) -> str:
    """A short name: ``Linear 'layers.0.fc' of Model`` when an applied module contains it.

    Otherwise just the class name, ``Linear``.
    """
    from ._registry import REGISTRY

    name = type(module).__qualname__
    for root in REGISTRY.modules():
        if root is module:
            continue
        for fqn, candidate in _named_tree(root):
            if candidate is module:
                return f"{name} {fqn!r} of {type(root).__qualname__}"
    return name


def _named_tree(root: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Every path of ``root``'s tree (shared modules at each of theirs), pre-order."""
    stack: list[tuple[str, nn.Module]] = [(prefix, root)]
    while stack:
        fqn, module = stack.pop()
        yield fqn, module
        dot = fqn + "." if fqn else ""
        stack.extend(
            (dot + name, child)
            for name, child in reversed(module._modules.items())
            if child is not None
        )


def _applied(module: nn.Module) -> list[str]:
    from ._registry import registry, torch_registry

    ours = [entry.api.__name__ for entry in registry(module).values()]
    theirs = [f"{name} (torch)" for name in torch_registry(module)]
    return ours + theirs


def describe(module: nn.Module) -> str:
    """The module tree, compact: which APIs are applied where.

    Subtrees without any API are one line with their module count; runs of
    siblings that render alike (``0-511: Block ×512``) are merged.
    """
    return "\n".join(_render(type(module).__qualname__, module, ""))


def _render(title: str, module: nn.Module, indent: str) -> list[str]:
    apis = _applied(module)
    line = indent + title + (f"  [{', '.join(apis)}]" if apis else "")
    children = [(name, child) for name, child in module._modules.items() if child is not None]
    if not children:
        return [line]
    if not _has_api_below(module):
        count = sum(1 for _ in _named_tree(module)) - 1
        return [line + f"  ({count} modules inside, no APIs)"]
    lines = [line]
    rendered = [
        (name, child, _render(type(child).__qualname__, child, indent + "  "))
        for name, child in children
    ]
    index = 0
    while index < len(rendered):
        name, child, block = rendered[index]
        end = index + 1
        while end < len(rendered) and rendered[end][2] == block:
            end += 1
        if end - index > 1:
            first, last = rendered[index][0], rendered[end - 1][0]
            head = block[0].replace(
                indent + "  " + type(child).__qualname__,
                f"{indent}  {first}-{last}: {type(child).__qualname__} ×{end - index}",
                1,
            )
        else:
            head = block[0].replace(indent + "  ", f"{indent}  {name}: ", 1)
        lines.append(head)
        lines.extend(block[1:])
        index = end
    return lines


def _has_api_below(module: nn.Module) -> bool:
    return any(
        _applied(descendant) for _, descendant in _named_tree(module) if descendant is not module
    )
