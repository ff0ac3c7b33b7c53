"""FQN snapshots as tuples: one walk of the module tree, names built only when asked.

A snapshot has exactly the semantics of ``named_parameters()``,
``named_buffers(remove_duplicate=False)`` and
``named_modules(remove_duplicate=False)``: modules and buffers at every path, a
parameter only at its first path (shared modules and tied parameters appear
once), ``None`` entries skipped. It also lists every parameter at every path, as
``named_parameters(remove_duplicate=False)`` and ``state_dict()`` do. Identity,
not ``__eq__``/``__hash__``, decides what is shared.

Speed: one walk copies, per module visited, the keys of its ``_parameters`` and
the ids of their values into flat lists, with a count per module; buffers, children
and ``None`` children, which most modules lack, only where there are any: per module
that has them, its position, their count, their keys (children: names), and for
``None`` children which ones they are. It builds no string per module: those copies
fix every path, so the FQN tuples can be built from them later, and only when someone
asks for them. Two snapshots whose copies are equal (same structure, names, keys and
value ids) have equal FQNs: equal ids mean the same ``None`` entries and the same tied
parameters, since within one walk equal ids are one object. So comparing them needs no
FQNs at all; any other pair is compared by its FQNs. Ids rather than the tensors
themselves, so that a snapshot keeps no tensor alive: an API that replaces parameters
frees the old ones as it goes. Nothing is cached across walks: every snapshot reads the
whole tree again, so no change can hide.

The walk runs in C where the package was built with it (``_walk_native.c``, which copies
exactly what ``_walk_in_python`` copies, and hands back to it the trees it takes a path
of its own for); ``unchanged_since`` walks a tree comparing it with a snapshot, copying nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import chain, compress, repeat
from operator import is_, ne, not_
from typing import Final

from torch import nn

from ._errors import ContractError, CyclicModuleTreeError

__all__ = ["FQNSnapshot", "descendants", "quote_fqn", "take_snapshot", "unchanged_since"]

_NONE_ID: Final = id(None)
_NO_FORWARD: Final = object()

#: What a walk copies of the tree. ``structure``: for the walk's start (position -1,
#: whose one child is the root, named "") and then for each module with children, in
#: pre-order, its position and its number of children, flat. ``names``: those children's
#: names, in the same order. ``holes``: for each ``None`` child, its parent's position and
#: which of that parent's children are ``None``.
_TreeCopy = tuple[list[int], list[str], list[tuple[int, tuple[bool, ...]]]]
#: What a walk copies of one kind of member: counts, keys, ids of the values. Parameters
#: have a count per module; buffers, which most modules lack, a position and a count per
#: module that has any, flat.
_MemberCopy = tuple[list[int], list[str], list[int]]
#: What a snapshot holds, as ``_snapshot`` takes it: the modules, their classes, the tree's
#: copy, the modules' instance forwards and the members' copies. The C walk returns it;
#: the C comparison takes it.
_Copies = tuple[
    Sequence[nn.Module],
    tuple[type[nn.Module], ...],
    _TreeCopy,
    Mapping[int, object],
    tuple[_MemberCopy, _MemberCopy],
]


class FQNSnapshot:
    """The parameter, buffer and module FQNs of a module tree, in ``named_*`` order.

    Made by ``take_snapshot``. ``parameters``, ``buffers`` and ``module_fqns`` are
    tuples of names, built on first use from what the walk copied.
    ``state_dict_parameters`` lists parameters at every path, as ``state_dict()`` does.
    ``modules`` holds the module objects behind ``module_fqns``, ``classes`` their
    classes and ``forwards`` their instance-level ``forward`` (or None) at snapshot
    time, for the stricter checks. Immutable; compared by identity. Not made directly:
    the constructor raises ``TypeError``.

    Attributes:
        classes: The class of each of ``modules`` at snapshot time.
    """

    # Few slots: a snapshot is built at every apply, and each slot written costs.
    # ``_tree`` is the copy of the tree; ``_forwards`` maps a module's position to its
    # instance ``forward``; ``_members`` is the copies of the parameters and of the buffers;
    # ``_names`` caches the FQN tuples built from them, by kind;
    # ``_modules`` is the walk's own list of modules, never written after it (copying
    # it into a tuple would touch every module object again, where a large tree has
    # left the CPU's caches). Filled by ``_snapshot``, the one place a snapshot is built.
    __slots__ = ("_forwards", "_members", "_modules", "_names", "_tree", "classes")
    _modules: Sequence[nn.Module]
    classes: tuple[type[nn.Module], ...]
    _tree: _TreeCopy
    _forwards: Mapping[int, object]
    _members: tuple[_MemberCopy, _MemberCopy]
    _names: dict[str, tuple[str, ...]] | None

    def __init__(self) -> None:
        raise TypeError("FQNSnapshot: snapshots are made by take_snapshot(module); call that")

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        """The module objects of the tree, in ``named_modules(remove_duplicate=False)`` order."""
        return tuple(self._modules)

    def _cached(self, kind: str, build: Callable[[], tuple[str, ...]]) -> tuple[str, ...]:
        names = self._names
        if names is None:
            names = self._names = {}
        found = names.get(kind)
        if found is None:
            found = names[kind] = build()
        return found

    @property
    def parameters(self) -> tuple[str, ...]:
        """Parameter FQNs, as the names of ``named_parameters()``."""

        def build() -> tuple[str, ...]:
            names, ids = _present(self._parameter_names(), self._members[0][2])
            if len(set(ids)) != len(ids):
                names = _first_occurrences(names, ids)
            return tuple(names)

        return self._cached("parameters", build)

    @property
    def state_dict_parameters(self) -> tuple[str, ...]:
        """Parameter FQNs at every path, as ``named_parameters(remove_duplicate=False)``.

        What ``state_dict()`` lists: a shared module's parameters under each of its
        paths, a tied parameter under each of its names.
        """
        return self._cached(
            "state_dict_parameters",
            lambda: tuple(_present(self._parameter_names(), self._members[0][2])[0]),
        )

    @property
    def buffers(self) -> tuple[str, ...]:
        """Buffer FQNs, as the names of ``named_buffers(remove_duplicate=False)``."""

        def build() -> tuple[str, ...]:
            pairs, keys, ids = self._members[1]
            owners = map(self._prefixes().__getitem__, pairs[0::2])
            return tuple(_present(_joined(owners, pairs[1::2], keys), ids)[0])

        return self._cached("buffers", build)

    @property
    def module_fqns(self) -> tuple[str, ...]:
        """Module FQNs, as the names of ``named_modules(remove_duplicate=False)``."""
        return self._cached("modules", lambda: self._build_fqns()[0])

    def _parameter_names(self) -> list[str]:
        """Each parameter key joined to the prefix of the module it belongs to."""
        counts, keys, _ = self._members[0]
        return _joined(self._prefixes(), counts, keys)

    def _prefixes(self) -> tuple[str, ...]:
        return self._cached("prefixes", lambda: self._build_fqns()[1])

    def _build_fqns(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Every module's FQN and member prefix, rebuilt from the copy of the tree.

        As ``named_modules()``: a child's FQN is its parent's FQN, a dot and its name,
        without the dot when the parent's FQN is empty; its member prefix is its FQN
        and a dot, or empty when its FQN is.
        """
        structure, names, holes = self._tree
        absent = dict(holes)
        children: dict[int, Iterator[str]] = {}  # the names still to visit, per parent
        start = 0
        for parent, count in zip(structure[0::2], structure[1::2], strict=True):
            group = names[start : start + count]
            start += count
            if parent in absent:
                group = list(compress(group, map(not_, absent[parent])))
            children[parent] = iter(group)
        fqns: list[str] = []
        prefixes: list[str] = []
        # Pre-order: each module is the next child of the nearest ancestor with one left.
        pending: list[tuple[str, Iterator[str]]] = [("", children[-1])]
        for position in range(len(self._modules)):
            prefix, left = pending[-1]
            name = next(left, None)
            while name is None:
                pending.pop()
                prefix, left = pending[-1]
                name = next(left, None)
            fqn = prefix + name
            prefix = fqn + "." if fqn else ""
            fqns.append(fqn)
            prefixes.append(prefix)
            if position in children:
                pending.append((prefix, children[position]))
        return tuple(fqns), tuple(prefixes)

    @property
    def forwards(self) -> tuple[object, ...]:
        """Per module, the ``forward`` set on the instance at snapshot time, or None."""
        return tuple(map(self._forwards.get, range(len(self._modules))))

    def _copies(self) -> _Copies:
        """What the walk copied, as ``_snapshot`` took it (and the C comparison takes it)."""
        return (self._modules, self.classes, self._tree, self._forwards, self._members)

    def same_as(self, other: FQNSnapshot) -> bool:
        """Whether both walks copied the same tree, keys and member objects.

        True implies equal ``parameters``, ``buffers`` and ``module_fqns``; False
        implies nothing (the names may still agree), so compare the names then.
        """
        # Tuples of lists compare item by item, in C: the tree's copy, then the members'.
        return self._tree == other._tree and self._members == other._members

    def __repr__(self) -> str:
        return (
            f"<FQNSnapshot of {len(self._modules)} modules, {len(self.parameters)} parameters, "
            f"{len(self.buffers)} buffers>"
        )


def _load_native() -> tuple[
    Callable[[nn.Module], _Copies | None] | None,
    Callable[[nn.Module, _Copies], bool | None] | None,
]:
    """The C walk and comparison (``_walk_native``), or Nones where the package was built
    without them."""
    try:
        from ._walk_native import unchanged, walk
    except ImportError:
        return None, None
    return walk, unchanged


#: The C walk, where built: ``_walk``'s copies of a tree, several times faster than the
#: Python walk, which stays the reference (and the walk where it is not built, or where
#: it answers None: a tree the Python walk takes a path of its own for). The comparison
#: walks a tree against a snapshot's copies without copying (``unchanged``).
_native_walk, _native_unchanged = _load_native()
_new: Final = object.__new__
#: The copies of a leaf's tree, and of members a leaf has none of: shared, never written.
_LEAF_TREE: Final[_TreeCopy] = ([-1, 1], [""], [])
_NO_PARAMETERS: Final[_MemberCopy] = ([0], [], [])
_NO_BUFFERS: Final[_MemberCopy] = ([], [], [])


def _snapshot(
    modules: Sequence[nn.Module],
    classes: tuple[type[nn.Module], ...],
    tree: _TreeCopy,
    forwards: Mapping[int, object],
    members: tuple[_MemberCopy, _MemberCopy],
    /,
) -> FQNSnapshot:
    """A snapshot of what one walk copied, built without a Python-level ``__init__``."""
    snapshot = _new(FQNSnapshot)
    snapshot._modules = modules
    snapshot.classes = classes
    snapshot._tree = tree
    snapshot._forwards = forwards
    snapshot._members = members
    snapshot._names = None
    return snapshot


def take_snapshot(
    root: nn.Module,
    *,
    api_name: str = "take_snapshot",
    label: Callable[[nn.Module], str] | None = None,
) -> FQNSnapshot:
    """Walk ``root`` once, pre-order, and return its FQN snapshot.

    What ``contract`` compares before and after an API function; an extension can
    compare two snapshots of its own the same way.

    Args:
        root: The root of the tree to walk.
        api_name: How error messages start: the API taking the snapshot.
        label: Names ``root`` in error messages (its class name if None); pass
            ``module_label``.

    Returns:
        The snapshot; its FQN tuples are built on first use.

    Raises:
        CyclicModuleTreeError: A module of the tree contains itself.
        ContractError: The tree is nested deeper than Python's recursion limit lets
            ``named_modules()`` walk.
    """
    try:
        return _walk(root)
    except RecursionError:
        # Found only now, in a second walk: looking for cycles during the walk would
        # cost every snapshot a set insertion per module.
        raise _walk_error(root, api_name, label) from None


def _walk(root: nn.Module) -> FQNSnapshot:
    """The snapshot of ``root``; a ``RecursionError`` for a cyclic or too deep tree."""
    attributes = root.__dict__
    params: _Members | None = attributes.get("_parameters")
    buffers: _Members | None = attributes.get("_buffers")
    if params is not None and buffers is not None and not attributes.get("_modules", True):
        # A leaf (most applies target one): its members directly, no walk to set up.
        # (Anything else, a traced module included, takes the walk below.)
        forward = attributes.get("forward", _NO_FORWARD)
        return _snapshot(
            (root,),
            (type(root),),
            _LEAF_TREE,
            {} if forward is _NO_FORWARD else {0: forward},
            (
                ([len(params)], list(params), list(map(id, params.values())))
                if params
                else _NO_PARAMETERS,
                ([0, len(buffers)], list(buffers), list(map(id, buffers.values())))
                if buffers
                else _NO_BUFFERS,
            ),
        )
    if _native_walk is not None:
        copies = _native_walk(root)
        if copies is not None:
            return _snapshot(*copies)
    return _walk_in_python(root)


def _walk_in_python(root: nn.Module) -> FQNSnapshot:
    """``_walk`` of a tree with children, in Python: the reference the C walk copies."""
    modules: list[nn.Module] = []
    forwards: dict[int, object] = {}
    structure: list[int] = []
    names: list[str] = []
    holes: list[tuple[int, tuple[bool, ...]]] = []
    counts: list[int] = []
    keys: list[str] = []
    values: list[object] = []
    buffer_counts: list[int] = []
    buffer_keys: list[str] = []
    buffer_values: list[object] = []
    add_module, add_count, add_keys, add_values = (
        modules.append,
        counts.append,
        keys.extend,
        values.extend,
    )

    # Recursion with bound methods and bulk list.extend calls is the fastest
    # pure-Python walk measured. One call visits a module's children: each child is
    # copied in the loop, and only a child with children of its own costs a call, so
    # leaves, most of a tree, cost none. Names and keys are the dict keys themselves,
    # so a walk allocates nothing per module but list slots (and a view of each
    # non-empty dict of parameters). visit reaches itself through an argument, not
    # through its closure: a closure that refers to itself is a reference cycle, which
    # would keep every module of the tree alive until the cycle collector runs (never,
    # where training loops disable it).
    def visit(
        children: Mapping[str, nn.Module | None], parent: int, recurse: Callable[..., None]
    ) -> None:
        structure.append(parent)
        structure.append(len(children))
        names.extend(children)
        for child in children.values():
            if child is None:
                holes.append((parent, tuple(map(is_, children.values(), repeat(None)))))
                continue
            # nn.Module.__init__ puts the three member dicts in the instance __dict__
            # (scripted modules too); reading them there skips three attribute lookups.
            # A traced module has none there: its attribute lookup reaches the scripted
            # module inside, as named_parameters() and the other named_* functions do.
            attributes = child.__dict__
            try:
                own_params: _Members = attributes["_parameters"]
                own_buffers: _Members = attributes["_buffers"]
                grandchildren: Mapping[str, nn.Module | None] = attributes["_modules"]
            except KeyError:
                own_params, own_buffers, grandchildren = _members(child)
            if "forward" in attributes:
                forwards[len(modules)] = attributes["forward"]
            add_module(child)
            add_count(len(own_params))
            if own_params:
                add_keys(own_params)
                add_values(own_params.values())
            if own_buffers:
                buffer_counts.append(len(modules) - 1)
                buffer_counts.append(len(own_buffers))
                buffer_keys.extend(own_buffers)
                buffer_values.extend(own_buffers.values())
            if grandchildren:
                recurse(grandchildren, len(modules) - 1, recurse)

    visit({"": root}, -1, visit)
    return _snapshot(
        modules,
        tuple(map(type, modules)),
        (structure, names, holes),
        forwards,
        # Ids taken in one pass at the end: cheaper than one map per module.
        (
            (counts, keys, list(map(id, values))),
            (buffer_counts, buffer_keys, list(map(id, buffer_values))),
        ),
    )


_Members = Mapping[str, object]


def _members(module: nn.Module) -> tuple[_Members, _Members, Mapping[str, nn.Module | None]]:
    """``module``'s parameters, buffers and children, read through its attributes.

    For modules whose ``__dict__`` lacks them, as a ``torch.jit.trace``d module's does.
    All three are copied into dicts: the walk iterates them as dicts, and the scripted
    module's own mappings iterate otherwise (over positions, not keys).
    """
    return (
        dict(module._parameters.items()),
        dict(module._buffers.items()),
        dict(module._modules.items()),
    )


def _walk_error(
    root: nn.Module, api_name: str, label: Callable[[nn.Module], str] | None
) -> ContractError:
    """Why the walk of ``root`` went too deep: a cycle, or a tree nested too deeply."""
    name = label(root) if label is not None else type(root).__qualname__
    cycle = _find_cycle(root)
    if cycle is not None:
        path, module, ancestor = cycle
        return CyclicModuleTreeError(
            f"{api_name}: the module tree of {name} has a cycle: {type(module).__qualname__} at "
            f"{path!r} is the module at {quote_fqn(ancestor)} again, so named_modules(), "
            "state_dict() and the FQN check never end; remove that reference from the tree "
            "(keep a weakref.ref to the module instead)"
        )
    return ContractError(
        f"{api_name}: the module tree of {name} is nested deeper than Python's recursion limit "
        f"({sys.getrecursionlimit()}) lets named_modules() and state_dict() walk it; flatten it, "
        "or raise the limit with sys.setrecursionlimit"
    )


def _find_cycle(root: nn.Module) -> tuple[str, nn.Module, str] | None:
    """The first path, pre-order, at which a module of ``root``'s tree contains itself.

    Returns the path where the module is met again, the module, and its path on the
    way there; None for an acyclic tree. Iterative, and each module is explored once.
    """
    on_path: dict[int, str] = {}  # id -> FQN of the modules on the current path
    explored: set[int] = set()
    stack: list[tuple[str, nn.Module, bool]] = [("", root, False)]
    while stack:
        fqn, module, leaving = stack.pop()
        if leaving:
            del on_path[id(module)]
            explored.add(id(module))
            continue
        if id(module) in on_path:
            return fqn, module, on_path[id(module)]
        if id(module) in explored:
            continue
        on_path[id(module)] = fqn
        stack.append((fqn, module, True))
        dot = fqn + "." if fqn else ""
        stack.extend(
            (dot + name, child, False)
            for name, child in reversed(module._modules.items())
            if child is not None
        )
    return None


def unchanged_since(before: FQNSnapshot, root: nn.Module) -> bool:
    """Whether ``root``'s tree is, object for object, the one ``before`` copied.

    True: a snapshot of ``root`` taken now would be ``same_as`` ``before``, with the same
    classes and instance forwards (so every check against it passes). False says only
    that something may differ: take the snapshot and compare. Answered by the C walk,
    which compares as it goes and copies nothing; always False where it is not built.
    """
    if _native_unchanged is None:
        return False
    return _native_unchanged(root, before._copies()) is True


def descendants(root: nn.Module, seen: set[int] | None = None) -> Iterator[nn.Module]:
    """Every module strictly inside ``root``, each once (by identity), pre-order.

    ``seen`` holds the ids already visited; pass one set to several calls to walk a
    forest without visiting a shared subtree twice.
    """
    visited: set[int] = set() if seen is None else seen
    stack = [child for child in reversed(root._modules.values()) if child is not None]
    while stack:
        module = stack.pop()
        if id(module) in visited:
            continue
        visited.add(id(module))
        yield module
        stack.extend(child for child in reversed(module._modules.values()) if child is not None)


def _first_occurrences(names: list[str], ids: list[int]) -> list[str]:
    """The names whose object (by id) did not come earlier: tied parameters count once."""
    seen: set[int] = set()
    kept: list[str] = []
    for name, key in zip(names, ids, strict=True):
        if key not in seen:
            seen.add(key)
            kept.append(name)
    return kept


def _joined(prefixes: Iterable[str], counts: Iterable[int], keys: Iterable[str]) -> list[str]:
    """Each key joined to its owner's prefix: ``counts`` keys per prefix, in order (in C)."""
    owners: Iterator[str] = chain.from_iterable(map(repeat, prefixes, counts))
    return list(map(str.__add__, owners, keys))


def _present(names: list[str], ids: list[int]) -> tuple[list[str], list[int]]:
    """``names`` and ``ids`` without the entries whose value was None."""
    if _NONE_ID not in ids:
        return names, ids
    keep = list(map(ne, ids, repeat(_NONE_ID)))
    return list(compress(names, keep)), list(compress(ids, keep))


def quote_fqn(fqn: str) -> str:
    """``fqn`` quoted for a message; the empty FQN is "the root"."""
    return repr(fqn) if fqn else "the root"
