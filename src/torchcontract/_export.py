"""Give an API function implemented in a private module the name of the package exporting it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["exported_from"]

_F = TypeVar("_F", bound=Callable[..., object])


def exported_from(package: str) -> Callable[[_F], _F]:
    """Set ``func.__module__`` to ``package``, before ``contract`` reads it.

    The contract's name (in every error message) then reads
    ``package.func``, and pickling by reference finds the contract where users
    import it from. Put it below ``@contract(...)``, so that it runs first.

    Args:
        package: The module users import the API from, e.g.
            ``"torchcontract.apis.fully_shard"``.

    Returns:
        A decorator that sets the function's ``__module__`` and returns the function.
    """

    def export(func: _F) -> _F:
        func.__module__ = package
        return func

    return export
