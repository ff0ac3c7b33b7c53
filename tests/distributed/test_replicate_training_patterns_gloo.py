"""Training patterns of real code under replicate, against DDP on 2 gloo ranks, exactly.

- Two views through BatchNorm, then one loss (siamese and contrastive training): the
  buffers broadcast before the second forward keep their version counters, as DDP's,
  so the first forward's saved statistics stay valid for backward.
- ``torch.compile`` of a model with buffers: the broadcasts before a forward run
  eagerly, outside the compiled graph, as DDP's do.
- ``fp16_compress_wrapper(powerSGD_hook)``: the wrapper replaces the bucket's buffer
  with a half-precision one; the wrapped hook then reads the gradients of that buffer.
- DDP's parameters and buffers to ignore
  (``_set_params_and_buffers_to_ignore_for_model``): each rank keeps its own.
- Which backward synchronizes, as DDP's: the first after a synchronizing forward that
  reaches its outputs or accumulates a gradient. So an output of a type no search finds
  (an object of the user's class) is averaged; a parameter used in the loss outside the
  forward (CLIP's ``logit_scale``) is averaged, its gradient arriving before the
  outputs'; a penalty's backward through the parameters alone, run first, is the one
  averaged and the outputs' after it stays local; and a forward with grad enabled
  without its backward (an evaluation) leaves the next backward, even inside
  ``no_sync``, synchronizing.
- A post-accumulate-grad hook registered after ``replicate`` that edits ``.grad`` in
  place (clipping): it runs before the gradient is copied for averaging, as DDP's
  reducer runs after every such hook.
- Optimizers applied in backward (torch's ``_apply_optimizer_in_backward``): they step
  on the averaged gradients, as DDP steps them (on an accelerator: DDP refuses on the
  CPU), so the replicas stay equal; ``.grad`` is None after.
- A gradient penalty: ``torch.autograd.grad`` through the outputs first (it accumulates
  nothing, so it is not the synchronizing backward, as under DDP), then the loss's.
- An evaluation on one rank alone (``rank_local``, without grad) between a forward and
  its backward: that backward is still averaged.
- A backward that raised before any gradient arrived: the next steps train as DDP's,
  a parameter used outside the forward included.
- ``channels_last`` weights under PowerSGD: a hook's ``bucket.gradients()`` are
  contiguous views of the buffer, as ``GradBucket``'s.
- An output of the user's own class from a model that runs a block in a reentrant
  checkpoint after a layer of its own: the first gradient arrives in the checkpoint's
  nested backward, and the synchronization goes on into the backward around it, so the
  layer's gradient is averaged too, as under DDP; with ``find_unused_parameters`` (where
  DDP raises "Expected to mark a variable ready only once") ours averages the same.
- An output of the user's own class with ``static_graph``: ours averages; DDP's static
  graph averages nothing, silently (a difference row).
- Under ``Join`` with ``find_unused_parameters``: a joined rank sends back the map of
  used parameters it last all-reduced, as DDP's, so a parameter some rank used before
  it joined gets averaged zeros where no active rank uses it (momentum moves it on).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable
from typing import Any, Final, cast

import pytest
import torch
import torch.distributed as dist
from planned_failure import MESSAGE, arm, failure_point
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.optim.apply_optimizer_in_backward import _apply_optimizer_in_backward
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from torchcontract.apis import _torch, rank_local, replicate
from torchcontract.testing import run_distributed

Results = dict[str, Any]
#: Whether this torch's DDP keeps its buffers' versions through its broadcast (newer ones).
DDP_KEEPS_BUFFER_VERSIONS: Final = "_unsafe_preserve_version_counter" in inspect.getsource(
    DistributedDataParallel._sync_buffers
)
apply_in_backward: Final = cast(
    Callable[[type[torch.optim.Optimizer], Any, dict[str, Any]], None],
    _apply_optimizer_in_backward,
)
#: DDP's way to name the parameters and buffers it leaves alone (untyped in torch).
_ignore_for_model: Final = cast(
    Callable[[nn.Module, list[str]], None],
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model,
)
Wrap = Callable[[nn.Module], nn.Module]
STEPS: Final = 3


def _batch(rank: int, step: int, width: int = 4) -> Tensor:
    return torch.randn(6, width, generator=torch.Generator().manual_seed(100 * rank + step))


def _trained(
    build: Callable[[], nn.Module],
    wrap: Wrap,
    step: Callable[[nn.Module, int], Tensor],
) -> list[list[float]]:
    """Every parameter and buffer after each of ``STEPS`` SGD steps, flattened."""
    torch.manual_seed(0)
    raw = build()
    model = wrap(raw)
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
    seen = []
    for index in range(STEPS):
        torch.autograd.backward(step(model, index))
        optimizer.step()
        optimizer.zero_grad()
        state = [*raw.parameters(), *raw.buffers()]
        seen.append([float(x) for t in state for x in t.detach().reshape(-1).tolist()])
    return seen


def _both(
    build: Callable[[], nn.Module],
    ours: Wrap,
    theirs: Wrap,
    step: Callable[[nn.Module, int], Tensor],
) -> bool | str:
    """Whether replicate (``ours``) and DDP (``theirs``) leave the same numbers, exactly;
    where this torch's DDP raises instead (ours must not), what it raised."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DDP's and torch's own deprecation warnings
        mine = _trained(build, ours, step)
        try:
            return mine == _trained(build, theirs, step)
        except RuntimeError as error:
            return f"DDP raised: {str(error).split(':')[0]}"


def _norm_net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _two_views(rank: int) -> Callable[[nn.Module, int], Tensor]:
    def step(model: nn.Module, index: int) -> Tensor:
        x = _batch(rank, index)
        first: Tensor = model(x + 0.1)
        second: Tensor = model(x - 0.1)
        return (first - second).pow(2).sum()

    return step


def _plain(rank: int) -> Callable[[nn.Module, int], Tensor]:
    def step(model: nn.Module, index: int) -> Tensor:
        out: Tensor = model(_batch(rank, index))
        return out.pow(2).sum()

    return step


def _compiled(wrap: Wrap) -> Wrap:
    def compiled(module: nn.Module) -> nn.Module:
        return cast(nn.Module, torch.compile(wrap(module), backend="aot_eager"))

    return compiled


def _power_sgd(wrap: Wrap) -> Wrap:
    def hooked(module: nn.Module) -> nn.Module:
        model = wrap(module)
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=1,
            start_powerSGD_iter=2,
            min_compression_rate=0.5,
            random_seed=0,
        )
        hook = default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook)
        cast(Any, model).register_comm_hook(state, hook)
        return model

    return hooked


class Counting(nn.Module):
    """A layer, a buffer, and a layer whose weight DDP is told to ignore."""

    count: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.local = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x: Tensor) -> Tensor:
        self.count += 1
        out: Tensor = self.local(self.shared(x))
        return out


def _ignoring(rank: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        model = Counting()
        _ignore_for_model(model, ["local.weight", "count"])
        if rank == 1:  # what each rank keeps of its own
            with torch.no_grad():
                model.local.weight.add_(1.0)
                model.count.fill_(5)
        return model

    return build


class Boxed:
    """An output of the user's own class: no search for tensors looks inside it."""

    def __init__(self, value: Tensor) -> None:
        self.value = value


class Boxing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: Tensor) -> Boxed:
        return Boxed(self.layers(x))


class CheckpointedBoxing(Boxing):
    """``Boxing`` after a layer of its own, its layers in a reentrant checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Boxed:
        return Boxed(cast(Tensor, checkpoint(self.layers, self.first(x), use_reentrant=True)))


def _boxed(rank: int) -> Callable[[nn.Module, int], Tensor]:
    def step(model: nn.Module, index: int) -> Tensor:
        return cast(Boxed, model(_batch(rank, index))).value.pow(2).sum()

    return step


class Clip(nn.Module):
    """Two towers; the loss scales their similarities by ``logit_scale``, outside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Linear(4, 4)
        self.text = nn.Linear(4, 4)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, images: Tensor, texts: Tensor) -> tuple[Tensor, Tensor]:
        return (
            nn.functional.normalize(self.image(images), dim=-1),
            nn.functional.normalize(self.text(texts), dim=-1),
        )


def _contrastive(rank: int) -> Callable[[nn.Module, int], Tensor]:
    def step(model: nn.Module, index: int) -> Tensor:
        images, texts = model(_batch(rank, index), _batch(rank, index + 50))
        scale = cast(Clip, cast(Any, model).module if hasattr(model, "module") else model)
        logits = scale.logit_scale.exp() * images @ texts.T
        return nn.functional.cross_entropy(logits, torch.arange(6))

    return step


def _penalty_first(rank: int) -> Callable[[nn.Module, int], Tensor]:
    """A weight penalty's backward first (averaged, as DDP's), then the outputs' (local)."""

    def step(model: nn.Module, index: int) -> Tensor:
        out = cast(Tensor, model(_batch(rank, index)))
        penalty = sum(p.pow(2).sum() for p in model.parameters())
        torch.autograd.backward(cast(Tensor, penalty) * 0.01)
        return out.pow(2).sum()

    return step


def _evaluated_then_accumulated(rank: int) -> Callable[[nn.Module, int], Tensor]:
    """An evaluation forward with grad enabled, then a no_sync micro-batch, then a step."""

    def step(model: nn.Module, index: int) -> Tensor:
        model(_batch(rank, index + 20))  # no backward
        with cast(Any, model).no_sync():
            torch.autograd.backward(cast(Tensor, model(_batch(rank, index + 40))).pow(2).sum())
        return cast(Tensor, model(_batch(rank, index))).pow(2).sum()

    return step


def _clip_in_place(parameter: Tensor) -> None:
    assert parameter.grad is not None
    parameter.grad.mul_(2.0).clamp_(-0.3, 0.3)


def _clipping_after(wrap: Wrap) -> Wrap:
    def wrapped(module: nn.Module) -> nn.Module:
        model = wrap(module)
        for parameter in module.parameters():
            _torch.register_post_accumulate_grad_hook(parameter, _clip_in_place)
        return model

    return wrapped


class PartlyUsed(nn.Module):
    """A layer every forward uses, and one none does."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 3)
        self.unused = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.used(x)
        return out


def _stepping_in_backward(rank: int, when: str) -> tuple[bool, bool]:
    """SGD with momentum and weight decay applied in backward, ``when`` "before" or "after"
    ``replicate`` (before its first forward, as DDP's lazy init takes them), against the
    same SGD on gradients averaged by hand; a layer no forward uses steps on zeros, as
    under DDP (``find_unused_parameters``). Whether the parameters agree exactly, and
    whether every ``.grad`` is None after."""
    settings = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}
    torch.manual_seed(0)
    model = PartlyUsed()
    if when == "before":
        apply_in_backward(torch.optim.SGD, model.parameters(), settings)
    replicate(model, find_unused_parameters=True)
    if when == "after":
        apply_in_backward(torch.optim.SGD, model.parameters(), settings)
    torch.manual_seed(0)
    reference = PartlyUsed()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    for index in range(STEPS):
        torch.autograd.backward(cast(Tensor, model(_batch(rank, index))).pow(2).sum())
        torch.autograd.backward(cast(Tensor, reference(_batch(rank, index))).pow(2).sum())
        for parameter in reference.parameters():
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            dist.all_reduce(parameter.grad)
            parameter.grad.div_(2)
        optimizer.step()
        optimizer.zero_grad()
    same = all(map(torch.equal, model.parameters(), reference.parameters()))
    return same, all(parameter.grad is None for parameter in model.parameters())


class Branching(nn.Module):
    """A trunk, and a side layer only rank 0 uses, at odd steps."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 2)
        self.side = nn.Linear(2, 2)

    def forward(self, x: Tensor, side: bool) -> Tensor:
        out: Tensor = self.trunk(x)
        return self.side(out) if side else out


def _joined_unused(rank: int, wrap: Wrap) -> list[list[float]]:
    """Rank 1 joins after 2 batches of rank 0's 5; SGD with momentum: the states per step."""
    torch.manual_seed(0)
    raw = Branching()
    model = wrap(raw)
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1, momentum=0.9)
    seen = []
    with cast(Any, model).join():
        for index in range(5 if rank == 0 else 2):
            side = rank == 0 and index % 2 == 1
            torch.autograd.backward(cast(Tensor, model(_batch(rank, index), side)).pow(2).sum())
            optimizer.step()
            optimizer.zero_grad()
            seen.append([float(x) for p in raw.parameters() for x in p.detach().reshape(-1)])
    return seen


def _penalized(rank: int) -> Callable[[nn.Module, int], Tensor]:
    def step(model: nn.Module, index: int) -> Tensor:
        x = _batch(rank, index).requires_grad_()
        out = cast(Tensor, model(x))
        (slope,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return out.pow(2).sum() + slope.pow(2).sum()

    return step


def _evaluated_alone_between(rank: int) -> Callable[[nn.Module, int], Tensor]:
    def step(model: nn.Module, index: int) -> Tensor:
        out = cast(Tensor, model(_batch(rank, index)))
        local = model.module if isinstance(model, DistributedDataParallel) else model
        with rank_local(local) if local is model else contextlib.nullcontext(), torch.no_grad():
            local(_batch(rank, index + 30))
        return out.pow(2).sum()

    return step


class Scaled(nn.Module):
    """A layer whose output passes a point that may raise first; ``scale`` is used outside."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        return failure_point(self.layer(x))


def _after_an_early_failure(rank: int) -> Callable[[nn.Module, int], Tensor]:
    def step(model: nn.Module, index: int) -> Tensor:
        scaled = cast(Scaled, model.module if isinstance(model, DistributedDataParallel) else model)
        if index == 0:
            arm()
            with pytest.raises(ValueError, match=MESSAGE):
                torch.autograd.backward(cast(Tensor, model(_batch(rank, 99))).sum())
            scaled.zero_grad()
        return (cast(Tensor, model(_batch(rank, index))) * scaled.scale).pow(2).sum()

    return step


def _channels_last_net() -> nn.Module:
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.Flatten(), nn.Linear(16, 3))
    with torch.no_grad():
        conv = cast(nn.Conv2d, model[0])
        conv.weight.data = conv.weight.contiguous(memory_format=torch.channels_last)
    return model


def _images(rank: int) -> Callable[[nn.Module, int], Tensor]:
    def step(model: nn.Module, index: int) -> Tensor:
        x = torch.randn(2, 2, 4, 4, generator=torch.Generator().manual_seed(rank + 10 * index))
        return cast(Tensor, model(x)).pow(2).sum()

    return step


def _power_sgd_plain(wrap: Wrap) -> Wrap:
    def hooked(module: nn.Module) -> nn.Module:
        model = wrap(module)
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
        )
        cast(Any, model).register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return model

    return hooked


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _unused_found(wrap: Callable[..., nn.Module]) -> Wrap:
    return lambda module: wrap(module, find_unused_parameters=True)


def _static(wrap: Callable[..., nn.Module]) -> Wrap:
    return lambda module: wrap(module, static_graph=True)


def _job(rank: int, world_size: int) -> Results:
    ddp: Wrap = DistributedDataParallel
    ours: Wrap = replicate
    return {
        "two_views": _both(_norm_net, ours, ddp, _two_views(rank)),
        "compiled": _both(_norm_net, _compiled(ours), _compiled(ddp), _plain(rank)),
        "fp16_power_sgd": _both(
            lambda: nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 4)),
            _power_sgd(ours),
            _power_sgd(ddp),
            _plain(rank),
        ),
        "ignored": _both(_ignoring(rank), ours, ddp, _plain(rank)),
        "boxed_output": _both(Boxing, ours, ddp, _boxed(rank)),
        "boxed_output_reentrant": _both(CheckpointedBoxing, ours, ddp, _boxed(rank)),
        # Every parameter is used: DDP's averages without the keyword are the reference.
        "boxed_output_reentrant_unused_found": _both(
            CheckpointedBoxing, _unused_found(replicate), ddp, _boxed(rank)
        ),
        "boxed_output_reentrant_ddp_unused_found": _both(
            CheckpointedBoxing, ddp, _unused_found(ddp), _boxed(rank)
        ),
        # DDP's own static graph averages nothing there: its plain averages are the reference.
        "boxed_output_static": _both(Boxing, _static(replicate), ddp, _boxed(rank)),
        "boxed_output_ddp_static": _both(Boxing, ddp, _static(ddp), _boxed(rank)),
        "outside_forward": _both(Clip, ours, ddp, _contrastive(rank)),
        "penalty_first": _both(_mlp, ours, ddp, _penalty_first(rank)),
        "evaluated_then_accumulated": _both(_mlp, ours, ddp, _evaluated_then_accumulated(rank)),
        "clipping_after": _both(_mlp, _clipping_after(ours), _clipping_after(ddp), _plain(rank)),
        "in_backward": [_stepping_in_backward(rank, when) for when in ("before", "after")],
        "penalized": _both(_mlp, ours, ddp, _penalized(rank)),
        "penalized_unused_found": _both(
            _mlp, _unused_found(replicate), _unused_found(ddp), _penalized(rank)
        ),
        "evaluated_alone_between": _both(_mlp, ours, ddp, _evaluated_alone_between(rank)),
        "after_an_early_failure": _both(Scaled, ours, ddp, _after_an_early_failure(rank)),
        "channels_last_power_sgd": _both(
            _channels_last_net, _power_sgd_plain(ours), _power_sgd_plain(ddp), _images(rank)
        ),
        "joined_unused": _joined_unused(rank, _unused_found(replicate))
        == _joined_unused(rank, _unused_found(DistributedDataParallel)),
        "ignored_stays_local": _ignored_stays_local(rank),
    }


def _ignored_stays_local(rank: int) -> list[float]:
    """The ignored weight's first value and the ignored buffer after training: each rank's own."""
    torch.manual_seed(0)
    model = _ignoring(rank)()
    replicate(model)
    torch.autograd.backward(cast(Tensor, model(_batch(rank, 0))).sum())
    counting = cast(Counting, model)
    return [float(counting.local.weight[0, 0]), float(counting.count)]


@pytest.fixture(scope="module")
def ranks() -> list[Results]:
    return run_distributed(_job, 2, timeout=240.0)


@pytest.mark.parametrize(
    "pattern",
    [
        "two_views",
        "compiled",
        "fp16_power_sgd",
        "ignored",
        "boxed_output",
        "boxed_output_reentrant",
        "boxed_output_reentrant_unused_found",
        "boxed_output_static",
        "outside_forward",
        "penalty_first",
        "evaluated_then_accumulated",
        "clipping_after",
        "joined_unused",
        "penalized",
        "penalized_unused_found",
        "evaluated_alone_between",
        "after_an_early_failure",
        "channels_last_power_sgd",
    ],
)
def test_the_numbers_are_ddps(ranks: list[Results], pattern: str) -> None:
    outcome = [rank[pattern] for rank in ranks]
    if pattern == "two_views" and not DDP_KEEPS_BUFFER_VERSIONS:
        # Older DDPs bump the buffers' versions and fail that backward; ours trains.
        expected = "DDP raised: one of the variables needed for gradient computation has been "
        assert outcome == [expected + "modified by an inplace operation"] * 2
        return
    assert outcome == [True, True]


def test_optimizers_applied_in_backward_step_on_the_averaged_gradients(
    ranks: list[Results],
) -> None:
    assert [rank["in_backward"] for rank in ranks] == [[(True, True)] * 2] * 2


def test_ddp_refuses_a_reentrant_checkpoint_with_unused_parameters_found(
    ranks: list[Results],
) -> None:
    """Where ours averages with ``find_unused_parameters`` (above), DDP raises."""
    outcome = [rank["boxed_output_reentrant_ddp_unused_found"] for rank in ranks]
    assert (
        outcome
        == [
            "DDP raised: Expected to mark a variable ready only once. This error is "
            "caused by one of the following reasons"
        ]
        * 2
    )


def test_ddps_static_graph_averages_no_output_of_the_users_own_class(
    ranks: list[Results],
) -> None:
    """Where ours averages with ``static_graph`` (above), DDP's numbers are each rank's own.

    Its static graph's first backward sends everything from a hook on the outputs it
    finds, and later ones count on that one: with none found, nothing is averaged, silently.
    """
    assert [rank["boxed_output_ddp_static"] for rank in ranks] == [False, False]


def test_what_ddp_is_told_to_ignore_stays_each_ranks_own(ranks: list[Results]) -> None:
    first, second = (rank["ignored_stays_local"] for rank in ranks)
    assert second[0] - first[0] == pytest.approx(1.0)
    assert (first[1], second[1]) == (1.0, 6.0)
