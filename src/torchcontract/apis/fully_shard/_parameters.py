"""The parameters one fully_shard application manages, found and validated, and their layouts.

``find_parameters`` walks the targets once: it leaves out the modules of a nested
application, as FSDP2 does (their parameters, managed or not), and what
``ignored_params`` covers, refuses what another application manages and scalars, and
reads nothing else. ``layouts_of`` gives each parameter its shard dim and layout.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence, Set

import attrs
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from torchcontract import AlreadyManagedError, ScalarParameterError, module_label, named_tree

from ._group import ParamGroup
from ._layout import Layout, layout_of
from ._managed import MANAGED
from ._placement import shard_dim
from ._sharding import Location, new_origin
from ._spmd import DataParallelDims, spmd_layout

__all__ = ["Found", "find_parameters", "layouts_of"]


@attrs.frozen
class Found:
    """A parameter to manage: its first FQN, the object, and every place it is registered."""

    fqn: str
    parameter: nn.Parameter
    locations: list[Location]
    origin: int


def find_parameters(
    targets: Sequence[nn.Module], ignored: Set[int], skipped: list[str], buffers: list[Tensor]
) -> list[Found]:
    """The parameters under ``targets``, short of nested applications' modules, validated.

    As FSDP2's managed modules: a module (other than a target) that another
    ``fully_shard`` application targets is not entered, so a parameter under it that
    that application does not manage (ignored there, or registered after it) is left
    as it is, not sharded here.

    Raises ``AlreadyManagedError`` for a parameter another application that is
    not nested in the targets manages; ``ScalarParameterError`` for a 0-d one. A
    parameter registered where another application's modules do not reach (shared
    with them) is sharded again, as FSDP2 does, under the same origin: the first
    forward refuses it (``check_shared``). Parameters whose ids are in ``ignored``
    are left out, their first FQNs appended to ``skipped``. The buffers of the
    modules walked (FSDP2's managed modules) are appended to ``buffers``, each once.
    Reads only: nothing is changed. One index lookup per parameter, and error text
    only for an error: the cost is linear in the targets' modules and parameters,
    whatever else is sharded.
    """
    inside: set[int] | None = None  # ids of the targets' modules, once a managed one is found
    shared: dict[int, ParamGroup] = {}  # originals another application also shards, by id
    nested: dict[int, bool] = {}  # by group id: whether one of its modules is inside
    found: dict[int, Found] = {}
    seen_ignored: set[int] = set()
    seen_buffers: set[int] = set()
    own = {id(target) for target in targets}
    for target in targets:
        skipped_below: str | None = None  # the FQN prefix of a nested application's modules
        for prefix, module in named_tree(target):
            if skipped_below is not None and prefix.startswith(skipped_below):
                continue  # pre-order: a skipped module's subtree comes right after it
            skipped_below = None
            if id(module) not in own and MANAGED.group_of(module) is not None:
                skipped_below = prefix + "."
                continue
            for buffer in module._buffers.values():
                if buffer is not None and id(buffer) not in seen_buffers:
                    seen_buffers.add(id(buffer))
                    buffers.append(buffer)
            for name, parameter in module._parameters.items():
                if parameter is None:
                    continue
                if ignored and id(parameter) in ignored:
                    if id(parameter) not in seen_ignored:
                        seen_ignored.add(id(parameter))
                        skipped.append(_fqn(prefix, name))
                    continue
                manager = MANAGED.manager(module, name, parameter)
                if manager is not None and manager.original:
                    # Shared with another application's modules: sharded here again, as
                    # FSDP2 does; the first forward refuses the two groups (``check_shared``).
                    shared[id(parameter)] = manager.group
                elif manager is not None:
                    verdict = nested.get(id(manager.group))
                    if verdict is None:
                        if inside is None:
                            inside = _module_ids(targets)
                        modules = manager.group.modules()
                        verdict = nested[id(manager.group)] = any(id(m) in inside for m in modules)
                    if not verdict:
                        raise AlreadyManagedError(
                            f"{_where(target, prefix, name)} is already managed by fully_shard "
                            f"on {_owner(manager.group)}; apply fully_shard to the inner modules "
                            "first, then to the outer"
                        )
                    continue  # a nested application manages it
                if parameter.dim() == 0:
                    raise ScalarParameterError(
                        f"{_where(target, prefix, name)} is a scalar (0-d), which cannot be "
                        "sharded on dim 0; reshape it to one element (FSDP2: fully_shard "
                        "doesn't support scalar parameters. Change "
                        f"{name} to a 1D tensor with numel equal to 1.)"
                    )
                entry = found.get(id(parameter))
                if entry is None:
                    entry = found[id(parameter)] = Found(
                        _fqn(prefix, name), parameter, [], _origin(parameter, shared)
                    )
                entry.locations.append((weakref.ref(module), name))
    return list(found.values())


def _origin(parameter: nn.Parameter, shared: dict[int, ParamGroup]) -> int:
    """The origin of ``parameter``'s shards: the other application's if it shards it too."""
    group = shared.get(id(parameter))
    if group is not None:
        for managed in group.parameters:
            if managed.original() is parameter:
                return managed.origin
    return new_origin()


def _module_ids(targets: Sequence[nn.Module]) -> set[int]:
    """The ids of every module under ``targets``, themselves included."""
    seen: set[int] = set()
    stack = list(targets)
    while stack:
        module = stack.pop()
        if id(module) not in seen:
            seen.add(id(module))
            stack.extend(child for child in module._modules.values() if child is not None)
    return seen


def layouts_of(
    target: nn.Module,
    found: Sequence[Found],
    mesh: DeviceMesh,
    placement_fn: Callable[[nn.Parameter], object] | None,
    spmd: DataParallelDims | None,
) -> list[Layout]:
    """Each parameter's layout: its dim from ``placement_fn``, TP's DTensor if it is one.

    With ``spmd`` (``dp_mesh_dims``), each a DTensor on the full mesh.
    """
    world = mesh.size(mesh.ndim - 1)
    layouts: list[Layout] = []
    for item in found:
        _check_contiguous(target, item)
        dim = shard_dim(target, item.fqn, item.parameter, placement_fn, world)
        if spmd is None:
            layouts.append(layout_of(target, item.fqn, item.parameter, mesh, dim))
        else:
            layouts.append(spmd_layout(target, item.fqn, item.parameter, spmd, dim))
    return layouts


def _check_contiguous(target: nn.Module, item: Found) -> None:
    """Refuse a non-contiguous parameter (``channels_last``), as FSDP2 does."""
    parameter = item.parameter
    if not parameter.is_contiguous():
        raise NotImplementedError(
            f"{_where(target, '', item.fqn)} is not contiguous (strides {parameter.stride()}, "
            "e.g. channels_last), which fully_shard, as FSDP2, does not shard (FSDP2: FSDP does "
            f"not support non-contiguous parameters yet: param.shape={parameter.shape} "
            f"param.stride()={parameter.stride()}); make it contiguous first "
            "(module.to(memory_format=torch.contiguous_format))"
        )


def _fqn(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _where(target: nn.Module, prefix: str, name: str) -> str:
    """How an error names a parameter; built only when there is an error to report."""
    return f"fully_shard on {module_label(target)}: parameter {_fqn(prefix, name)!r}"


def _owner(group: ParamGroup) -> str:
    modules = group.modules()
    return module_label(modules[0]) if modules else "a freed module"
