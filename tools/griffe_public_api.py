"""The API reference shows the public API only: a griffe extension the docs build loads.

mkdocstrings reads the package with griffe, which sees the source as written: type
variables named ``_S``, defaults that are private sentinels, ``*args: _P.args``, the
``self.name = name`` lines of ``__init__`` beside the ``Attributes:`` section, and a
contract's API function returning ``None`` where the contract returns the module. This
extension rewrites what the reference renders, and nothing the library runs:

- a private type variable is shown by its public spelling (``_S`` and ``_S_co`` as
  ``S``, ``_P`` as ``P``), in signatures, bases and docstrings;
- a base that is a private alias of a public class (``_Joinable = Joinable``, made under
  ``TYPE_CHECKING``) is shown as that class;
- a default that is a private module constant is shown as the constant's value
  (``_NO_OFFLOAD`` as ``OffloadPolicy()``);
- ``*args`` and ``**kwargs`` typed by a ``ParamSpec`` are shown bare;
- an attribute listed in its class' ``Attributes:`` section is shown once, as the member,
  with the section's description and without the source of its assignment
  (``state_cls = state_cls``, ``attrs.field(..., repr=_helper)``: the default stays);
- a function made an API by ``@contract(...)`` is shown returning what its contract
  returns, the module (or list of modules) it was given.

tests/test_docs.py checks that the rendered reference names nothing private.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import griffe

#: The factories whose results are type variables.
_TYPE_VARIABLES = {"TypeVar", "ParamSpec", "TypeVarTuple"}
_VARIANCE = re.compile(r"_(co|contra)$")
_SECTION = re.compile(r"^Attributes:\n((?:(?:    .*)?\n?)+)", re.M)
_ITEM = re.compile(r"^    (\w+)(?: \([^)]*\))?: (.*(?:\n        .*)*)", re.M)


def public_spelling(name: str) -> str:
    """``_S_co`` -> ``S``: a type variable's name without the underscore and variance."""
    return _VARIANCE.sub("", name.lstrip("_"))


class PublicAPI(griffe.Extension):
    """Rewrite what the reference shows of the loaded package (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        type_variables = {
            name
            for module in _modules(pkg)
            for name, member in module.members.items()
            if name.startswith("_") and _is_type_variable(member)
        }
        for obj in _objects(pkg):
            if isinstance(obj, griffe.Function):
                for function in (obj, *(obj.overloads or ())):
                    _rewrite_function(function, type_variables)
            elif isinstance(obj, griffe.Class):
                obj.bases = [_aliased(obj, _renamed(base, type_variables)) for base in obj.bases]
                _one_entry_per_attribute(obj)
            elif isinstance(obj, griffe.Attribute):
                obj.annotation = _renamed(obj.annotation, type_variables)
                if _is_field(obj.value):
                    obj.value = _default_of(obj)
            if obj.docstring is not None:
                obj.docstring.value = _renamed_in_text(obj.docstring.value, type_variables)
        for module in _modules(pkg):
            for name in type_variables:
                member = module.members.get(name)
                if member is not None and not member.is_alias:
                    member.docstring = None


def _modules(module: griffe.Module) -> Iterator[griffe.Module]:
    yield module
    for member in module.members.values():
        if not member.is_alias and isinstance(member, griffe.Module):
            yield from _modules(member)


def _objects(obj: griffe.Object) -> Iterator[griffe.Object]:
    yield obj
    for member in list(obj.members.values()):
        if not member.is_alias and isinstance(member, griffe.Object):
            yield from _objects(member)


def _is_type_variable(member: object) -> bool:
    if getattr(member, "is_alias", True) or not isinstance(member, griffe.Attribute):
        return False
    value = member.value
    return isinstance(value, griffe.ExprCall) and str(value.function) in _TYPE_VARIABLES


def _aliased(cls: griffe.Class, base: Any) -> Any:
    """A base that is a private alias of a public name (``_Joinable = Joinable``) as that name."""
    if isinstance(base, griffe.ExprName) and base.name.startswith("_"):
        alias = cls.module.members.get(base.name)
        value = alias.value if isinstance(alias, griffe.Attribute) else None
        if isinstance(value, griffe.ExprName) and not value.name.startswith("_"):
            return value
    return base


def _renamed(expression: Any, type_variables: set[str]) -> Any:
    """``expression`` with every private type variable spelt publicly (in place)."""
    for part in _parts(expression):
        if part.name in type_variables:
            part.name = public_spelling(part.name)
    return expression


def _parts(expression: object) -> Iterator[griffe.ExprName]:
    """Every name inside ``expression``, at any depth (not the objects names point to)."""
    if isinstance(expression, griffe.ExprName):
        yield expression
        yield from _parts(expression.parent) if isinstance(expression.parent, griffe.Expr) else ()
    elif isinstance(expression, griffe.Expr):
        for field in dataclasses.fields(expression):
            yield from _parts(getattr(expression, field.name))
    elif isinstance(expression, list | tuple):
        for item in expression:
            yield from _parts(item)


def _renamed_in_text(text: str, type_variables: set[str]) -> str:
    for name in type_variables:
        text = re.sub(rf"(?<![\w.]){re.escape(name)}\b", public_spelling(name), text)
    return text


def _rewrite_function(function: griffe.Function, type_variables: set[str]) -> None:
    module = function.module
    for parameter in function.parameters:
        if parameter.kind in (
            griffe.ParameterKind.var_positional,
            griffe.ParameterKind.var_keyword,
        ):
            annotation = parameter.annotation
            if isinstance(annotation, griffe.ExprAttribute) and str(annotation).endswith(
                (".args", ".kwargs")
            ):
                parameter.annotation = _renamed_in_text(str(annotation), type_variables)
            parameter.default = None
            continue
        parameter.annotation = _renamed(parameter.annotation, type_variables)
        default = parameter.default
        if isinstance(default, griffe.ExprName) and default.name.startswith("_"):
            constant = module.members.get(default.name)
            if isinstance(constant, griffe.Attribute) and constant.value is not None:
                parameter.default = constant.value
    function.returns = _renamed(function.returns, type_variables)
    if _made_an_api(function) and str(function.returns) == "None":
        first = next(iter(function.parameters), None)
        if first is not None and first.annotation is not None:
            function.returns = first.annotation


def _made_an_api(function: griffe.Function) -> bool:
    """Whether ``function`` is decorated with ``contract(...)``: its contract returns the module."""
    return any(
        isinstance(decorator.value, griffe.ExprCall)
        and str(decorator.value.function).split(".")[-1] == "contract"
        for decorator in function.decorators
    )


def _one_entry_per_attribute(cls: griffe.Class) -> None:
    """Move the ``Attributes:`` section's descriptions onto the members, and drop the section.

    The member keeps its annotation; its value is shown only when it is a default
    (``attrs.field(default=...)`` becomes the default), never an ``__init__`` assignment.
    """
    if cls.docstring is None:
        return
    section = _SECTION.search(cls.docstring.value)
    if section is None:
        return
    described = {
        name: re.sub(r"\s*\n\s+", " ", text).strip() for name, text in _ITEM.findall(section[1])
    }
    for name, description in described.items():
        member = cls.members.get(name)
        if isinstance(member, griffe.Attribute) and not member.is_alias:
            if member.docstring is None:
                member.docstring = griffe.Docstring(description, parent=member)
            member.value = _default_of(member)
    cls.docstring.value = (
        cls.docstring.value[: section.start()] + cls.docstring.value[section.end() :]
    ).rstrip()


def _default_of(member: griffe.Attribute) -> Any:
    value = member.value
    if "instance-attribute" in member.labels and "class-attribute" not in member.labels:
        return None
    if _is_field(value):
        assert isinstance(value, griffe.ExprCall)
        for argument in value.arguments:
            if isinstance(argument, griffe.ExprKeyword) and argument.name == "default":
                return argument.value
        return None
    return value


def _is_field(value: object) -> bool:
    """Whether ``value`` is ``attrs.field(...)`` (or ``field(...)``)."""
    return isinstance(value, griffe.ExprCall) and str(value.function).split(".")[-1] == "field"
