"""describe(): the module tree with the APIs applied where.

It never prints a module's repr: a large model's repr runs to thousands of lines.
"""

from __future__ import annotations

from torch import nn

from ._registry import registry, torch_registry

__all__ = ["describe"]


def _applied(module: nn.Module) -> list[str]:
    ours = [entry.api.__name__ for entry in registry(module).values()]
    theirs = [f"{name} (torch)" for name in torch_registry(module)]
    return ours + theirs


def describe(module: nn.Module) -> str:
    """The module tree, compact: which APIs are applied where.

    One line per module, ``name: Class  [apis]``. A subtree without any API is a
    single line with its module count; a run of numbered siblings (as in a
    ``ModuleList``) that render alike is merged into one line (``0-511: Block ×512``).
    torch's own composable APIs are shown too, marked ``(torch)``. A module that
    contains itself (a cycle) is shown as one line saying so: it always ends.

    Args:
        module: The root of the tree.

    Returns:
        The tree as text, one module per line, children indented under their parent.
    """
    return "\n".join(_Renderer(module).render(type(module).__qualname__, module, ""))


class _Renderer:
    """Renders one tree; learns each module's APIs and subtree size in one walk.

    A child that is already on the path to it (a cycle) is shown as one line saying
    so, and neither counted nor entered again.
    """

    def __init__(self, root: nn.Module) -> None:
        self._apis: dict[int, list[str]] = {}
        self._size: dict[int, int] = {}
        self._any_api: dict[int, bool] = {}
        self._path: set[int] = set()  # ids of the modules being learned or rendered
        self._learn(root)

    def _learn(self, module: nn.Module) -> tuple[int, bool]:
        if id(module) not in self._size:
            self._path.add(id(module))
            apis = self._apis[id(module)] = _applied(module)
            size, any_api = 1, bool(apis)
            for child in _children(module):
                if id(child) in self._path:
                    continue
                child_size, child_api = self._learn(child)
                size += child_size
                any_api = any_api or child_api
            self._size[id(module)], self._any_api[id(module)] = size, any_api
            self._path.discard(id(module))
        return self._size[id(module)], self._any_api[id(module)]

    def render(self, title: str, module: nn.Module, indent: str) -> list[str]:
        apis = self._apis[id(module)]
        line = indent + title + (f"  [{', '.join(apis)}]" if apis else "")
        children = list(_named_children(module))
        if not children:
            return [line]
        below = self._size[id(module)] - 1
        if not any(self._any_api[id(child)] for _, child in children):
            modules = "module" if below == 1 else "modules"
            return [f"{line}  ({below} {modules} below, no APIs)"]
        lines = [line]
        inner = indent + "  "
        self._path.add(id(module))
        blocks = [(name, self._render_child(child, inner)) for name, child in children]
        self._path.discard(id(module))
        start = 0
        while start < len(blocks):
            end = start + 1
            while end < len(blocks) and _continues(blocks[end - 1], blocks[end]):
                end += 1
            first, block = blocks[start]
            label = first if end - start == 1 else f"{first}-{blocks[end - 1][0]}"
            head = block[0][len(inner) :]
            count = "" if end - start == 1 else f" ×{end - start}"
            class_name, _, rest = head.partition("  ")
            lines.append(f"{inner}{label}: {class_name}{count}" + (f"  {rest}" if rest else ""))
            lines.extend(block[1:])
            start = end
        return lines

    def _render_child(self, child: nn.Module, indent: str) -> list[str]:
        if id(child) in self._path:
            return [f"{indent}{type(child).__qualname__}  (cycle: a module around this line)"]
        return self.render(type(child).__qualname__, child, indent)


def _continues(previous: tuple[str, list[str]], this: tuple[str, list[str]]) -> bool:
    """Whether ``this`` sibling extends a run: the next number, rendered the same."""
    (before, lines_before), (name, lines) = previous, this
    return (
        before.isdigit()
        and name.isdigit()
        and int(name) == int(before) + 1
        and lines == lines_before
    )


def _children(module: nn.Module) -> list[nn.Module]:
    return [child for child in module._modules.values() if child is not None]


def _named_children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, child) for name, child in module._modules.items() if child is not None]
