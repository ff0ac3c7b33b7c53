"""Typed views of the torch functions these APIs call that torch leaves unannotated.

Each is the torch function itself, cast once here to the signature this package
uses, or a thin typed wrapper around it, so the API modules type-check strictly
without suppressing anything.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Final, ParamSpec, TypeVar, cast

import torch
import torch._utils
import torch.distributed as dist
import torch.distributed.utils
from torch import Tensor, nn
from torch.distributed.algorithms.join import _JoinConfig
from torch.distributed.tensor import DTensor
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils.hooks import RemovableHandle

from . import _compat
from ._backends import serving_backend
from ._let_go import Collective, hand_over

__all__ = [
    "accelerator_type",
    "all_gather_into",
    "all_gather_into_async",
    "all_reduce",
    "all_reduce_average",
    "all_reduce_blocking",
    "all_reduce_max",
    "averages_in_collectives",
    "barrier",
    "broadcast",
    "checkpoint_generator",
    "checkpoint_is_valid",
    "chunk_cat",
    "copy_each",
    "current_graph_task_id",
    "device_module_initialized",
    "disabled_join_config",
    "dtensor_like",
    "fork_rng",
    "get_device_states",
    "host_values_on",
    "infer_device_type",
    "is_wrapper_subclass",
    "manual_seed",
    "nccl_version",
    "optimizer_step",
    "outside_compile",
    "post_accumulate_grad_hooks",
    "queue_callback",
    "reduce_scatter_average",
    "reduce_scatter_sum",
    "register_accumulator_hook",
    "register_load_state_dict_post_hook",
    "register_load_state_dict_pre_hook",
    "register_post_accumulate_grad_hook",
    "register_state_dict_pre_hook",
    "register_tensor_hook",
    "resume_in_enclosing_backward",
    "set_device_states",
    "swap_tensors",
    "to_bools",
    "to_ints",
    "work_tensor",
]

#: torch's non-reentrant checkpoint generator, as this torch release calls it.
checkpoint_generator: Final = _compat.checkpoint_generator

#: False inside ``torch.autograd.grad()`` or ``backward(inputs=...)``, where a reentrant
#: backward cannot reach the leaves.
checkpoint_is_valid: Final = cast(Callable[[], bool], torch.autograd._is_checkpoint_valid)

#: ``_infer_device_type(*args)``: the accelerator type of the tensors among ``args``, else cpu.
infer_device_type: Final = cast(Callable[..., str], torch_checkpoint._infer_device_type)

#: ``get_device_states(*args)``: the ids and RNG states of the accelerators ``args`` live on.
get_device_states: Final = cast(
    Callable[..., tuple[list[int], list[Tensor]]], torch_checkpoint.get_device_states
)

#: ``set_device_states(devices, states, *, device_type)``.
set_device_states: Final = cast(Callable[..., None], torch_checkpoint.set_device_states)

#: ``fork_rng(devices, enabled, device_type=...)``: restores the RNG states on exit.
fork_rng: Final = cast(Callable[..., AbstractContextManager[None]], torch.random.fork_rng)

#: ``torch.manual_seed(seed)``: seeds every device's default generator.
manual_seed: Final = cast(Callable[[int], object], torch.manual_seed)

_get_device_module: Final = cast(Callable[[str], Any], torch_checkpoint._get_device_module)


def accelerator_type() -> str:
    """The device type of the available accelerator (``"cuda"``, ...), else ``"cpu"``.

    Where FSDP2 puts its default mesh (``_init_default_fully_shard_mesh``); unlike
    it, a build with an accelerator but no device visible gets ``"cpu"``.
    """
    if torch.accelerator.is_available():
        device = torch.accelerator.current_accelerator()
        if device is not None:
            return device.type
    return "cpu"


def device_module_initialized(device_type: str) -> bool:
    """Whether the accelerator runtime of ``device_type`` is initialized (never for cpu)."""
    return bool(getattr(_get_device_module(device_type), "_initialized", False))


_P = ParamSpec("_P")
_R = TypeVar("_R")
_T = TypeVar("_T")

_compiler_disable: Final = cast(Callable[..., Callable[..., Any]], torch.compiler.disable)


def outside_compile(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """``function``, never traced by ``torch.compile``, nor anything it calls.

    Its frame runs eagerly, as FSDP2's hooks do (``torch._dynamo.disable``): a
    module hook decorated so runs its parameter swaps and collectives outside the
    graph, and dynamo compiles the module's ``forward`` frame on its own.
    """
    return cast(Callable[_P, _R], _compiler_disable(function, recursive=True))


#: ``swap_tensors(a, b)``: exchange two tensors' contents, keeping each Python object.
swap_tensors: Final = cast(Callable[[Tensor, Tensor], None], torch.utils.swap_tensors)
#: Whether a tensor is a wrapper subclass (its data cannot be set: swap it instead).
is_wrapper_subclass: Final = cast(Callable[[Tensor], bool], is_traceable_wrapper_subclass)

_all_reduce: Final = cast(Callable[..., dist.Work | None], dist.all_reduce)


def _start(
    collective: Callable[..., dist.Work | None],
    group: dist.ProcessGroup,
    tensors: tuple[Tensor, ...],
    **options: object,
) -> Collective:
    """Start ``collective(*tensors, group=group, **options)``; the handle ends it.

    On gloo, through aliases that gloo's thread has let go of once ``wait()``
    returns (``_let_go``): no tensor of these APIs is freed on that thread.
    """
    return _started(collective, group, tensors, hand_over(group, *tensors), options)


def _started(
    collective: Callable[..., dist.Work | None],
    group: dist.ProcessGroup,
    tensors: tuple[Tensor, ...],
    aliases: tuple[Tensor, ...] | None,
    options: dict[str, object],
) -> Collective:
    """``collective`` started on ``aliases`` where there are some, else on ``tensors``."""
    given = tensors if aliases is None else aliases
    work = collective(*given, group=group, async_op=True, **options)
    if work is None:
        raise RuntimeError("torchcontract: an asynchronous collective returned no handle")
    return Collective(work, aliases)


def _run(
    collective: Callable[..., dist.Work | None],
    group: dist.ProcessGroup,
    tensors: tuple[Tensor, ...],
    **options: object,
) -> None:
    """Run ``collective(*tensors, group=group, **options)`` to its end, as torch's call.

    Synchronous, as torch runs it (NCCL on the caller's stream), except on gloo:
    there started, and waited for until gloo's thread let go (``_let_go``).
    """
    aliases = hand_over(group, *tensors)
    if aliases is None:
        collective(*tensors, group=group, **options)
        return
    _started(collective, group, tensors, aliases, options).wait()


def all_reduce(tensor: Tensor, group: dist.ProcessGroup) -> Collective:
    """Start a sum all-reduce of ``tensor`` in place over ``group``; wait on the handle."""
    return _start(_all_reduce, group, (tensor,))


def disabled_join_config() -> _JoinConfig:
    """The config ``Join`` finds on a joinable outside any ``Join`` (joining disabled)."""
    make = cast(
        Callable[[], _JoinConfig],
        getattr(_JoinConfig, "construct_disabled_join_config"),  # noqa: B009 (untyped)
    )
    return make()


def nccl_version() -> tuple[int, ...]:
    """The NCCL version this torch was built with."""
    return cast(Callable[[], tuple[int, ...]], getattr(torch.cuda, "nccl").version)()  # noqa: B009


def all_reduce_max(tensor: Tensor, group: dist.ProcessGroup) -> None:
    """Replace ``tensor`` in place by its largest value over ``group``, and wait for it."""
    _run(_all_reduce, group, (tensor,), op=dist.ReduceOp.MAX)


def work_tensor(work: dist.Work) -> Tensor:
    """The first tensor a finished collective's future holds."""
    future = cast(Callable[[], torch.futures.Future[list[Tensor]]], work.get_future)()
    return future.value()[0]


#: The default group; c10d's ``ValueError`` before ``init_process_group``.
_default_group: Final = cast(
    Callable[[], dist.ProcessGroup], vars(dist.distributed_c10d)["_get_default_group"]
)


def all_reduce_blocking(tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
    """Reduce ``tensor`` in place over the default group with ``op``, and wait for it."""
    _run(_all_reduce, _default_group(), (tensor,), op=op)


_barrier: Final = cast(Callable[[], object], dist.barrier)


def barrier() -> None:
    """Wait until every rank of the default group reaches this call."""
    _barrier()


def broadcast(tensor: Tensor, source: int, group: dist.ProcessGroup) -> None:
    """Overwrite ``tensor`` with group rank ``source``'s copy, on every rank of ``group``; wait.

    Through the group's own method, as DDP's broadcasts (``_broadcast_coalesced``):
    it takes a group torch.distributed never registered (torchft's, or one built
    from a store), which ``dist.broadcast`` refuses where it translates ranks.
    """
    options = dist.BroadcastOptions()
    options.rootRank = source
    options.rootTensor = 0
    aliases = hand_over(group, tensor)
    Collective(group.broadcast(list(aliases or (tensor,)), options), aliases).wait()


def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """Take one step of ``optimizer``."""
    cast(Callable[[], object], optimizer.step)()


#: torch's walk of a forward's inputs and outputs, which FSDP2 casts through.
_apply_to_tensors: Final = vars(torch.distributed.utils)["_apply_to_tensors"]


def map_tensors(function: Callable[[Tensor], Tensor], tree: _T) -> _T:
    """``tree`` with ``function`` applied to each of its tensors, as FSDP2 walks its casts.

    torch's ``_apply_to_tensors``: into dataclasses, dicts, named tuples, lists, tuples
    and sets, subclasses included (``pytree`` sees an unregistered one as one leaf).
    """
    apply = cast(Callable[[Callable[[Tensor], Tensor], object], object], _apply_to_tensors)
    return cast(_T, apply(function, tree))


def object_collective_device(group: dist.ProcessGroup) -> torch.device:
    """The device ``group``'s collectives of Python objects run on, as ``all_gather_object``'s.

    The CPU for gloo; the current GPU for NCCL, which takes no CPU tensor.
    """
    device_type = cast(
        Callable[[dist.ProcessGroup], str], vars(dist.distributed_c10d)["_get_object_coll_device"]
    )(group)
    return torch.device(device_type)


def host_values_on(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 1-D tensor of ``values`` on ``device``, copied there without the host waiting.

    On an accelerator through pinned memory: a copy from ordinary host memory waits
    for every kernel queued on the device first (``torch.tensor(..., device=...)``).
    """
    values_on_host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return values_on_host
    try:
        pinned = values_on_host.pin_memory()
    except RuntimeError:  # a device without pinned host memory: a plain copy
        return values_on_host.to(device)
    return pinned.to(device, non_blocking=True)


def to_bools(tensor: Tensor) -> list[bool]:
    """The elements of a 1-D boolean tensor, in one device-to-host copy."""
    return cast(Callable[[], list[bool]], tensor.tolist)()


# torch does not export its foreach kernels for type checkers; read it from the module.
_foreach_copy: Final = cast(
    Callable[[list[Tensor], list[Tensor]], object], vars(torch)["_foreach_copy_"]
)


def copy_each(targets: list[Tensor], sources: list[Tensor]) -> None:
    """``target.copy_(source)`` for every pair, in one call."""
    _foreach_copy(targets, sources)


def to_ints(tensor: Tensor) -> list[int]:
    """The elements of a 1-D integer tensor, in one device-to-host copy."""
    return cast(Callable[[], list[int]], tensor.tolist)()


#: The id of the autograd graph task running in this thread (a backward pass), or -1.
current_graph_task_id: Final = torch._C._current_graph_task_id

_queue_callback: Final = cast(
    Callable[[Callable[[], None]], None],
    torch.autograd.Variable._execution_engine.queue_callback,
)


def queue_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward pass running in this thread ends."""
    _queue_callback(callback)


def resume_in_enclosing_backward(callback: Callable[[], None]) -> RemovableHandle | None:
    """From a callback ``queue_callback`` queued: go on in the backward this one is nested in.

    A backward run inside a node of another backward (a reentrant checkpoint's recompute,
    an ``autograd.Function`` whose backward calls ``backward``) ends before the node
    returns; the backward around it goes on. If the one ending is such a nested backward,
    ``callback`` runs once that node has run, in the enclosing backward (where it can queue
    a callback of its own), and the handle to remove its hook is returned. At the end of
    the outermost backward, None: nothing is registered.
    """
    # At a nested backward's end its own nodes have all run: the node being evaluated
    # is then the enclosing backward's, the one that started it (None outside any).
    node = cast("torch.autograd.graph.Node | None", torch._C._current_autograd_node())
    if node is None:
        return None

    def after_node(grad_inputs: object, grad_outputs: object) -> None:
        callback()

    return node.register_hook(after_node)


def register_accumulator_hook(
    parameter: Tensor, hook: Callable[..., None]
) -> tuple[object, RemovableHandle]:
    """Call ``hook`` once ``parameter``'s gradient accumulator ran, as DDP's reducer hooks it.

    A post-hook of the accumulator node: it runs after the gradient was accumulated and
    after every post-accumulate-grad hook of the tensor, whenever they were registered.
    Returns the node, which the caller keeps (a hook on a node nobody holds is lost with
    it), and the hook's handle.
    """
    with torch.enable_grad():
        grad_fn = cast(Any, parameter.view_as(parameter).grad_fn)
    node = grad_fn.next_functions[0][0]
    return node, cast(RemovableHandle, node.register_hook(hook))


def register_post_accumulate_grad_hook(
    parameter: Tensor, hook: Callable[[Tensor], None]
) -> RemovableHandle:
    """Call ``hook(parameter)`` after each backward has accumulated into ``parameter.grad``."""
    register = cast(
        Callable[[Callable[[Tensor], None]], RemovableHandle],
        parameter.register_post_accumulate_grad_hook,
    )
    return register(hook)


def post_accumulate_grad_hooks(parameter: Tensor) -> list[Callable[[Tensor], None]]:
    """The hooks ``register_post_accumulate_grad_hook`` gave ``parameter``, in order."""
    hooks = cast(
        "Mapping[int, Callable[[Tensor], None]] | None",
        getattr(parameter, "_post_accumulate_grad_hooks", None),
    )
    return list(hooks.values()) if hooks else []


_all_gather_single: Final = _compat.all_gather_single
_reduce_scatter_single: Final = _compat.reduce_scatter_single


def all_gather_into(output: Tensor, input: Tensor, group: dist.ProcessGroup) -> None:
    """Concatenate every rank's ``input`` (same size on all) into ``output``, by rank; wait."""
    _run(_all_gather_single, group, (output, input))


def all_gather_into_async(output: Tensor, input: Tensor, group: dist.ProcessGroup) -> Collective:
    """Start ``all_gather_into``; the handle's ``wait()`` completes it (gloo: on its own thread)."""
    return _start(_all_gather_single, group, (output, input))


#: The backends whose collectives take ``ReduceOp.AVG`` on every supported release (the
#: accelerators' collective libraries, and PyTorch's fake group, which moves nothing).
_AVERAGING_BACKENDS: Final = frozenset({"nccl", "xccl", "hccl", "fake"})


def averages_in_collectives(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group`` takes ``ReduceOp.AVG`` for tensors on ``device``, as FSDP2 passes it.

    NCCL averages inside the collective (its float average scales each input by
    ``1 / size``): one kernel fewer than a sum and a division, and FSDP2's rounding.
    Gloo from torch 2.13 averages too (a sum, then a division); before, it sums where
    asked to average in a reduce-scatter and refuses in an all-reduce. The backend is
    the one serving ``device`` (a group of ``"cpu:gloo,cuda:nccl"`` is both); any other,
    or one a group does not name (a group written in Python, MPI), sums, and the sum
    is divided after.
    """
    name = serving_backend(group, device).name
    if "gloo" in name:
        return _compat.GLOO_AVERAGES
    return name in _AVERAGING_BACKENDS


def reduce_scatter_average(output: Tensor, input: Tensor, group: dist.ProcessGroup) -> None:
    """Average ``input`` over ``group`` and keep this rank's slice in ``output``; wait.

    ``input`` holds ``group.size()`` equal slices, one per rank, in rank order.
    ``ReduceOp.AVG`` where the group takes it (``averages_in_collectives``), else a
    sum and a division.
    """
    if averages_in_collectives(group, input.device):
        _run(_reduce_scatter_single, group, (output, input), op=dist.ReduceOp.AVG)
        return
    _run(_reduce_scatter_single, group, (output, input), op=dist.ReduceOp.SUM)
    output.div_(group.size())


def all_reduce_average(tensor: Tensor, group: dist.ProcessGroup) -> None:
    """Average ``tensor`` over ``group`` in place; wait. As ``reduce_scatter_average``."""
    if averages_in_collectives(group, tensor.device):
        _run(_all_reduce, group, (tensor,), op=dist.ReduceOp.AVG)
        return
    _run(_all_reduce, group, (tensor,))
    tensor.div_(group.size())


def reduce_scatter_sum(output: Tensor, input: Tensor, group: dist.ProcessGroup) -> None:
    """Sum ``input`` over ``group`` and keep this rank's slice in ``output``; wait."""
    _run(_reduce_scatter_single, group, (output, input), op=dist.ReduceOp.SUM)


def register_tensor_hook(
    tensor: Tensor, hook: Callable[[Tensor], Tensor | None]
) -> RemovableHandle:
    """Call ``hook(grad)`` when the gradient of ``tensor`` is computed; it may replace it."""
    register = cast(
        Callable[[Callable[[Tensor], Tensor | None]], RemovableHandle], tensor.register_hook
    )
    return register(hook)


_RegisterHook = Callable[[Callable[..., None]], RemovableHandle]


def register_state_dict_pre_hook(module: nn.Module, hook: Callable[..., None]) -> RemovableHandle:
    """Call ``hook(module, prefix, keep_vars)`` before ``module.state_dict()`` reads it."""
    register = cast(_RegisterHook, module.register_state_dict_pre_hook)
    return register(hook)


def register_load_state_dict_pre_hook(
    module: nn.Module, hook: Callable[..., None]
) -> RemovableHandle:
    """Call ``hook(module, state_dict, prefix, ...)`` before ``load_state_dict`` writes it."""
    register = cast(_RegisterHook, module.register_load_state_dict_pre_hook)
    return register(hook)


def register_load_state_dict_post_hook(
    module: nn.Module, hook: Callable[..., None]
) -> RemovableHandle:
    """Call ``hook(module, incompatible_keys)`` after ``load_state_dict`` wrote ``module``."""
    register = cast(_RegisterHook, module.register_load_state_dict_post_hook)
    return register(hook)


_device_index: Final = cast(Callable[[object, bool], int], torch._utils._get_device_index)


def device_index(device: object) -> int:
    """The index of ``device`` (an int, a string or a ``torch.device``), as DDP reads it.

    ``torch._utils._get_device_index(device, True)``: a CUDA device without an index
    is the current one; raises ``ValueError`` for what is not a device.
    """
    return _device_index(device, True)


_to_kwargs: Final = cast(
    Callable[
        [tuple[Any, ...], dict[str, Any] | None, torch.device, bool],
        tuple[tuple[tuple[Any, ...], ...], tuple[dict[str, Any], ...]],
    ],
    torch.distributed.utils._to_kwargs,
)


def inputs_to(
    args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device, side_stream: bool
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with every tensor in them copied to ``device``, as DDP's forward.

    DDP's own ``_to_kwargs``; ``side_stream`` copies on a side stream of the device.
    """
    moved_args, moved_kwargs = _to_kwargs(args, kwargs, device, side_stream)
    return (moved_args[0] if moved_args else ()), (moved_kwargs[0] if moved_kwargs else {})


def chunk_cat(tensors: Sequence[Tensor], chunks: int, out: Tensor) -> None:
    """Each tensor padded on dim 0 to ``chunks`` equal chunks, chunk ``i`` of all in row ``i``.

    ``out`` is ``(chunks, padded numel / chunks)``, of any dtype (the copy casts):
    ``torch._chunk_cat``, the copy-in of FSDP2's reduce-scatter.
    """
    _chunk_cat(list(tensors), 0, chunks, out=out)


_chunk_cat: Final = cast(Callable[..., Tensor], vars(torch)["_chunk_cat"])


_new_dtensor: Final = cast(Callable[..., DTensor], DTensor)


def dtensor_like(local: Tensor, like: DTensor) -> DTensor:
    """``local`` as a ``DTensor`` of ``like``'s spec, made directly: no op, no autograd.

    FSDP2's ``_from_local_no_grad``; ``local`` must have ``like``'s local shape and dtype.
    """
    return _new_dtensor(local, like._spec, requires_grad=False)
