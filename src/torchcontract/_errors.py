"""The exception hierarchy.

Every error names the API, the module (class and FQN where known, never the
whole repr) and what to do instead.
"""

from __future__ import annotations

__all__ = [
    "AllGatherExtensionError",
    "AlreadyAppliedError",
    "AlreadyManagedError",
    "ArgumentBindingError",
    "ContractError",
    "CyclicModuleTreeError",
    "FQNChangedError",
    "GraphChangedError",
    "IncompatibleAPIError",
    "InvalidMeshError",
    "InvalidRecordError",
    "InvalidResultError",
    "InvalidShardDimError",
    "InvalidStateClassError",
    "InvalidTargetError",
    "LateGradientError",
    "NoProcessGroupError",
    "NotAppliedError",
    "ReplacedParameterError",
    "RulePredicateError",
    "ScalarParameterError",
    "UnfinishedBackwardError",
    "UnknownRuleScopeError",
    "UnknownTorchAPIError",
    "UnmaterializedParameterError",
    "UnnamedMeshError",
]


class ContractError(RuntimeError):
    """Base class of the errors raised at run time: an API breaking its contract, a rule refusing.

    Raised itself where no subclass fits. Not the base of the errors of bad input,
    which are ``TypeError``s or ``ValueError``s instead: ``UnknownTorchAPIError``,
    ``InvalidStateClassError``, ``InvalidRecordError``, ``InvalidTargetError``,
    ``InvalidResultError`` and ``InvalidShardDimError``.
    """


class AlreadyAppliedError(ContractError):
    """The API has already been applied to this module."""


class NotAppliedError(ContractError, LookupError):
    """State was asked of a module the API has not been applied to."""


class CyclicModuleTreeError(ContractError):
    """The module tree contains a module inside itself: a cycle of child references."""


class FQNChangedError(ContractError):
    """The API function changed a parameter, buffer or module FQN, or their order."""


class AlreadyManagedError(ContractError, ValueError):
    """A parameter is already sharded: another application manages it, or it is a DTensor.

    A ``ValueError`` too, as FSDP2 raises for a parameter two of its groups manage.
    """


class InvalidMeshError(ContractError, ValueError):
    """The device mesh given to an API does not have the shape the API needs."""


class UnnamedMeshError(InvalidMeshError, AssertionError):
    """A 2-D (HSDP) mesh has no dim names; an ``AssertionError`` too, as FSDP2 raises."""


class NoProcessGroupError(ContractError, ValueError):
    """An API that communicates was given no group or mesh, and no default process group is up.

    A ``ValueError`` too, as ``DistributedDataParallel`` raises.
    """


class ScalarParameterError(ContractError, ValueError):
    """A parameter to shard is a scalar (0-d): it has no dim to shard on (FSDP2's ValueError)."""


class InvalidShardDimError(ValueError, AssertionError):
    """``shard_placement_fn`` returned a dim the parameter does not have.

    An ``AssertionError`` too, as FSDP2 raises.
    """


class ReplacedParameterError(ContractError, AttributeError):
    """A parameter registered in place of a sharded one cannot be taken as its shard.

    Raised at the first forward, where FSDP2 re-reads the parameters: the new one
    is not a ``DTensor`` (FSDP2 fails with ``AttributeError``) or not laid out as the
    shard it replaces (a ``RuntimeError``, as this class is).
    """


class AllGatherExtensionError(ContractError, AssertionError):
    """A shard's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` break FSDP2's protocol.

    One of the two defined without the other, a hook of another signature, inputs
    not padded as the shard is: an ``AssertionError`` too, as FSDP2 raises.
    """


class IncompatibleAPIError(ContractError):
    """The API cannot be combined with one already applied on this module or around it."""


class InvalidStateClassError(TypeError):
    """The state class given to ``contract`` is not a frozen attrs class with defaults."""


class InvalidRecordError(TypeError):
    """A record is not an instance of the API's state class, or it holds a module."""


class InvalidTargetError(TypeError, ValueError):
    """The first argument of an API call is not a module or a non-empty list of distinct modules."""


class InvalidResultError(TypeError):
    """The API function returned something other than a module, a sequence of them, or None."""


class ArgumentBindingError(ContractError, TypeError):
    """A call's arguments do not bind to the API function's parameters (a misspelt keyword).

    Raised when the arguments are bound: by ``RegistryEntry.arguments``, which a rule's
    ``when=`` predicate reads before the API function runs.
    """


class RulePredicateError(ContractError):
    """A rule's ``when=`` predicate raised, e.g. reading an argument the API does not have."""


class UnmaterializedParameterError(ContractError):
    """A module ran forward with parameters still on the meta device (never materialized)."""


class UnusedParameterError(ContractError):
    """A synchronizing backward gave no gradient to a parameter that had to take part.

    Raised by ``replicate`` with ``find_unused_parameters=False`` (DDP's default), or
    with ``static_graph=True`` for a parameter the first synchronizing backward gave one,
    at the next forward with grad enabled, where ``DistributedDataParallel`` raises its
    ``RuntimeError``; the message starts with DDP's.
    """


class GraphChangedError(ContractError):
    """A static graph changed: a backward gave a parameter more gradients than the first one.

    Any gradient, where the first gave none; also more than once, where the first gave
    one (a reentrant checkpoint's nested backwards count).

    Raised by ``replicate`` with ``static_graph=True`` in that backward, where
    ``DistributedDataParallel`` raises its ``RuntimeError``; the message starts with
    DDP's.
    """


class LateGradientError(ContractError):
    """A gradient came after its bucket went out: accumulated twice in one backward.

    Raised by ``replicate`` without ``static_graph`` in that backward (a reentrant
    checkpoint that runs a parameter again, after its direct use), where
    ``DistributedDataParallel`` raises its ``RuntimeError``; the message starts with
    DDP's. The average sent would lack it.
    """


class UnfinishedBackwardError(ContractError):
    """The last synchronizing backward raised midway, after gradients had begun to arrive.

    Its buckets may have gone out on some ranks and not on others, so this rank's
    collectives may no longer pair with theirs. Raised by ``replicate`` at every
    later forward with grad enabled (and by a backward started again without one),
    where ``DistributedDataParallel`` raises its ``RuntimeError``; the message
    starts with DDP's. A backward that raised before any gradient arrived, or a
    static graph's first (which sends nothing before its end), leaves no trace.
    """


class UnknownTorchAPIError(ValueError):
    """A rule names a torch composable API by a name torch does not register."""


class UnknownRuleScopeError(ValueError):
    """A rule's ``scope`` is not one of ``RuleScope``'s: ``"module"`` or ``"tree"``."""
