"""The class an API swaps a module to: a subclass of its own carrying the wrapper's methods.

Where PyTorch's API is a wrapper with methods (DDP's ``no_sync()``, ``join()``,
``register_comm_hook()``; FSDP2's ``FSDPModule`` methods), the module an API is
applied to becomes an instance of ``<Prefix><Name>(<Base>, <Name>)``: a class made
once per pair of base and original class, cached, whose ``__name__`` is the
prefixed one (the module's repr shows it) and whose ``__qualname__`` stays the
original's, so that errors, which label modules by qualified name, keep naming
the user's class. ``isinstance(m, <Name>)`` still holds, and the contract's strict
check accepts the swap (a subclass). ``restore_class`` puts the original back (a
rolled-back apply calls it).

A deep copy or a pickle of such a module is of its original class
(``reduce_as_original``): the copy's hooks stand aside (no process group copies),
so it is not under the API and must not claim to be.
"""

from __future__ import annotations

import threading
import types
from typing import Any, cast

from torch import nn

__all__ = ["original_class", "reduce_as_original", "restore_class", "swapped_class"]

_CLASSES: dict[tuple[type, type[nn.Module]], type[nn.Module]] = {}
_ORIGINALS: dict[type[nn.Module], type[nn.Module]] = {}
_LOCK = threading.Lock()


def swapped_class(base: type, prefix: str, cls: type[nn.Module]) -> type[nn.Module]:
    """``<prefix><Name>(base, cls)``, made once per ``(base, cls)`` (thread-safe).

    ``cls`` itself if it already is a ``base``.
    """
    if issubclass(cls, base):
        return cls
    with _LOCK:
        made = _CLASSES.get((base, cls))
        if made is None:
            namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
            # types.new_class finds the metaclass both bases agree on (an ABC's, say).
            made = cast(
                "type[nn.Module]",
                types.new_class(
                    f"{prefix}{cls.__name__}",
                    (base, cls),
                    exec_body=lambda body: body.update(namespace),
                ),
            )
            _CLASSES[(base, cls)] = made
            _ORIGINALS[made] = cls
    return made


def original_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The class ``swapped_class`` made ``cls`` from (``cls`` itself if none)."""
    return _ORIGINALS.get(cls, cls)


def restore_class(module: nn.Module) -> None:
    """Give ``module`` back the class it had before an API swapped it."""
    module.__class__ = original_class(type(module))


def reduce_as_original(module: nn.Module, reduced: object) -> object:
    """``module.__reduce_ex__``'s result, rewritten to build the original class.

    ``reduced`` is what ``object.__reduce_ex__`` gave for ``module``; a swapped
    class's ``__reduce_ex__`` returns this, so copies and pickles are of the
    original class.
    """
    if not isinstance(reduced, tuple):
        return reduced
    parts = cast("tuple[object, ...]", reduced)
    if len(parts) < 2:
        return parts
    arguments = cast("tuple[object, ...]", parts[1])
    if not arguments or arguments[0] is not type(module):
        return parts
    # copyreg.__newobj__ insists on the object's own class; this builds the original.
    original = original_class(type(module))
    return (_new_object, (original, *arguments[1:]), *parts[2:])


def _new_object(cls: type[Any], *args: object) -> object:
    """``cls.__new__(cls, *args)``: how a copy or an unpickled module is made."""
    return cls.__new__(cls, *args)
