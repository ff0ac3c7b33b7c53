"""FQN snapshots as tuples: one walk of the module tree, names built only when asked.

A snapshot has exactly the semantics of ``named_parameters()``,
``named_buffers(remove_duplicate=False)`` and
``named_modules(remove_duplicate=False)``: modules and buffers at every path, a
parameter only at its first path (shared modules and tied parameters appear
once), ``None`` entries skipped. It also lists every parameter at every path, as
``named_parameters(remove_duplicate=False)`` and ``state_dict()`` do. Identity,
not ``__eq__``/``__hash__``, decides what is shared.

Speed: one walk copies, per module visited, its depth and name in the tree and
the keys of its ``_parameters`` and ``_buffers`` and the ids of their values into
flat lists, the same lists for both kinds (a count of each per module tells them
apart). It builds no string per module: the pre-order sequence of (depth,
name) pairs fixes every path, so the FQN tuples can be built from the copies
later, and only when someone asks for them. Two snapshots whose copies are equal
(same depths, names, keys and value ids) have equal FQNs: equal ids mean the same
``None`` entries and the same tied parameters, since within one walk equal ids
are one object. So comparing them needs no FQNs at all; any other pair is
compared by its FQNs. Ids rather than the tensors themselves, so that a snapshot
keeps no tensor alive: an API that replaces parameters frees the old ones as it
goes. Nothing is cached across walks: every snapshot reads the whole tree again,
so no change can hide.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import chain, compress, cycle, repeat
from operator import ne, not_
from typing import Final

from torch import nn

from ._errors import ContractError, CyclicModuleTreeError

__all__ = ["FQNSnapshot", "descendants", "quote_fqn", "take_snapshot"]

_NONE_ID: Final = id(None)
_NO_FORWARD: Final = object()

#: What a walk copies of members: counts per module, keys, ids of the values. A snapshot
#: holds one for parameters and buffers together, each module's parameter count followed
#: by its buffer count, its parameters' keys and ids by its buffers'.
_MemberCopy = tuple[list[int], list[str], list[int]]


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

    # Few slots: a snapshot is built twice per apply, and each slot written costs.
    # ``_tree`` is (depths, names); ``_forwards`` maps a module's position to its
    # instance ``forward``; ``_members`` is the parameters and buffers (counts per module, keys,
    # value ids); ``_names`` caches the FQN tuples built from them, by kind;
    # ``_modules`` is the walk's own list of modules, never written after it (copying
    # it into a tuple would touch every module object again, where a large tree has
    # left the CPU's caches). Filled by ``_snapshot``, the one place a snapshot is built.
    __slots__ = ("_forwards", "_members", "_modules", "_names", "_tree", "classes")
    _modules: Sequence[nn.Module]
    classes: tuple[type[nn.Module], ...]
    _tree: tuple[list[int], list[str]]
    _forwards: Mapping[int, object]
    _members: _MemberCopy
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
            params = self._split()[0]
            names, ids = _present(self._member_names(params), params[2])
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
            lambda: tuple(_present(self._member_names(params := self._split()[0]), params[2])[0]),
        )

    @property
    def buffers(self) -> tuple[str, ...]:
        """Buffer FQNs, as the names of ``named_buffers(remove_duplicate=False)``."""
        return self._cached(
            "buffers",
            lambda: tuple(_present(self._member_names(buffs := self._split()[1]), buffs[2])[0]),
        )

    @property
    def module_fqns(self) -> tuple[str, ...]:
        """Module FQNs, as the names of ``named_modules(remove_duplicate=False)``."""
        return self._cached("modules", lambda: self._build_fqns()[0])

    def _split(self) -> tuple[_MemberCopy, _MemberCopy]:
        """The parameters' copy and the buffers' copy, apart (each pass in C)."""
        counts, keys, ids = self._members
        param_counts, buffer_counts = counts[0::2], counts[1::2]
        if not any(buffer_counts):
            return (param_counts, keys, ids), (buffer_counts, [], [])
        # Per key, whether it is a parameter: each module's count of True, then of False.
        is_param = list(chain.from_iterable(map(repeat, cycle((True, False)), counts)))
        is_buffer = list(map(not_, is_param))
        return (
            (param_counts, list(compress(keys, is_param)), list(compress(ids, is_param))),
            (buffer_counts, list(compress(keys, is_buffer)), list(compress(ids, is_buffer))),
        )

    def _member_names(self, members: _MemberCopy) -> list[str]:
        """Each member key of ``members`` joined to the prefix of the module it belongs to."""
        prefixes = self._cached("prefixes", lambda: self._build_fqns()[1])
        counts, keys, _ = members
        owners: Iterator[str] = chain.from_iterable(map(repeat, prefixes, counts))
        return list(map(str.__add__, owners, keys))

    def _build_fqns(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Every module's FQN and member prefix, rebuilt from the (depth, name) pairs.

        As ``named_modules()``: a child's FQN is its parent's FQN, a dot and its name,
        without the dot when the parent's FQN is empty; its member prefix is its FQN
        and a dot, or empty when its FQN is.
        """
        fqns: list[str] = []
        prefixes: list[str] = []
        ancestors: list[str] = []  # member prefix of the current ancestor at each depth
        for depth, name in zip(*self._tree, strict=True):
            fqn = ancestors[depth - 1] + name if depth else ""
            prefix = fqn + "." if fqn else ""
            del ancestors[depth:]
            ancestors.append(prefix)
            fqns.append(fqn)
            prefixes.append(prefix)
        return tuple(fqns), tuple(prefixes)

    @property
    def forwards(self) -> tuple[object, ...]:
        """Per module, the ``forward`` set on the instance at snapshot time, or None."""
        return tuple(map(self._forwards.get, range(len(self._modules))))

    def same_as(self, other: FQNSnapshot) -> bool:
        """Whether both walks copied the same tree, keys and member objects.

        True implies equal ``parameters``, ``buffers`` and ``module_fqns``; False
        implies nothing (the names may still agree), so compare the names then.
        """
        # Tuples of lists compare item by item: depths and names, then counts, keys, ids;
        # equal interleaved counts split both kinds' keys and ids alike.
        return self._tree == other._tree and self._members == other._members

    def __repr__(self) -> str:
        return (
            f"<FQNSnapshot of {len(self._modules)} modules, {len(self.parameters)} parameters, "
            f"{len(self.buffers)} buffers>"
        )


_new: Final = object.__new__
#: The (depths, names) of every leaf, and the members of a leaf that has none of a kind:
#: shared, never written.
_LEAF_TREE: Final = ([0], [""])
_NO_MEMBERS: Final[_MemberCopy] = ([0, 0], [], [])


def _snapshot(
    modules: Sequence[nn.Module],
    classes: tuple[type[nn.Module], ...],
    tree: tuple[list[int], list[str]],
    forwards: Mapping[int, object],
    members: _MemberCopy,
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
            _leaf_members(params, buffers) if params or buffers else _NO_MEMBERS,
        )
    modules: list[nn.Module] = []
    depths: list[int] = []
    names: list[str] = []
    forwards: dict[int, object] = {}
    counts: list[int] = []
    keys: list[str] = []
    values: list[object] = []
    add_module, add_depth, add_name = modules.append, depths.append, names.append
    add_count, add_keys, add_values = counts.append, keys.extend, values.extend

    # Recursion with bound methods and bulk list.extend calls is the fastest
    # pure-Python walk measured; the depth limit is the one named_modules() has.
    # Names are the dict keys themselves and depths are small cached ints, so a
    # walk allocates nothing per module but list slots (and a view of each
    # non-empty dict of members or children). visit reaches itself
    # through an argument, not through its closure: a closure that refers to
    # itself is a reference cycle, which would keep every module of the tree alive
    # until the cycle collector runs (never, where training loops disable it).
    def visit(module: nn.Module, name: str, depth: int, recurse: Callable[..., None]) -> None:
        # nn.Module.__init__ puts the three member dicts in the instance __dict__
        # (scripted modules too); reading them there skips three attribute lookups.
        # A traced module has none there: its attribute lookup reaches the scripted
        # module inside, as named_parameters() and the other named_* functions do.
        attributes = module.__dict__
        try:
            own_params: _Members = attributes["_parameters"]
            own_buffers: _Members = attributes["_buffers"]
            children: Mapping[str, nn.Module | None] = attributes["_modules"]
        except KeyError:
            own_params, own_buffers, children = _members(module)
        if "forward" in attributes:
            forwards[len(modules)] = attributes["forward"]
        add_module(module)
        add_depth(depth)
        add_name(name)
        # Keys by iterating the dict itself, children only where there are any: each
        # view or iterator not made is an allocation fewer per module.
        count = len(own_params)
        add_count(count)
        if count:
            add_keys(own_params)
            add_values(own_params.values())
        count = len(own_buffers)
        add_count(count)
        if count:
            add_keys(own_buffers)
            add_values(own_buffers.values())
        if children:
            depth += 1
            for child_name, child in children.items():
                if child is not None:
                    recurse(child, child_name, depth, recurse)

    visit(root, "", 0, visit)
    return _snapshot(
        modules,
        tuple(map(type, modules)),
        (depths, names),
        forwards,
        # Ids taken in one pass at the end: cheaper than one map per module.
        (counts, keys, list(map(id, values))),
    )


def _leaf_members(params: _Members, buffers: _Members) -> _MemberCopy:
    """The members of a module without children, copied as a walk copies them."""
    if not buffers:
        return [len(params), 0], list(params), list(map(id, params.values()))
    return (
        [len(params), len(buffers)],
        [*params, *buffers],
        [*map(id, params.values()), *map(id, buffers.values())],
    )


_Members = Mapping[str, object]


def _members(module: nn.Module) -> tuple[_Members, _Members, Mapping[str, nn.Module | None]]:
    """``module``'s parameters, buffers and children, read through its attributes.

    For modules whose ``__dict__`` lacks them, as a ``torch.jit.trace``d module's does.
    Parameters and buffers are copied into dicts: the walk iterates them as dicts, and
    the scripted module's own mappings iterate otherwise.
    """
    return dict(module._parameters.items()), dict(module._buffers.items()), module._modules


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


def _present(names: list[str], ids: list[int]) -> tuple[list[str], list[int]]:
    """``names`` and ``ids`` without the entries whose value was None."""
    if _NONE_ID not in ids:
        return names, ids
    keep = list(map(ne, ids, repeat(_NONE_ID)))
    return list(compress(names, keep)), list(compress(ids, keep))


def quote_fqn(fqn: str) -> str:
    """``fqn`` quoted for a message; the empty FQN is "the root"."""
    return repr(fqn) if fqn else "the root"
