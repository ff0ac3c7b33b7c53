"""fully_shard on the paths FSDP2 users take, on 2 gloo ranks, side by side with FSDP2.

Casting the sharded model (``to(dtype)``, ``half()``, ``double()``, ``to("cpu")``),
before training, between steps and while the root holds unsharded parameters; a
model built on the meta device, refused until materialized, then trained; and
``torch.compile`` of the sharded model (graphs, graph breaks, recompiles, losses).
One job runs every scenario; each test asserts one behaviour on its results.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
from fully_shard_models import (
    GPT,
    batch,
    full_gradients,
    full_parameters,
    gpt,
    largest_gap,
    loss_on,
    needs_reference_fully_shard,
)
from torch import Tensor, nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torchcontract import UnmaterializedParameterError
from torchcontract.apis import fully_shard, unshard
from torchcontract.apis._compat import REFERENCE_FULLY_SHARD_ON_CPU
from torchcontract.testing import run_distributed

needs_reference = needs_reference_fully_shard

Results = dict[str, Any]
Shard_ = Callable[..., object]
Cast = Callable[[nn.Module], object]
#: Losses per step, full parameters after the last step, dtypes of parameters and gradients
#: (of the last step).
Run = tuple[list[float], dict[str, Tensor], set[torch.dtype], set[torch.dtype]]


def _shard(model: GPT, apply: Shard_, mesh: DeviceMesh, **options: Any) -> GPT:
    """``apply`` (ours or torch's fully_shard) on each block, then on the root."""
    for block in model.blocks:
        apply(block, mesh=mesh, **options)
    apply(model, mesh=mesh, **options)
    return model


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2)
    # Plain SGD keeps no state: a model rebuilt from the parameters continues exactly.
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _train(
    rank: int,
    model: GPT,
    optimizer: str,
    steps: range,
    before_step: Callable[[int], None] = lambda step: None,
) -> Run:
    made = _optimizer(optimizer, model)
    losses: list[float] = []
    grad_dtypes: set[torch.dtype] = set()
    for step in steps:
        before_step(step)
        loss = loss_on(model, *batch(rank, step))
        torch.autograd.backward(loss)
        grad_dtypes = {grad.dtype for grad in full_gradients(model).values()}
        made.step()
        made.zero_grad()
        losses.append(loss.item())
    parameters = full_parameters(model)
    return losses, parameters, {value.dtype for value in parameters.values()}, grad_dtypes


def _summary(mine: Run, theirs: Run) -> tuple[list[float], list[float], float, set[Any], set[Any]]:
    """Both runs' losses, the largest parameter gap, and our parameter and gradient dtypes."""
    return mine[0], theirs[0], largest_gap(mine[1], theirs[1]), mine[2], mine[3]


# ----------------------------------------------------------------- casts


def _cast_before_training(
    rank: int, mesh: DeviceMesh, cast: Cast, optimizer: str, mixed: bool = False
) -> tuple[list[float], list[float], float, set[Any], set[Any]]:
    """Shard, cast, train three steps: ours against torch's fully_shard."""
    ours_options: dict[str, Any] = {}
    theirs_options: dict[str, Any] = {}
    if mixed:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        ours_options = theirs_options = {"mp_policy": policy}
    ours = _shard(gpt(), fully_shard, mesh, **ours_options)
    theirs = _shard(gpt(), torch_fully_shard, mesh, **theirs_options)
    cast(ours)
    cast(theirs)
    return _summary(
        _train(rank, ours, optimizer, range(3)), _train(rank, theirs, optimizer, range(3))
    )


def _from_parameters(parameters: dict[str, Tensor]) -> GPT:
    model = gpt()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(parameters[name])
    return model


def _cast_between_steps(
    rank: int, mesh: DeviceMesh
) -> tuple[list[float], list[float], float, set[Any], set[Any]]:
    """Ours cast to bfloat16 after a float32 step, against torch's model rebuilt there.

    Torch's fully_shard fixes its dtypes at the first forward (a cast after it fails
    in the all-gather), so its side is a fresh model holding the parameters after
    the first step, cast before its first forward; plain SGD has no state to carry.
    """
    ours = _shard(gpt(), fully_shard, mesh)
    first = _shard(gpt(), torch_fully_shard, mesh)
    _, after_first, _, _ = _train(rank, first, "sgd", range(1))
    theirs = _shard(_from_parameters(after_first), torch_fully_shard, mesh)
    theirs.to(torch.bfloat16)

    def cast_at_second_step(step: int) -> None:
        if step == 1:
            ours.to(torch.bfloat16)

    mine = _train(rank, ours, "sgd", range(3), before_step=cast_at_second_step)
    reference = _train(rank, theirs, "sgd", range(1, 3))
    return mine[0][1:], reference[0], largest_gap(mine[1], reference[1]), mine[2], mine[3]


def _cast_while_unsharded(
    rank: int, mesh: DeviceMesh, cast: Cast
) -> tuple[list[float], list[float], float, set[Any], set[Any]]:
    """The optimizer made, a forward without gradients leaves the root unsharded, the cast.

    Ours against torch's cast before any forward (a forward without gradients
    changes nothing; torch's own cast after it fails at the next step).
    """
    ours = _shard(gpt(), fully_shard, mesh)
    unsharded: list[bool] = []

    def evaluate_then_cast(step: int) -> None:
        if step == 0:
            with torch.no_grad():
                ours(batch(rank, 9)[0])
            unsharded.append(not isinstance(ours.norm.weight, DTensor))
            cast(ours)

    mine = _train(rank, ours, "sgd", range(3), before_step=evaluate_then_cast)
    theirs = _shard(gpt(), torch_fully_shard, mesh)
    cast(theirs)
    summary = _summary(mine, _train(rank, theirs, "sgd", range(3)))
    assert unsharded == [True]  # the scenario is the one described
    return summary


# ----------------------------------------------------------------- meta device


def _materialize(model: GPT, mesh: DeviceMesh) -> None:
    """``to_empty`` on CPU, then every shard filled from the seeded plain model's values."""
    model.to_empty(device="cpu")
    values = dict(gpt().named_parameters())
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            assert isinstance(parameter, DTensor)
            source = distribute_tensor(values[name].detach(), mesh, [Shard(0)])
            parameter.to_local().copy_(source.to_local())


def _meta_model(apply: Shard_, mesh: DeviceMesh) -> GPT:
    with torch.device("meta"):
        model = GPT()
    return _shard(model, apply, mesh)


def _refused(rank: int, model: GPT) -> tuple[str, list[str]]:
    """The error of a forward, and whether the model computed anything before it."""
    computed: list[str] = []
    model.embed.register_forward_pre_hook(lambda module, args: computed.append("embed"))
    try:
        loss_on(model, *batch(rank, 0))
    except RuntimeError as error:
        return f"{type(error).__name__}: {error}", list(computed)
    return "no error", list(computed)


def _meta(rank: int, mesh: DeviceMesh) -> Results:
    """A sharded meta model: forward refused before any compute, then materialized and trained.

    Ours trains the very model that was refused; torch's cannot (its lazy init
    stopped half done), so its side trains a fresh one.
    """
    found: Results = {}
    ours = _meta_model(fully_shard, mesh)
    found["ours_error"], found["ours_computed"] = _refused(rank, ours)
    try:
        unshard(ours.blocks[1])
    except UnmaterializedParameterError as error:
        found["unshard_error"] = f"{type(error).__name__}: {error}"
    _materialize(ours, mesh)
    mine = _train(rank, ours, "adam", range(3))
    refused = _meta_model(torch_fully_shard, mesh)
    found["theirs_error"], found["theirs_computed"] = _refused(rank, refused)
    theirs = _meta_model(torch_fully_shard, mesh)
    _materialize(theirs, mesh)
    reference = _train(rank, theirs, "adam", range(3))
    plain = _train(rank, _shard(gpt(), fully_shard, mesh), "adam", range(3))
    found["losses"] = (mine[0], reference[0], plain[0])
    found["gaps"] = (largest_gap(mine[1], reference[1]), largest_gap(mine[1], plain[1]))
    return found


# ----------------------------------------------------------------- torch.compile


#: The compiled variants: the whole model; each block's ``compile()`` (after sharding it);
#: the whole model with bfloat16 mixed precision and parameters kept after forward.
COMPILE_VARIANTS = ("model", "blocks", "mixed")


def _compile_options(variant: str) -> dict[str, Any]:
    if variant != "mixed":
        return {}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return {"mp_policy": policy, "reshard_after_forward": False}


def _compiled(rank: int, mesh: DeviceMesh, apply: Shard_, variant: str) -> Results:
    """Three compiled SGD steps: losses, then graphs, graph breaks and frames after each step."""
    torch._dynamo.reset()
    counters.clear()
    model = gpt()
    options = _compile_options(variant)
    for block in model.blocks:
        apply(block, mesh=mesh, **options)
        if variant == "blocks":
            block.compile(backend="eager")
    apply(model, mesh=mesh, **options)
    compiled = model if variant == "blocks" else torch.compile(model, backend="eager")
    assert isinstance(compiled, nn.Module)  # an OptimizedModule
    optimizer = _optimizer("sgd", model)
    losses: list[float] = []
    seen: list[tuple[int, int, int]] = []
    for step in range(3):
        loss = loss_on(compiled, *batch(rank, step))
        torch.autograd.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        seen.append(
            (
                counters["stats"]["unique_graphs"],
                sum(counters["graph_break"].values()),
                counters["frames"]["total"],
            )
        )
    torch._dynamo.reset()
    return {"losses": losses, "counts": seen}


def _compile(rank: int, mesh: DeviceMesh) -> Results:
    found: Results = {}
    for variant in COMPILE_VARIANTS:
        found[f"ours_{variant}"] = _compiled(rank, mesh, fully_shard, variant)
        eager = _shard(gpt(), fully_shard, mesh, **_compile_options(variant))
        found[f"eager_{variant}"] = _train(rank, eager, "sgd", range(3))[0]
        if REFERENCE_FULLY_SHARD_ON_CPU:
            found[f"theirs_{variant}"] = _compiled(rank, mesh, torch_fully_shard, variant)
    return found


# ----------------------------------------------------------------- copies


def _copies(rank: int, mesh: DeviceMesh) -> Results:
    """A pickle of a trained sharded model: its state dict saves and loads the shards.

    (A deep copy is refused, as FSDP2 refuses it: ``test_fully_shard_gloo.py``.)
    """
    model = _shard(gpt(), fully_shard, mesh)
    _train(rank, model, "sgd", range(1))
    found: Results = {}
    for name, copied in (("pickle", pickle.loads(pickle.dumps(model))),):
        saved = copied.state_dict()
        found[f"{name}_keys"] = list(saved) == list(model.state_dict())
        found[f"{name}_shards"] = all(isinstance(value, DTensor) for value in saved.values())
        copied.load_state_dict(model.state_dict())
        found[f"{name}_gap"] = largest_gap(full_parameters(copied), full_parameters(model))
    return found


# ----------------------------------------------------------------- the job


def _job(rank: int, world_size: int) -> Results:
    mesh = init_device_mesh("cpu", (world_size,))
    results: Results = {"compile": _compile(rank, mesh), "copies": _copies(rank, mesh)}
    if REFERENCE_FULLY_SHARD_ON_CPU:
        results["bfloat16"] = _cast_before_training(rank, mesh, _to_bfloat16, "adam")
        results["half"] = _cast_before_training(rank, mesh, nn.Module.half, "sgd")
        results["double"] = _cast_before_training(rank, mesh, nn.Module.double, "adam")
        results["cpu"] = _cast_before_training(rank, mesh, _to_cpu, "adam")
        results["mixed_double"] = _cast_before_training(
            rank, mesh, nn.Module.double, "adam", mixed=True
        )
        results["between_steps"] = _cast_between_steps(rank, mesh)
        results["unsharded_bfloat16"] = _cast_while_unsharded(rank, mesh, _to_bfloat16)
        results["unsharded_double"] = _cast_while_unsharded(rank, mesh, nn.Module.double)
        results["meta"] = _meta(rank, mesh)
    return results


def _to_bfloat16(model: nn.Module) -> object:
    return model.to(torch.bfloat16)


def _to_cpu(model: nn.Module) -> object:
    return model.to("cpu")


@pytest.fixture(scope="module")
def ranks() -> list[Results]:
    return run_distributed(_job, 2, timeout=240.0)


def _each(ranks: list[Results], key: str) -> list[Any]:
    return [rank[key] for rank in ranks]


# ----------------------------------------------------------------- casts


@needs_reference
@pytest.mark.parametrize(
    ("scenario", "dtype"),
    [
        ("bfloat16", torch.bfloat16),
        ("half", torch.float16),
        ("double", torch.float64),
        ("cpu", torch.float32),
        ("mixed_double", torch.float64),
    ],
)
def test_a_cast_after_sharding_trains_as_torch_fully_shard(
    ranks: list[Results], scenario: str, dtype: torch.dtype
) -> None:
    """``to(torch.bfloat16)``, ``half()``, ``double()`` (also under bfloat16 mixed
    precision), ``to("cpu")``: losses and full parameters bit-identical to FSDP2's."""
    for mine, theirs, gap, parameter_dtypes, grad_dtypes in _each(ranks, scenario):
        assert mine == theirs
        assert gap == 0.0
        assert parameter_dtypes == {dtype}
        assert grad_dtypes == {dtype}


@needs_reference
def test_a_cast_between_steps_continues_as_torch_rebuilt_there(ranks: list[Results]) -> None:
    for mine, theirs, gap, parameter_dtypes, grad_dtypes in _each(ranks, "between_steps"):
        assert mine == theirs
        assert gap == 0.0
        assert parameter_dtypes == grad_dtypes == {torch.bfloat16}


@needs_reference
@pytest.mark.parametrize(
    ("scenario", "dtype"),
    [("unsharded_bfloat16", torch.bfloat16), ("unsharded_double", torch.float64)],
)
def test_a_cast_while_the_root_is_unsharded_casts_its_shards(
    ranks: list[Results], scenario: str, dtype: torch.dtype
) -> None:
    for mine, theirs, gap, parameter_dtypes, grad_dtypes in _each(ranks, scenario):
        assert mine == theirs
        assert gap == 0.0
        assert parameter_dtypes == grad_dtypes == {dtype}


# ----------------------------------------------------------------- meta device


@needs_reference
def test_a_forward_on_meta_parameters_is_refused_before_any_compute(
    ranks: list[Results],
) -> None:
    for found in _each(ranks, "meta"):
        assert found["ours_error"].startswith(
            "UnmaterializedParameterError: fully_shard on GPT: 4 parameter(s) still on the "
            "meta device"
        )
        assert "to_empty(device=...)" in found["ours_error"]
        assert found["ours_computed"] == []
        # torch's fully_shard refuses too, with the message ours holds
        assert found["theirs_error"].startswith(
            "RuntimeError: FSDP parameters should be materialized"
        )
        assert found["theirs_error"].removeprefix("RuntimeError: ") in found["ours_error"]
        assert found["theirs_computed"] == []


@needs_reference
def test_unshard_of_a_meta_group_names_its_module(ranks: list[Results]) -> None:
    for found in _each(ranks, "meta"):
        assert found["unshard_error"].startswith(
            "UnmaterializedParameterError: fully_shard on Block 'blocks.1' of GPT: 12 "
            "parameter(s) still on the meta device"
        )
        assert (
            "still on meta device: ['norm1.weight', 'norm1.bias', 'qkv.weight',"
            in (found["unshard_error"])
        )


@needs_reference
def test_a_materialized_meta_model_trains_as_torch_fully_shard(ranks: list[Results]) -> None:
    for found in _each(ranks, "meta"):
        ours, theirs, plain = found["losses"]
        assert ours == theirs == plain
        assert found["gaps"] == (0.0, 0.0)


# ----------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("variant", COMPILE_VARIANTS)
def test_compiled_model_has_the_eager_losses(ranks: list[Results], variant: str) -> None:
    for found in _each(ranks, "compile"):
        assert found[f"ours_{variant}"]["losses"] == found[f"eager_{variant}"]


@pytest.mark.parametrize("variant", COMPILE_VARIANTS)
def test_compiled_model_compiles_once_without_graph_breaks(
    ranks: list[Results], variant: str
) -> None:
    """One graph (the blocks' forward: the hooks run outside the graph), no break, and
    nothing compiled after the first step: no recompiles, as the parameters change."""
    for found in _each(ranks, "compile"):
        counts = found[f"ours_{variant}"]["counts"]
        assert counts[0][:2] == (1, 0)
        assert counts[0] == counts[1] == counts[2]  # a recompile would compile a frame again


@needs_reference
@pytest.mark.parametrize("variant", COMPILE_VARIANTS)
def test_compiled_model_matches_torch_fully_shard_compiled(
    ranks: list[Results], variant: str
) -> None:
    """Same losses; no more graphs, graph breaks or compiled frames than FSDP2."""
    for found in _each(ranks, "compile"):
        ours, theirs = found[f"ours_{variant}"], found[f"theirs_{variant}"]
        assert ours["losses"] == theirs["losses"]
        graphs, breaks, frames = ours["counts"][-1]
        their_graphs, their_breaks, their_frames = theirs["counts"][-1]
        assert graphs <= their_graphs
        assert breaks <= their_breaks
        assert frames <= their_frames


# ----------------------------------------------------------------- copies


@pytest.mark.parametrize("how", ["pickle"])
def test_a_pickle_of_a_sharded_model_saves_and_loads_its_state_dict(
    ranks: list[Results], how: str
) -> None:
    """The pickle's hooks hold no group and stand aside: its shards are saved and loaded."""
    for found in _each(ranks, "copies"):
        assert found[f"{how}_keys"]
        assert found[f"{how}_shards"]
        assert found[f"{how}_gap"] == 0.0
