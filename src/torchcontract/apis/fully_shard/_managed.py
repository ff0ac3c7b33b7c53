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

__all__ = ["MANAGED", "ManagedIndex", "Manager"]


class Manager(NamedTuple):
    """The group managing a parameter, and whether the parameter is its original, left in place."""

    group: ParamGroup
    original: bool


class _Location(NamedTuple):
    """A place a group registers one of its parameters: ``module._parameters[name]``."""

    group: weakref.ref[ParamGroup]
    position: int  # of the parameter in ``group.parameters``
    module: weakref.ref[nn.Module]


class _Original(NamedTuple):
    """An original parameter; its reference is keyed by the id, to forget the entry at its end."""

    group: weakref.ref[ParamGroup]
    tensor: weakref.KeyedRef[int, nn.Parameter]


class _Keys(NamedTuple):
    """What one group added, to take out again when it is rolled back or freed."""

    group: weakref.ref[ParamGroup]  # the reference the entries hold, with the freeing callback
    locations: list[tuple[int, str]]  # keys: module ids and names
    originals: list[int]  # keys: ids of the original parameters
    modules: list[int]


class ManagedIndex:
    """Managed parameters by where they are registered and by original; groups by module.

    An original parameter that nothing else holds (the usual case: only the
    modules the group took it from did) is forgotten as soon as it is freed.

    Thread safety: lookups read dicts without a lock (each read is atomic);
    ``add`` and ``remove`` take a lock. What is freed while another thread holds
    the lock is forgotten at the next ``add`` or ``remove``; until then its
    entries only miss, since every lookup checks identity and liveness.
    """

    def __init__(self) -> None:
        self._at: dict[tuple[int, str], _Location] = {}
        self._originals: dict[int, _Original] = {}
        self._groups: dict[int, weakref.ref[ParamGroup]] = {}
        self._added: dict[weakref.ref[ParamGroup], _Keys] = {}
        # Freed since the last purge: groups, and originals' references (appended by callbacks).
        self._freed_groups: list[weakref.ref[ParamGroup]] = []
        self._freed_originals: list[weakref.KeyedRef[int, nn.Parameter]] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """The entries held: one per location of a managed parameter, one per live original."""
        return len(self._at) + len(self._originals)

    def add(self, group: ParamGroup) -> None:
        """Index ``group``'s parameters and modules; each is forgotten when freed."""
        ref = weakref.ref(group, self._on_group_freed)
        keys = _Keys(ref, [], [], [])
        locations: dict[tuple[int, str], _Location] = {}
        originals: list[_Original] = []
        for index, parameter in enumerate(group.parameters):
            for module_ref, name in parameter.locations:
                module = module_ref()
                if module is not None:
                    locations[id(module), name] = _Location(ref, index, module_ref)
            original = parameter.original()
            if original is not None:
                tensor = weakref.KeyedRef(original, self._on_original_freed, id(original))
                originals.append(_Original(ref, tensor))
                keys.originals.append(id(original))
        keys.locations.extend(locations)
        keys.modules.extend(id(module) for module in group.modules())
        with self._lock:
            self._purge()
            self._added[ref] = keys
            self._at.update(locations)
            for entry in originals:
                self._originals[entry.tensor.key] = entry
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
        location = self._at.get((id(module), name))
        if location is not None and location.module() is module:
            group = location.group()
            if group is not None:
                managed = group.parameters[location.position]
                if parameter is managed.sharded or parameter is managed.unsharded:
                    return Manager(group, original=False)
        original = self._originals.get(id(parameter))
        if original is not None and original.tensor() is parameter:
            group = original.group()
            if group is not None:
                return Manager(group, original=True)
        return None

    def group_of(self, module: nn.Module) -> ParamGroup | None:
        """The live group whose application targets ``module``, if any."""
        ref = self._groups.get(id(module))
        group = ref() if ref is not None else None
        if group is not None and any(each is module for each in group.modules()):
            return group
        return None

    # Callbacks run wherever the last reference goes, maybe in this very thread inside
    # add() or remove(): they never wait for the lock, and leave the work to its holder.

    def _on_group_freed(self, ref: weakref.ref[ParamGroup]) -> None:
        self._freed_groups.append(ref)
        self._try_purge()

    def _on_original_freed(self, ref: weakref.KeyedRef[int, nn.Parameter]) -> None:
        self._freed_originals.append(ref)
        self._try_purge()

    def _try_purge(self) -> None:
        if self._lock.acquire(blocking=False):
            try:
                self._purge()
            finally:
                self._lock.release()

    def _purge(self) -> None:
        """Forget what was freed since the last call (the caller holds the lock)."""
        while self._freed_originals:
            tensor = self._freed_originals.pop()
            original = self._originals.get(tensor.key)
            if original is not None and original.tensor is tensor:
                del self._originals[tensor.key]
        while self._freed_groups:
            keys = self._added.pop(self._freed_groups.pop(), None)
            if keys is not None:
                self._forget(keys)

    def _forget(self, keys: _Keys) -> None:
        # A key now held by a newer group (an id reused) stays.
        for place in keys.locations:
            location = self._at.get(place)
            if location is not None and location.group is keys.group:
                del self._at[place]
        for tensor_id in keys.originals:
            original = self._originals.get(tensor_id)
            if original is not None and original.group is keys.group:
                del self._originals[tensor_id]
        for module_id in keys.modules:
            if self._groups.get(module_id) is keys.group:
                del self._groups[module_id]


#: The index of every live application's parameters; see the module's docstring.
MANAGED = ManagedIndex()
