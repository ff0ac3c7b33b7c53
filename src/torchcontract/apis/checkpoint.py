"""checkpoint(): activation checkpointing of a module through forward hooks.

The module's forward and FQNs stay as they are: a forward pre-hook opens a
checkpointed region and a forward hook closes it. Activations inside the region
are not kept for backward; backward recomputes them.

* ``use_reentrant=False`` (default) runs torch's own non-reentrant machinery,
  ``torch.utils.checkpoint._checkpoint_without_reentrant_generator``, exactly as
  ``torch.distributed._composable.checkpoint`` does.
* ``use_reentrant=True`` runs the forward under ``no_grad`` and wraps its outputs
  in an autograd function whose backward recomputes the forward with grad
  enabled and runs a nested (reentrant) ``torch.autograd.backward``, as
  ``torch.utils.checkpoint.CheckpointFunction`` does. That class cannot be used
  as is, because it runs the forward itself and a hook cannot replace the
  module's forward call; this module reuses its helpers instead.

The per-forward state (the open region, or the generator torch's machinery
yields in) cannot live in a frozen record: it lives in ``_Regions``, one object
per applied module held only by that module's hooks (``_Hooks``), thread-local
so that forwards and recomputations in different threads do not mix.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final, cast

import attrs
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree
from torch.utils import checkpoint as torch_checkpoint

from torchcontract import Application, InvalidTargetError, contract, module_label

from . import _torch

__all__ = ["CheckpointState", "checkpoint"]


@attrs.frozen
class CheckpointState:
    """The record of ``checkpoint`` on a module.

    ``use_reentrant`` and ``preserve_rng_state`` are the arguments of the apply
    and fixed by it (the ``replicate`` compatibility rule reads ``use_reentrant``
    from the registry). ``enabled`` switches checkpointing of later forwards off
    and on again: ``checkpoint.update(m, lambda s: attrs.evolve(s, enabled=False))``.

    Attributes:
        use_reentrant: Whether the backward recomputes in a nested backward.
        preserve_rng_state: Whether the recomputation replays the forward's random
            numbers.
        enabled: Whether later forwards are checkpointed.
    """

    use_reentrant: bool = False
    preserve_rng_state: bool = True
    enabled: bool = True


class _Regions(threading.local):
    """One module's checkpointed forwards in flight, per thread.

    ``open`` is a stack (a module may call itself); each item is the region of one
    forward call, or None where that call is not checkpointed. ``recomputing``
    counts the recomputations of this module running in this thread: its hooks
    stand aside during them.
    """

    def __init__(self) -> None:
        self.open: list[_Region | None] = []
        self.recomputing = 0


class _Recomputing:
    """Context manager: the module's hooks stand aside while its forward is recomputed."""

    __slots__ = ("_regions",)

    def __init__(self, regions: _Regions) -> None:
        self._regions = regions

    def __enter__(self) -> None:
        self._regions.recomputing += 1

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._regions.recomputing -= 1


class _Region:
    """A checkpointed forward call, from the pre-hook to the forward hook."""

    finished = False

    def finish(self, output: object) -> object:
        """Close the region after a successful forward; return the output to use, or None."""
        raise NotImplementedError

    def abandon(self) -> None:
        """Close the region after a failed forward."""


class _NonReentrantRegion(_Region):
    """A region run by torch's non-reentrant checkpoint generator."""

    def __init__(
        self, module: nn.Module, regions: _Regions, preserve_rng_state: bool, args: Any, kwargs: Any
    ) -> None:
        def context_fns() -> tuple[contextlib.nullcontext[None], _Recomputing]:
            return contextlib.nullcontext(), _Recomputing(regions)

        self._generator = _torch.checkpoint_generator(
            module,
            preserve_rng_state,
            context_fns,
            torch_checkpoint._DEFAULT_DETERMINISM_MODE,
            *args,
            **kwargs,
        )
        next(self._generator)

    def finish(self, output: object) -> object:
        self.finished = True
        try:
            next(self._generator)
        except StopIteration:
            return None
        raise RuntimeError("checkpoint: torch's checkpoint generator did not finish; report a bug")

    def abandon(self) -> None:
        self._generator.close()


class _ReentrantRegion(_Region):
    """A region run under ``no_grad`` whose outputs recompute it in a nested backward."""

    def __init__(
        self, module: nn.Module, regions: _Regions, preserve_rng_state: bool, args: Any, kwargs: Any
    ) -> None:
        self.module: nn.Module | None = module
        self.regions = regions
        leaves, self.spec = pytree.tree_flatten((args, kwargs))
        self.leaves: list[object] = list(leaves)
        self.tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        tensors = [self.leaves[i] for i in self.tensor_positions]
        self.device_type = _torch.infer_device_type(*tensors)
        self.autocast = [_Autocast.capture("cpu")]
        if self.device_type != "cpu" and torch.amp.is_autocast_available(self.device_type):
            self.autocast.append(_Autocast.capture(self.device_type))
        self.preserve_rng_state = preserve_rng_state
        self.cpu_rng_state: Tensor | None = None
        self.devices: list[int] = []
        self.device_rng_states: list[Tensor] = []
        if preserve_rng_state:
            self.cpu_rng_state = torch.get_rng_state()
            # Like torch, never initialize an accelerator runtime just to read its RNG.
            if _torch.device_module_initialized(self.device_type):
                self.devices, self.device_rng_states = _torch.get_device_states(*tensors)
        self.outputs: list[Tensor] = []
        torch._C._set_grad_enabled(False)

    def finish(self, output: object) -> object:
        self.finished = True
        torch._C._set_grad_enabled(True)
        leaves, spec = pytree.tree_flatten(output)
        positions = [
            i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor) and _differentiable(leaf)
        ]
        if not positions:
            return None
        self.outputs = [leaves[i] for i in positions]
        inputs = [self.leaves[i] for i in self.tensor_positions]
        wrapped = _recompute_apply(self, *inputs)
        self.outputs = []
        for position, tensor in zip(positions, wrapped, strict=True):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, spec)

    def abandon(self) -> None:
        torch._C._set_grad_enabled(True)
        self.module = None

    def recompute(self, inputs: tuple[Tensor, ...]) -> list[Tensor]:
        """Run the module's forward again on ``inputs`` with grad, as the first forward ran."""
        module, self.module = self.module, None
        if module is None:
            raise RuntimeError(
                "checkpoint(use_reentrant=True): this forward was already recomputed; "
                "to backward through it twice, apply checkpoint with use_reentrant=False"
            )
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_positions, inputs, strict=True):
            leaves[position] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        with contextlib.ExitStack() as stack:
            stack.enter_context(
                _torch.fork_rng(
                    devices=self.devices,
                    enabled=self.preserve_rng_state,
                    device_type=self.device_type,
                )
            )
            if self.cpu_rng_state is not None:
                torch.set_rng_state(self.cpu_rng_state)
                if self.devices:
                    _torch.set_device_states(
                        self.devices, self.device_rng_states, device_type=self.device_type
                    )
            for autocast in self.autocast:
                stack.enter_context(autocast.context())
            stack.enter_context(torch.enable_grad())
            stack.enter_context(_Recomputing(self.regions))
            output = module(*args, **kwargs)
        leaves_out, _ = pytree.tree_flatten(output)
        return [leaf for leaf in leaves_out if isinstance(leaf, Tensor) and _differentiable(leaf)]


@attrs.frozen
class _Autocast:
    """The autocast settings of one device type at forward time, to recompute under."""

    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool

    @classmethod
    def capture(cls, device_type: str) -> _Autocast:
        return cls(
            device_type,
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled(),
        )

    def context(self) -> torch.autocast:
        return torch.autocast(
            self.device_type,
            dtype=self.dtype,
            enabled=self.enabled,
            cache_enabled=self.cache_enabled,
        )


def _differentiable(tensor: Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


class _Recompute(torch.autograd.Function):
    """Outputs of a reentrant region; backward recomputes the region and backpropagates it."""

    @staticmethod
    def forward(ctx: Any, region: _ReentrantRegion, *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.region = region
        ctx.save_for_backward(*inputs)
        return tuple(output.detach() for output in region.outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        if not _torch.checkpoint_is_valid():
            raise RuntimeError(
                "checkpoint(use_reentrant=True) does not support torch.autograd.grad() or "
                "backward(inputs=...); apply checkpoint with use_reentrant=False instead"
            )
        region: _ReentrantRegion = ctx.region
        saved: tuple[Tensor, ...] = ctx.saved_tensors
        inputs = tuple(tensor.detach().requires_grad_(tensor.requires_grad) for tensor in saved)
        outputs = region.recompute(inputs)
        pairs = [
            (output, grad)
            for output, grad in zip(outputs, grads, strict=True)
            if output.requires_grad
        ]
        if pairs:
            torch.autograd.backward([output for output, _ in pairs], [grad for _, grad in pairs])
        return (None, *(tensor.grad if tensor.requires_grad else None for tensor in inputs))


_recompute_apply: Final = cast(Callable[..., tuple[Tensor, ...]], _Recompute.apply)


class _Hooks:
    """The hooks checkpoint installs on a module: open, finish and clean up a region.

    They hold the module's ``_Regions``, the apply's options and its ``Application``
    handle, never the module (it comes in as the hook argument), so no reference
    cycle keeps it alive. Copies and pickles of the module get hooks with fresh,
    empty regions and a detached handle: they stay inert, even once checkpoint is
    applied to the copy (which then has hooks of its own).
    """

    __slots__ = ("application", "preserve_rng_state", "regions", "use_reentrant")

    def __init__(
        self,
        application: Application[CheckpointState],
        use_reentrant: bool,
        preserve_rng_state: bool,
    ) -> None:
        self.application = application
        self.use_reentrant = use_reentrant
        self.preserve_rng_state = preserve_rng_state
        self.regions = _Regions()

    def __reduce__(
        self,
    ) -> tuple[type[_Hooks], tuple[Application[CheckpointState], bool, bool]]:
        return _Hooks, (self.application, self.use_reentrant, self.preserve_rng_state)

    def open(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook: start a region for this call (or a None item when unchecked)."""
        regions = self.regions
        if regions.recomputing:
            return
        # The slot is taken first so that the cleanup hook pops this call's item even
        # when opening the region raises.
        regions.open.append(None)
        record = self.application.record(module)
        if record is None or not record.enabled or not torch.is_grad_enabled():
            return
        if not self.use_reentrant:
            regions.open[-1] = _NonReentrantRegion(
                module, regions, self.preserve_rng_state, args, kwargs
            )
        elif _any_requires_grad((args, kwargs)):
            regions.open[-1] = _ReentrantRegion(
                module, regions, self.preserve_rng_state, args, kwargs
            )
        else:
            warnings.warn(
                f"checkpoint(use_reentrant=True) on {type(module).__qualname__}: no input "
                "requires grad, so this forward is not checkpointed (a reentrant region "
                "would give its parameters no gradient); use use_reentrant=False",
                UserWarning,
                stacklevel=2,
            )

    def finish(self, module: nn.Module, args: tuple[Any, ...], output: object) -> object:
        """Forward hook, first of all: close this call's region; maybe replace the output."""
        regions = self.regions
        if regions.recomputing or not regions.open:
            return None
        region = regions.open[-1]
        return None if region is None else region.finish(output)

    def close(self, module: nn.Module, args: tuple[Any, ...], output: object) -> None:
        """Forward hook, always called, after a failed forward too: the only one that pops."""
        regions = self.regions
        if regions.recomputing or not regions.open:
            return
        region = regions.open.pop()
        if region is not None and not region.finished:
            region.abandon()


def require_one_module(api_name: str, target: object) -> None:
    """Raise ``InvalidTargetError`` unless ``target`` is a single module (not a list of them)."""
    if not isinstance(target, nn.Module):
        raise InvalidTargetError(
            f"{api_name} applies to one nn.Module at a time, got {type(target).__qualname__}; "
            "call it once per module"
        )


def require_bool(api_name: str, module: nn.Module, name: str, value: object) -> None:
    """Raise ``TypeError`` naming the argument unless ``value`` is True or False."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{api_name} on {module_label(module)}: {name} takes True or False, "
            f"got {describe_value(value)}"
        )


def describe_value(value: object) -> str:
    """A short account of a wrong argument: its type, and its value when that is short."""
    text = repr(value)
    shown = f" {text}" if len(text) <= 40 and not isinstance(value, (nn.Module, Tensor)) else ""
    return f"{type(value).__qualname__}{shown}"


def _any_requires_grad(tree: object) -> bool:
    leaves, _ = pytree.tree_flatten(tree)
    return any(isinstance(leaf, Tensor) and leaf.requires_grad for leaf in leaves)


@contract(CheckpointState)
def checkpoint(
    module: nn.Module, *, use_reentrant: bool = False, preserve_rng_state: bool = True
) -> None:
    """Checkpoint ``module``'s activations: keep its inputs, recompute the rest in backward.

    Gradients are those of the unchecked module; with ``preserve_rng_state``
    (default) the recomputation replays the forward's random numbers, so dropout
    gives the same masks. The module's forward, class and FQNs are unchanged.

    ``use_reentrant=True`` recomputes in a nested backward, which cannot be
    combined with ``replicate`` (its rule says so) and needs an input that
    requires grad: a forward without one is run unchecked, with a warning, so
    its parameters still get gradients.

    Args:
        module: The module whose activations are recomputed (one module).
        use_reentrant: Recompute in a nested backward, as
            ``torch.utils.checkpoint(..., use_reentrant=True)``.
        preserve_rng_state: Replay the forward's random numbers in the recomputation.

    Returns:
        ``module`` itself (the contract returns what it was given), typed as given.

    Raises:
        InvalidTargetError: A list of modules was given; apply it to each.
        TypeError: An option is not True or False (the string ``"False"`` included).
    """
    require_one_module("checkpoint", module)
    require_bool("checkpoint", module, "use_reentrant", use_reentrant)
    require_bool("checkpoint", module, "preserve_rng_state", preserve_rng_state)
    checkpoint.update(
        module,
        lambda record: attrs.evolve(
            record, use_reentrant=use_reentrant, preserve_rng_state=preserve_rng_state
        ),
    )
    hooks = _Hooks(checkpoint.application(module), use_reentrant, preserve_rng_state)
    module.register_forward_pre_hook(hooks.open, prepend=True, with_kwargs=True)
    module.register_forward_hook(hooks.finish, prepend=True)
    module.register_forward_hook(hooks.close, always_call=True)
