"""Write docs/inventories/: the object inventories the API reference links out through.

mkdocstrings turns a type in a signature (``nn.Module``, ``Callable``, ``attrs.field``)
into a link to the documentation that defines it, using that project's Sphinx
inventory (``objects.inv``). The build must not need the network, so the inventories
live in the repository. This tool writes them from the installed packages: for each
module below, every public class and function it has, at the page and anchor where
that project's documentation documents it (Python's, PyTorch's and attrs' layouts,
written out per module below). Run it after a torch or attrs upgrade:

    .venv/bin/python tools/inventories.py

mkdocs keeps what it reads from an inventory URL for a day under ~/.cache/mkdocs; this
tool removes its copies of these files, so the next build reads the new ones.
"""

from __future__ import annotations

import builtins
import hashlib
import importlib
import inspect
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "docs" / "inventories"

#: Page (relative to the project's base URL) by module; "$" stands for the qualified name.
PYTHON: dict[str, str] = {
    "typing": "library/typing.html#$",
    "collections.abc": "library/collections.abc.html#$",
    "contextlib": "library/contextlib.html#$",
    "enum": "library/enum.html#$",
    "threading": "library/threading.html#$",
    "weakref": "library/weakref.html#$",
    "types": "library/types.html#$",
    "functools": "library/functools.html#$",
    "inspect": "library/inspect.html#$",
    "multiprocessing": "library/multiprocessing.html#$",
    "pathlib": "library/pathlib.html#$",
}
TORCH: dict[str, str] = {
    "torch.nn": "generated/$.html#$",
    "torch.nn.parallel": "generated/$.html#$",
    "torch.distributed": "distributed.html#$",
    "torch.distributed.device_mesh": "distributed.html#$",
    "torch.distributed.fsdp": "distributed.fsdp.fully_shard.html#$",
    "torch.distributed.tensor": "distributed.tensor.html#$",
    "torch.distributed.tensor.placement_types": "distributed.tensor.html#$",
    "torch.distributed.checkpoint": "distributed.checkpoint.html#$",
    "torch.distributed.algorithms.join": "distributed.algorithms.join.html#$",
    "torch.utils.checkpoint": "checkpoint.html#$",
}
#: torch's top-level names that have pages of their own elsewhere.
TORCH_TOP: dict[str, tuple[str, str]] = {
    "torch.Tensor": ("class", "tensors.html#$"),
    "torch.dtype": ("class", "tensor_attributes.html#$"),
    "torch.device": ("class", "tensor_attributes.html#$"),
    "torch.Generator": ("class", "generated/$.html#$"),
    "torch.compile": ("function", "generated/$.html#$"),
}
ATTRS: dict[str, str] = {"attrs": "api.html#$"}


def _public(module_name: str) -> Iterator[tuple[str, str]]:
    """``(qualified name, role)`` of every public class and function of the module."""
    module = importlib.import_module(module_name)
    for name in sorted(getattr(module, "__all__", None) or dir(module)):
        if name.startswith("_"):
            continue
        value = getattr(module, name, None)
        if inspect.isclass(value):
            yield f"{module_name}.{name}", "class"
        elif inspect.isfunction(value) or inspect.isbuiltin(value) or callable(value):
            yield f"{module_name}.{name}", "function"


def _python() -> Iterator[tuple[str, str, str]]:
    for name in sorted(dir(builtins)):
        value = getattr(builtins, name)
        if name.startswith("_"):
            continue
        if inspect.isclass(value) and issubclass(value, BaseException):
            yield name, "exception", "library/exceptions.html#$"
        elif inspect.isclass(value):
            yield name, "class", "library/functions.html#$"
        elif callable(value):
            yield name, "function", "library/functions.html#$"
    for module, page in PYTHON.items():
        for name, role in _public(module):
            yield name, role, page


def _by_module(pages: dict[str, str]) -> Callable[[], Iterator[tuple[str, str, str]]]:
    def entries() -> Iterator[tuple[str, str, str]]:
        for module, page in pages.items():
            for name, role in _public(module):
                yield name, role, page

    return entries


def _torch() -> Iterator[tuple[str, str, str]]:
    yield from _by_module(TORCH)()
    for name, (role, page) in TORCH_TOP.items():
        yield name, role, page


def write(path: Path, project: str, version: str, entries: Iterator[tuple[str, str, str]]) -> int:
    """Write a Sphinx v2 inventory of ``entries`` to ``path``; return how many it holds."""
    lines = sorted(
        {f"{name} py:{role} 1 {page.replace('$', name)} -\n" for name, role, page in entries}
    )
    header = (
        "# Sphinx inventory version 2\n"
        f"# Project: {project}\n"
        f"# Version: {version}\n"
        "# The remainder of this file is compressed using zlib.\n"
    )
    path.write_bytes(header.encode() + zlib.compress("".join(lines).encode(), 9))
    return len(lines)


def main() -> None:
    """Write the three inventories and say how many objects each holds."""
    import platform

    import attrs
    import torch

    OUT.mkdir(parents=True, exist_ok=True)
    python = platform.python_version_tuple()
    written = {
        "python.inv": write(OUT / "python.inv", "Python", ".".join(python[:2]), _python()),
        "torch.inv": write(OUT / "torch.inv", "PyTorch", torch.__version__, _torch()),
        "attrs.inv": write(OUT / "attrs.inv", "attrs", attrs.__version__, _by_module(ATTRS)()),
    }
    for name, count in written.items():
        _forget_cached(f"file:docs/inventories/{name}")
        print(f"docs/inventories/{name}: {count} objects")


def _forget_cached(url: str) -> None:
    """Remove mkdocs' cached copy of ``url`` (mkdocs_get_deps.cache names it by a hash)."""
    import platformdirs

    directory = Path(platformdirs.user_cache_dir("mkdocs")) / "mkdocs_url_cache"
    name = hashlib.sha256(url.encode()).hexdigest()[:32] + Path(url).suffix
    (directory / name).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
