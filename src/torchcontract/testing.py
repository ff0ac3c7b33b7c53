"""Helpers for testing APIs built on the contract: process groups and invariant checks.

``run_distributed`` runs a function on N local ranks of a gloo process group;
``check_api_invariants`` checks that an API keeps a model's FQNs, state and
numerics as an API built on the contract should.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import math
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable, Generator, Mapping
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Concatenate, Final, Generic, Literal, overload

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils import _pytree as pytree
from typing_extensions import ParamSpec, TypeVar, TypeVarTuple

from torchcontract import Contract, registry, take_snapshot
from torchcontract.apis._torch import barrier, fork_rng, manual_seed

__all__ = [
    "InvariantReport",
    "ModelCase",
    "RankFailedError",
    "check_api_invariants",
    "free_port",
    "run_distributed",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_Ts = TypeVarTuple("_Ts")

StartMethod = Literal["forkserver", "spawn"]

#: Imported once by the fork server, so each rank starts in milliseconds, not seconds.
_PRELOAD: Final = ["torch", "torch.distributed", "torchcontract.apis"]
#: How long the other ranks may still report after one failed, before they are killed.
_GRACE_SECONDS: Final = 1.0


# --------------------------------------------------------------------- processes


class RankFailedError(RuntimeError):
    """A rank failed: it died, or raised; its message holds the rank's traceback text.

    Raised as is when the rank's own exception cannot be re-raised (it died, or its
    exception does not pickle); otherwise it is the ``__cause__`` of that exception.
    """


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0 and released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@overload
def run_distributed(
    fn: Callable[[int, int], _R],
    world_size: int = ...,
    *,
    timeout: float = ...,
    start_method: StartMethod | None = ...,
    threads_per_rank: int | None = ...,
) -> list[_R]: ...
@overload
def run_distributed(
    fn: Callable[[int, int, *_Ts], _R],
    world_size: int = ...,
    *,
    timeout: float = ...,
    args: tuple[*_Ts],
    start_method: StartMethod | None = ...,
    threads_per_rank: int | None = ...,
) -> list[_R]: ...
def run_distributed(
    fn: Callable[..., _R],
    world_size: int = 2,
    *,
    timeout: float = 60.0,
    args: tuple[object, ...] = (),
    start_method: StartMethod | None = None,
    threads_per_rank: int | None = None,
) -> list[_R]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks; return results by rank.

    Each rank is a new process in a gloo process group on 127.0.0.1 (a free port,
    ``tcp://`` rendezvous), so ``fn`` and ``args`` must pickle: ``fn`` is a
    module-level function, and so are the results. Each rank destroys the group
    after reporting its result: once every rank's ``fn`` returned (they meet at a
    barrier first: taking a group down while a peer still uses it can hang), or when
    ``fn`` raises; a rank still tearing down when all have reported is stopped.
    ``start_method`` is ``"forkserver"`` where the platform has it (ranks fork from
    a server that imported torch once, with ``spawn``'s isolation, in milliseconds
    instead of seconds; they see the environment variables of when the server
    started) and ``"spawn"`` otherwise.
    Each rank uses ``threads_per_rank`` intra-op threads (default: the CPUs
    shared evenly).

    If a rank raises, its exception is re-raised here with a note naming the rank
    and, as ``__cause__``, a ``RankFailedError`` holding the rank's traceback text;
    the other ranks are killed. ``RankFailedError`` if a rank dies without reporting
    or its exception does not pickle; ``TimeoutError`` if the ranks are not all
    done within ``timeout`` seconds, after killing them.
    """
    if world_size < 1:
        raise ValueError(f"run_distributed: world_size must be at least 1, got {world_size}")
    try:
        pickle.dumps((fn, args))
    except Exception as error:
        raise TypeError(
            f"run_distributed: {_name(fn)} or its args do not pickle "
            f"({error}); pass a module-level function and picklable arguments"
        ) from error
    context = _context(start_method)
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    port = free_port()
    stacks = tempfile.mkdtemp(prefix="run_distributed_stacks_")
    processes: list[BaseProcess] = []
    readers: list[Connection] = []
    try:
        for rank in range(world_size):
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(
                target=_rank_main,
                args=(_Job(fn, args, world_size, port, timeout, threads, stacks), rank, writer),
                name=f"rank-{rank}",
                daemon=True,
            )
            process.start()
            writer.close()
            processes.append(process)
            readers.append(reader)
        outcomes = _collect(fn, processes, readers, timeout, stacks)
    finally:
        _stop(processes)
        for reader in readers:
            reader.close()
        shutil.rmtree(stacks, ignore_errors=True)
    return [outcomes[rank] for rank in range(world_size)]


def _context(start_method: StartMethod | None) -> Any:
    if start_method is None:
        available = multiprocessing.get_all_start_methods()
        start_method = "forkserver" if "forkserver" in available else "spawn"
    context = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        context.set_forkserver_preload(_PRELOAD)
    return context


@attrs.frozen
class _Job:
    """What every rank of one ``run_distributed`` call runs, and where the group meets."""

    fn: Callable[..., object]
    args: tuple[object, ...]
    world_size: int
    port: int
    timeout: float
    threads: int
    stacks: str  # the directory where a rank writes its stacks when asked (_DUMP_SIGNAL)


@attrs.frozen
class _Failure:
    """How a rank failed: traceback text, the pickled exception if it pickles, and when."""

    text: str
    pickled: bytes | None
    raised_at: float

    @classmethod
    def of(cls, error: BaseException) -> _Failure:
        raised_at = time.time()
        text = "".join(traceback.format_exception(error))
        try:
            pickled = pickle.dumps(error)
            pickle.loads(pickled)
        except Exception:
            return cls(text, None, raised_at)
        return cls(text, pickled, raised_at)


def _rank_main(job: _Job, rank: int, writer: Connection) -> None:
    """The body of one rank: join the group, run the function, send back its result or error."""
    torch.set_num_threads(job.threads)
    if _DUMP_SIGNAL is not None:
        # Where a hung rank is, for the TimeoutError: every thread's stack, on request.
        stack_file = open(_stack_path(job.stacks, rank), "w")  # noqa: SIM115 (lives as the rank)
        faulthandler.register(_DUMP_SIGNAL, file=stack_file, all_threads=True)
    try:
        try:
            writer.send((rank, *_run_rank(job, rank)))
        except BaseException as error:  # joining the group failed, or the result does not pickle
            writer.send((rank, False, _Failure.of(error)))
        finally:
            writer.close()
    finally:
        # Only after the report: a teardown that hangs (torch 2.6's gloo did, now and then)
        # holds up no result, and run_distributed stops the rank once all have reported.
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_rank(job: _Job, rank: int) -> tuple[bool, object]:
    """Join the group and run the function: ``(True, result)`` or ``(False, _Failure)``."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{job.port}",
        rank=rank,
        world_size=job.world_size,
        timeout=timedelta(seconds=job.timeout),
    )
    try:
        result = job.fn(rank, job.world_size, *job.args)
        # Every rank is done with the group before any takes it down: destroying it
        # while a peer still uses it can hang (torch 2.6's gloo does, now and then).
        barrier()
    except BaseException as error:
        # Described here, before the group goes down and the other ranks fail in turn.
        return False, _Failure.of(error)
    return True, result


def _collect(
    fn: Callable[..., object],
    processes: list[BaseProcess],
    readers: list[Connection],
    timeout: float,
    stacks: str,
) -> dict[int, Any]:
    """Wait for every rank's report; raise the first failure, or TimeoutError at the deadline.

    The TimeoutError ends with where each hung rank was: its threads' stacks.
    """
    world_size = len(processes)
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    failures: list[tuple[float, int, BaseException]] = []
    pending = dict(enumerate(readers))
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if failures:
                break
            hung = sorted(pending)
            raise TimeoutError(
                f"run_distributed: ranks {hung} of {world_size} did not finish "
                f"{_name(fn)} within {timeout:g} s and were killed"
                + _stacks_of(hung, processes, stacks)
            )
        waiting: dict[object, int] = {processes[rank].sentinel: rank for rank in pending}
        waiting.update({reader: rank for rank, reader in pending.items()})
        for item in wait([*pending.values(), *(processes[r].sentinel for r in pending)], remaining):
            rank = waiting[item]
            if rank not in pending:
                continue
            reader = pending[rank]
            if reader.poll():
                try:
                    _, ok, payload = reader.recv()
                except EOFError:
                    ok, payload = False, None
            else:
                ok, payload = False, None
            del pending[rank]
            if ok:
                results[rank] = payload
                continue
            raised_at = payload.raised_at if isinstance(payload, _Failure) else time.time()
            error = _failure(rank, world_size, processes[rank], payload)
            failures.append((raised_at, rank, error))
            deadline = min(deadline, time.monotonic() + _GRACE_SECONDS)
    if failures:
        # The first to fail is the cause: the others usually fail because it left the group.
        (_, _, first), *others = sorted(failures, key=lambda failure: failure[:2])
        for _, other_rank, other in others:
            first.add_note(f"then rank {other_rank} failed: {type(other).__name__}: {other}")
        raise first
    return results


#: The signal that makes a rank write its stacks (POSIX only; None elsewhere).
_DUMP_SIGNAL: Final[signal.Signals | None] = getattr(signal, "SIGUSR1", None)
#: Lines of stack shown per hung rank, the innermost calls of each thread first.
_STACK_LINES: Final = 60


def _stack_path(stacks: str, rank: int) -> str:
    return os.path.join(stacks, f"rank-{rank}.txt")


def _stacks_of(ranks: list[int], processes: list[BaseProcess], stacks: str) -> str:
    """Ask each of ``ranks`` for its threads' stacks; the text to append to the error."""
    if _DUMP_SIGNAL is None:
        return ""
    for rank in ranks:
        pid = processes[rank].pid
        if pid is not None and processes[rank].is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, _DUMP_SIGNAL)
    time.sleep(_GRACE_SECONDS)  # faulthandler writes from its signal handler, at once
    parts: list[str] = []
    for rank in ranks:
        try:
            with open(_stack_path(stacks, rank)) as file:
                lines = file.read().splitlines()
        except OSError:
            lines = []
        shown = "\n".join(lines[:_STACK_LINES]) or "(no stack: the rank did not answer)"
        parts.append(f"\nrank {rank} was at:\n{shown}")
    return "".join(parts)


def _failure(rank: int, world_size: int, process: BaseProcess, payload: object) -> BaseException:
    """The exception to raise for a rank that reported ``payload`` (None: it reported nothing)."""
    if not isinstance(payload, _Failure):
        process.join(1.0)
        return RankFailedError(
            f"run_distributed: rank {rank} of {world_size} exited with code {process.exitcode} "
            "without reporting a result"
        )
    remote = RankFailedError(f"rank {rank} of {world_size} raised:\n{payload.text}")
    if payload.pickled is None:
        return remote
    error: BaseException = pickle.loads(payload.pickled)
    error.__cause__ = remote
    error.add_note(f"raised on rank {rank} of {world_size}; the cause above is its traceback")
    return error


def _stop(processes: list[BaseProcess]) -> None:
    """Join finished ranks; terminate, then kill, any still running."""
    for process in processes:
        process.join(0.5)
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join(2.0)


def _name(fn: Callable[..., object]) -> str:
    return str(getattr(fn, "__qualname__", repr(fn)))


# --------------------------------------------------------------------- invariants


def _sum_of_outputs(output: object) -> Tensor:
    leaves, _ = pytree.tree_flatten(output)
    tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor) and leaf.is_floating_point()]
    if not tensors:
        raise AssertionError("check_api_invariants: the model's output holds no float tensor")
    return torch.stack([tensor.float().sum() for tensor in tensors]).sum()


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
    of one forward; ``loss`` reduces the output to a scalar (default: the sum of
    its float tensors). ``target`` picks the module the API is applied to (default
    the model; with mypy, pass a function rather than a lambda: mypy infers a
    lambda's result before it knows the model type). ``same_numerics`` says the API
    must not change outputs or gradients (within ``tolerance``); ``check_freed`` that
    the applied model is freed by reference counting alone once dropped (no cycle).
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
        loss: Callable[[Any], Tensor] = ...,
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
        loss: Callable[[Any], Tensor] = ...,
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
        loss: Callable[[Any], Tensor] = _sum_of_outputs,
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
            "loss": loss,
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
    """What ``check_api_invariants`` compared, and the largest differences it saw."""

    parameters: int
    output_difference: float
    gradient_difference: float


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
    (``check_freed``). Raises ``AssertionError`` naming the first invariant
    broken; returns what was compared.
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
    outputs, gradients = _forward_backward(case, model)
    reference_outputs, reference_gradients = _forward_backward(case, reference)
    output_difference = _max_difference(outputs, reference_outputs)
    gradient_difference = _max_gradient_difference(gradients, reference_gradients)
    if case.same_numerics and output_difference > case.tolerance:
        raise AssertionError(
            f"check_api_invariants: {api.name} changed the forward output by "
            f"{output_difference:.3g} (tolerance {case.tolerance:g})"
        )
    if case.same_numerics and gradient_difference > case.tolerance:
        raise AssertionError(
            f"check_api_invariants: {api.name} changed the gradients by "
            f"{gradient_difference:.3g} (tolerance {case.tolerance:g})"
        )
    report = InvariantReport(len(gradients), output_difference, gradient_difference)
    if case.check_freed:
        alive = weakref.ref(model)
        with _gc_disabled():
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


def _forward_backward(case: ModelCase[Any, Any], model: nn.Module) -> tuple[Any, dict[str, Tensor]]:
    """One forward and backward under a fixed seed; the output and the gradients by FQN."""
    with fork_rng(devices=[]):
        manual_seed(case.seed + 1)
        inputs = case.make_inputs()
        manual_seed(case.seed + 2)
        output = model(*inputs)
        torch.autograd.backward(case.loss(output))
    gradients = {
        name: parameter.grad.detach().clone()
        for name, parameter in model.named_parameters()
        if parameter.grad is not None
    }
    return pytree.tree_map(_detached, output), gradients


def _detached(leaf: object) -> object:
    return leaf.detach() if isinstance(leaf, Tensor) else leaf


def _max_difference(mine: object, theirs: object) -> float:
    my_leaves, my_spec = pytree.tree_flatten(mine)
    their_leaves, their_spec = pytree.tree_flatten(theirs)
    if my_spec != their_spec:
        raise AssertionError("check_api_invariants: the API changed the structure of the output")
    worst = 0.0
    for my_leaf, their_leaf in zip(my_leaves, their_leaves, strict=True):
        if isinstance(my_leaf, Tensor) and isinstance(their_leaf, Tensor):
            worst = max(worst, _tensor_difference(my_leaf, their_leaf))
        elif my_leaf != their_leaf:
            return math.inf
    return worst


def _max_gradient_difference(mine: dict[str, Tensor], theirs: dict[str, Tensor]) -> float:
    if mine.keys() != theirs.keys():
        missing = sorted(mine.keys() ^ theirs.keys())
        raise AssertionError(
            f"check_api_invariants: gradients differ in which parameters have one: {missing}"
        )
    return max((_tensor_difference(mine[name], theirs[name]) for name in mine), default=0.0)


def _tensor_difference(mine: Tensor, theirs: Tensor) -> float:
    if mine.shape != theirs.shape:
        return math.inf
    if mine.numel() == 0:
        return 0.0
    return float((mine.double() - theirs.double()).abs().max())


@contextlib.contextmanager
def _gc_disabled() -> Generator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
