"""Which live ``fully_shard`` application manages a parameter, in one lookup per parameter.

Apply asks, for every parameter under its targets, whether another application
manages it already. Answering from a map of every managed parameter rebuilt on
each apply made sharding every block of an N-block model cost O(N²); this index
is updated when an application is made or rolled back instead, and forgets an
application's group once the group is freed (it refers to groups and their
parameters weakly: it never keeps a model's shards alive).

Two kinds of keys, every hit checked by identity so that a reused id never matches:

- where a group registers its tensors, ``(id(module), name)``: the tensor found
  there is managed if it is the group's shard or its unsharded parameter, both
  read from the group at lookup, so later changes (a shard adopted from a load,
  the unsharded parameter made at the first gather) need no update;
- the id of each original parameter: it stays registered wherever the group's
  modules do not reach (a parameter shared with a module outside the group).
"""

from __future__ import annotations

import threading
import weakref
from typing import NamedTuple

from torch import Tensor, nn

from ._group import ParamGroup
from ._sharding import ManagedParameter

__all__ = ["MANAGED", "ManagedIndex", "Manager"]


class Manager(NamedTuple):
    """The group managing a parameter, and whether the parameter is its original, left in place."""

    group: ParamGroup
    original: bool


class _Entry(NamedTuple):
    group: weakref.ref[ParamGroup]
    parameter: weakref.ref[ManagedParameter]
    module: weakref.ref[nn.Module] | None  # for a location key: the module registering it


class _Keys(NamedTuple):
    """What one group added, to take out again when it is rolled back or freed."""

    group: weakref.ref[ParamGroup]  # the reference the entries hold, with the freeing callback
    locations: list[tuple[tuple[int, str], _Entry]]
    originals: list[tuple[int, _Entry]]
    modules: list[int]


class ManagedIndex:
    """Managed parameters by where they are registered and by original; groups by module.

    Thread safety: lookups read dicts without a lock (each read is atomic);
    ``add`` and ``remove`` take a lock. A group freed while another thread holds
    it is forgotten at the next ``add`` or ``remove``; until then its entries only
    miss, since every lookup checks that the group is alive.
    """

    def __init__(self) -> None:
        self._at: dict[tuple[int, str], _Entry] = {}
        self._originals: dict[int, _Entry] = {}
        self._groups: dict[int, weakref.ref[ParamGroup]] = {}
        self._added: dict[weakref.ref[ParamGroup], _Keys] = {}
        self._freed: list[weakref.ref[ParamGroup]] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """The parameters indexed: one per location and one per original."""
        return len(self._at) + len(self._originals)

    def add(self, group: ParamGroup) -> None:
        """Index ``group``'s parameters and modules; it is forgotten when freed."""
        ref = weakref.ref(group, self._on_freed)
        keys = _Keys(ref, [], [], [])
        for parameter in group.parameters:
            parameter_ref = weakref.ref(parameter)
            for module_ref, name in parameter.locations:
                module = module_ref()
                if module is not None:
                    keys.locations.append(
                        ((id(module), name), _Entry(ref, parameter_ref, module_ref))
                    )
            original = parameter.original()
            if original is not None:
                keys.originals.append((id(original), _Entry(ref, parameter_ref, None)))
        keys.modules.extend(id(module) for module in group.modules())
        with self._lock:
            self._purge()
            self._added[ref] = keys
            self._at.update(keys.locations)
            self._originals.update(keys.originals)
            for module_id in keys.modules:
                self._groups[module_id] = ref

    def remove(self, group: ParamGroup) -> None:
        """Forget ``group`` (its application was rolled back); a no-op if not indexed."""
        with self._lock:
            self._purge()
            keys = self._added.pop(weakref.ref(group), None)
            if keys is not None:
                self._forget(keys)

    def manager(self, module: nn.Module, name: str, parameter: Tensor) -> Manager | None:
        """The live group managing ``parameter``, registered as ``module._parameters[name]``."""
        entry = self._at.get((id(module), name))
        if entry is not None and entry.module is not None and entry.module() is module:
            group, managed = entry.group(), entry.parameter()
            if (
                group is not None
                and managed is not None
                and (parameter is managed.sharded or parameter is managed.unsharded)
            ):
                return Manager(group, original=False)
        entry = self._originals.get(id(parameter))
        if entry is not None:
            group, managed = entry.group(), entry.parameter()
            if group is not None and managed is not None and managed.original() is parameter:
                return Manager(group, original=True)
        return None

    def group_of(self, module: nn.Module) -> ParamGroup | None:
        """The live group whose application targets ``module``, if any."""
        ref = self._groups.get(id(module))
        group = ref() if ref is not None else None
        if group is not None and any(each is module for each in group.modules()):
            return group
        return None

    def _on_freed(self, ref: weakref.ref[ParamGroup]) -> None:
        # Runs wherever the last reference to a group goes, maybe in this very thread
        # inside add() or remove(): never wait for the lock, leave the work to them.
        self._freed.append(ref)
        if self._lock.acquire(blocking=False):
            try:
                self._purge()
            finally:
                self._lock.release()

    def _purge(self) -> None:
        """Forget the groups freed since the last call (the caller holds the lock)."""
        while self._freed:
            ref = self._freed.pop()
            keys = self._added.pop(ref, None)
            if keys is not None:
                self._forget(keys)

    def _forget(self, keys: _Keys) -> None:
        # A key now held by a newer group (an id reused) stays.
        for location, entry in keys.locations:
            if self._at.get(location) is entry:
                del self._at[location]
        for original, entry in keys.originals:
            if self._originals.get(original) is entry:
                del self._originals[original]
        for module_id in keys.modules:
            if self._groups.get(module_id) is keys.group:
                del self._groups[module_id]


#: The index of every live application's parameters; see the module's docstring.
MANAGED = ManagedIndex()
