"""Binding a call's recorded arguments to the API function's parameters, and explaining failures.

Bound only when asked (``RegistryEntry.arguments``, typically by a rule's ``when=``),
never on the apply path: most applications are never asked.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any, Final

from ._errors import ArgumentBindingError

__all__ = ["FIX_THE_CALL", "bind_arguments", "close_name", "parameter_names"]

#: How a binding error's message ends; a rule reading the arguments adds itself before it.
FIX_THE_CALL: Final = "; fix the call"


def bind_arguments(
    signature: inspect.Signature, api_name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """Every parameter but the module, by name, defaults filled in.

    Raises ``ArgumentBindingError`` naming the API and the offending keyword (with the
    closest parameter name) when the arguments do not fit the signature.
    """
    try:
        bound = signature.bind(None, *args, **kwargs)
    except TypeError as error:
        raise ArgumentBindingError(
            f"{api_name} was called with {_what_is_wrong(signature, kwargs, error)}; "
            f"its parameters are {_parameter_list(signature)}{FIX_THE_CALL}"
        ) from None
    bound.apply_defaults()
    names = iter(bound.arguments)
    next(names)  # the module
    return {name: bound.arguments[name] for name in names}


def parameter_names(signature: inspect.Signature) -> list[str]:
    """The names of the API function's parameters after the module."""
    return list(signature.parameters)[1:]


def close_name(name: object, candidates: list[str]) -> str:
    """`` (did you mean 'rank'?)`` when a candidate is close to ``name``, else ``""``."""
    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, candidates, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _what_is_wrong(
    signature: inspect.Signature, kwargs: Mapping[str, Any], error: TypeError
) -> str:
    """The unknown keyword if there is one (inspect reports a missing argument first), else
    inspect's own account."""
    parameters = signature.parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        names = [
            name
            for name, parameter in list(parameters.items())[1:]
            if parameter.kind is not inspect.Parameter.POSITIONAL_ONLY
        ]
        for keyword in kwargs:
            if keyword not in names:
                return f"an unknown keyword argument {keyword!r}{close_name(keyword, names)}"
    return f"arguments that do not fit its signature ({error})"


def _parameter_list(signature: inspect.Signature) -> str:
    names = parameter_names(signature)
    return ", ".join(repr(name) for name in names) if names else "none but the module"
