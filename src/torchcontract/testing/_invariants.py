"""check_api_invariants(): apply an API to a model and check it behaves as a contract API should."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any, Concatenate, Generic, overload

import attrs
import torch
from torch import Tensor, nn
from typing_extensions import ParamSpec, TypeVar

from torchcontract import Contract, registry, take_snapshot

from ._compare import (
    forward_backward,
    gc_disabled,
    gradient_difference,
    max_difference,
    sum_of_outputs,
)
from ._torch import fork_rng, manual_seed

__all__ = ["InvariantReport", "ModelCase", "check_api_invariants"]

_P = ParamSpec("_P")


def _identity(model: nn.Module) -> nn.Module:
    return model


_M = TypeVar("_M", bound=nn.Module)
# The target is only handed out: a case whose target is an nn.Linear is a case whose
# target is an nn.Module. The model type is invariant: ``target`` takes it.
_T_co = TypeVar("_T_co", bound=nn.Module, covariant=True, default=_M)
_T = TypeVar("_T", bound=nn.Module)
_S = TypeVar("_S")


@attrs.frozen(init=False)
class ModelCase(Generic[_M, _T_co]):
    """A model to check an API on, and how to run it.

    Generic in the model type ``M`` and the target type ``T`` (default ``M``), so an
    API whose first parameter is an ``nn.Module`` subclass is checked without a cast:
    ``ModelCase(make_linear, make_inputs)`` is a ``ModelCase[nn.Linear]``.

    ``make_model`` builds it (called twice, under the same seed, so it must be
    deterministic given torch's RNG); ``make_inputs`` gives the positional inputs
    of one forward; ``loss`` reduces the output to a scalar (by default, or given
    None, the sum of its float tensors). ``target`` picks the module the API is applied to (default
    the model; with mypy, pass a function rather than a lambda: mypy infers a
    lambda's result before it knows the model type). ``same_numerics`` says the API
    must not change outputs or gradients (within ``tolerance``), nor which parameters
    get one; with False the differences are only reported; ``check_freed`` that
    the applied model is freed by reference counting alone once dropped (no cycle).

    Attributes:
        make_model: Builds the model from torch's RNG only (called twice, under the
            same seed).
        make_inputs: The positional inputs of one forward.
        loss: Reduces the output to a scalar; by default the sum of its float tensors.
        target: Picks the module the API is applied to; by default the model.
        same_numerics: Whether outputs, gradients and which parameters get one must
            stay as they were (True), or are only reported (False).
        tolerance: The largest difference ``same_numerics`` allows.
        check_freed: Whether the applied model must be freed by reference counting
            alone once dropped.
        seed: The seed of torch's RNG for building the model and running it.
    """

    make_model: Callable[[], _M]
    make_inputs: Callable[[], tuple[Any, ...]]
    loss: Callable[[Any], Tensor]
    target: Callable[[_M], _T_co]
    same_numerics: bool
    tolerance: float
    check_freed: bool
    seed: int

    # Overloads rather than attrs' __init__: without ``target`` the target type is the
    # model type, which no default value of ``target`` could say.
    @overload
    def __init__(
        self: ModelCase[_T, _T],
        make_model: Callable[[], _T],
        make_inputs: Callable[[], tuple[Any, ...]],
        loss: Callable[[Any], Tensor] | None = ...,
        *,
        same_numerics: bool = ...,
        tolerance: float = ...,
        check_freed: bool = ...,
        seed: int = ...,
    ) -> None: ...
    @overload
    def __init__(
        self,
        make_model: Callable[[], _M],
        make_inputs: Callable[[], tuple[Any, ...]],
        loss: Callable[[Any], Tensor] | None = ...,
        *,
        target: Callable[[_M], _T_co],
        same_numerics: bool = ...,
        tolerance: float = ...,
        check_freed: bool = ...,
        seed: int = ...,
    ) -> None: ...
    def __init__(
        self,
        make_model: Callable[[], nn.Module],
        make_inputs: Callable[[], tuple[Any, ...]],
        loss: Callable[[Any], Tensor] | None = None,
        *,
        target: Callable[[Any], nn.Module] | None = None,
        same_numerics: bool = True,
        tolerance: float = 1e-6,
        check_freed: bool = True,
        seed: int = 0,
    ) -> None:
        fields = {
            "make_model": make_model,
            "make_inputs": make_inputs,
            "loss": sum_of_outputs if loss is None else loss,
            "target": _identity if target is None else target,
            "same_numerics": same_numerics,
            "tolerance": tolerance,
            "check_freed": check_freed,
            "seed": seed,
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)  # frozen: set once, as attrs would


@attrs.frozen
class InvariantReport:
    """What ``check_api_invariants`` compared, and the largest differences it saw.

    ``parameters`` counts the gradients of the applied model; ``gradient_difference``
    is the largest over the parameters with a gradient in both runs;
    ``unmatched_gradients`` are the FQNs of the parameters with a gradient in one run
    only (an API that freezes parameters, checked with ``same_numerics=False``).

    Attributes:
        parameters: How many parameters of the applied model got a gradient.
        output_difference: The largest absolute difference of the outputs.
        gradient_difference: The largest absolute difference of the gradients both runs
            have.
        unmatched_gradients: The FQNs, sorted, of the parameters with a gradient in one
            run only.
    """

    parameters: int
    output_difference: float
    gradient_difference: float
    unmatched_gradients: tuple[str, ...] = ()


def check_api_invariants(
    api: Contract[Concatenate[_T, _P], object, _S],
    case: ModelCase[_M, _T],
    /,
    *args: _P.args,
    **kwargs: _P.kwargs,
) -> InvariantReport:
    """Apply ``api(target, *args, **kwargs)`` to a model of ``case`` and check it behaves.

    ``api``'s first parameter takes ``case``'s target type: an API on ``nn.Linear``
    takes a ``ModelCase`` whose target is an ``nn.Linear``.

    Checked, against a second, unapplied copy of the model: parameter, buffer,
    module and ``state_dict`` FQNs of the whole model are unchanged and in the
    same order; the API is in ``registry(target)`` with the given arguments; its
    record is an instance of its state class, is what its store holds, and
    holds no module; one forward and backward run, and (``same_numerics``) give
    the same outputs and gradients; the model is freed once dropped
    (``check_freed``).

    Args:
        api: The API to check.
        case: The model, its inputs and what to require.
        *args: Positional arguments of the API, after the target.
        **kwargs: Keyword arguments of the API, checked against its signature by type
            checkers.

    Returns:
        What was compared, with the largest differences seen.

    Raises:
        AssertionError: An invariant is broken; the message names the first one.
    """
    with fork_rng(devices=[]):
        manual_seed(case.seed)
        model = case.make_model()
        manual_seed(case.seed)
        reference: nn.Module = case.make_model()
    _check_same_parameters(model, reference)
    target = case.target(model)
    before = take_snapshot(model)
    keys_before = list(model.state_dict().keys())

    api(target, *args, **kwargs)

    after = take_snapshot(model)
    for kind in ("parameters", "buffers", "module_fqns"):
        if getattr(before, kind) != getattr(after, kind):
            raise AssertionError(f"check_api_invariants: {api.name} changed the model's {kind}")
    if list(model.state_dict().keys()) != keys_before:
        raise AssertionError(f"check_api_invariants: {api.name} changed the state_dict keys")
    _check_registry_and_record(api, target, args, kwargs)
    outputs, gradients = forward_backward(model, case.make_inputs, case.loss, case.seed)
    reference_outputs, reference_gradients = forward_backward(
        reference, case.make_inputs, case.loss, case.seed
    )
    output_difference = max_difference(outputs, reference_outputs)
    worst_gradient, unmatched = gradient_difference(gradients, reference_gradients)
    if case.same_numerics and unmatched:
        raise AssertionError(
            f"check_api_invariants: after {api.name}, gradients differ in which parameters "
            f"have one: {list(unmatched)}"
        )
    if case.same_numerics and output_difference > case.tolerance:
        raise AssertionError(
            f"check_api_invariants: {api.name} changed the forward output by "
            f"{output_difference:.3g} (tolerance {case.tolerance:g})"
        )
    if case.same_numerics and worst_gradient > case.tolerance:
        raise AssertionError(
            f"check_api_invariants: {api.name} changed the gradients by "
            f"{worst_gradient:.3g} (tolerance {case.tolerance:g})"
        )
    report = InvariantReport(len(gradients), output_difference, worst_gradient, unmatched)
    if case.check_freed:
        alive = weakref.ref(model)
        with gc_disabled():
            # Reference counting alone must free the model: no cycle may hold it.
            del model, target, outputs, gradients, after, before
            if alive() is not None:
                raise AssertionError(
                    f"check_api_invariants: the model outlives its last reference after "
                    f"{api.name}; a reference cycle (e.g. a hook closure holding its module) "
                    "keeps it alive"
                )
    return report


def _check_same_parameters(model: nn.Module, reference: nn.Module) -> None:
    for (name, mine), (_, theirs) in zip(
        model.state_dict().items(), reference.state_dict().items(), strict=True
    ):
        if not torch.equal(mine, theirs):
            raise AssertionError(
                f"check_api_invariants: make_model built different values for {name!r} under "
                "the same seed; build the model from torch's RNG only"
            )


def _check_registry_and_record(
    api: Contract[..., Any, Any],
    target: nn.Module,
    args: tuple[object, ...],
    kwargs: Mapping[str, object],
) -> None:
    entry = registry(target).get(api)
    if entry is None:
        raise AssertionError(f"check_api_invariants: {api.name} is not in the target's registry")
    if entry.args != args or dict(entry.kwargs) != dict(kwargs):
        raise AssertionError(
            f"check_api_invariants: the registry entry of {api.name} recorded other arguments"
        )
    record: object = api.state(target)
    if not isinstance(record, api.state_cls):
        raise AssertionError(
            f"check_api_invariants: {api.name}'s record is of class "
            f"{type(record).__qualname__}, not of its state class {api.state_cls.__qualname__}"
        )
    if api.store.records(target).get(api) is not record:
        raise AssertionError(
            f"check_api_invariants: {api.name}'s store does not hold the record state() returns"
        )
    for name in attrs.fields_dict(api.state_cls):
        if isinstance(getattr(record, name), nn.Module):
            raise AssertionError(
                f"check_api_invariants: {api.name}'s record holds a module in {name!r}"
            )
