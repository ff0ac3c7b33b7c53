"""fully_shard on 2 and 3 gloo ranks: parity with PyTorch's FSDP2 and with one process.

One job per world size runs every scenario (starting ranks is the slow part) and
returns what each rank measured; each test asserts one behaviour on those results.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fully_shard_models import (
    GPT,
    Block,
    batch,
    full_gradients,
    full_parameters,
    global_batch,
    gpt,
    largest_gap,
    loss_on,
    needs_reference_fully_shard,
)
from torch import Tensor, nn
from torch.distributed._composable.replicate import replicate as torch_replicate
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from torchcontract import (
    AlreadyManagedError,
    ContractError,
    IncompatibleAPIError,
    InvalidMeshError,
    NoProcessGroupError,
    NotAppliedError,
    contract,
)
from torchcontract.apis import (
    FullyShardState,
    _torch,
    checkpoint,
    fully_shard,
    no_sync,
    replicate,
    reshard,
    unshard,
)
from torchcontract.apis._compat import REFERENCE_FULLY_SHARD_ON_CPU
from torchcontract.testing import run_distributed

# The scenarios that compare with PyTorch's fully_shard need a torch that runs it on CPU;
# elsewhere the job skips them, and so do the tests reading their results. The others
# (one process on the global batch, layout, checkpoints, refusals...) run everywhere.
needs_reference = needs_reference_fully_shard

TOLERANCE = 1e-6
RELATIVE = 1e-5
Results = dict[str, Any]
Optimizer = Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]


def _adam(parameters: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(parameters, lr=1e-2)


def _adamw(parameters: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=1e-2, weight_decay=0.1)


def _sgd(parameters: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)


def _shard_ours(model: GPT, mesh: DeviceMesh, grouped: bool = False, **options: Any) -> GPT:
    """Ours on each block (or on all blocks as one group), then on the root.

    The group's list also names a module inside a block: the block holds the group.
    """
    if grouped:
        fully_shard([*model.blocks, model.blocks[0].get_submodule("up")], mesh=mesh, **options)
    else:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def _shard_theirs(model: GPT, mesh: DeviceMesh, grouped: bool = False, **options: Any) -> GPT:
    """Torch's fully_shard, applied as ``_shard_ours`` applies ours."""
    if grouped:
        torch_fully_shard(list(model.blocks), mesh=mesh, **options)
    else:
        for block in model.blocks:
            torch_fully_shard(block, mesh=mesh, **options)
    torch_fully_shard(model, mesh=mesh, **options)
    return model


def _options(mixed: bool, keep: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keyword arguments for ours and torch's: bfloat16 mixed precision, no reshard."""
    ours: dict[str, Any] = {}
    theirs: dict[str, Any] = {}
    if mixed:
        ours["mp_policy"] = theirs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if keep:
        ours["reshard_after_forward"] = theirs["reshard_after_forward"] = False
    return ours, theirs


# ----------------------------------------------------------------- scenarios


def _against_torch(
    rank: int,
    mesh: DeviceMesh,
    make_optimizer: Optimizer,
    *,
    steps: int = 4,
    prepare: Callable[[GPT], None] = lambda model: None,
    repeat_first: bool = False,
    mixed: bool = False,
    grouped: bool = False,
    keep: bool = False,
) -> tuple[list[tuple[float, float]], float, float]:
    """Train ours and torch's fully_shard side by side: losses per step, largest gaps."""
    ours, theirs = gpt(repeat_first), gpt(repeat_first)
    prepare(ours)
    prepare(theirs)
    ours_options, theirs_options = _options(mixed, keep)
    _shard_ours(ours, mesh, grouped, **ours_options)
    _shard_theirs(theirs, mesh, grouped, **theirs_options)
    optimizers = [make_optimizer(ours.parameters()), make_optimizer(theirs.parameters())]
    losses: list[tuple[float, float]] = []
    gradient_gap = 0.0
    for step in range(steps):
        tokens, targets = batch(rank, step)
        mine, reference = loss_on(ours, tokens, targets), loss_on(theirs, tokens, targets)
        torch.autograd.backward(mine)
        torch.autograd.backward(reference)
        losses.append((mine.item(), reference.item()))
        gradient_gap = max(gradient_gap, largest_gap(full_gradients(ours), full_gradients(theirs)))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return losses, gradient_gap, largest_gap(full_parameters(ours), full_parameters(theirs))


def _against_one_process(
    rank: int, world_size: int, mesh: DeviceMesh
) -> tuple[float, list[tuple[int, int]]]:
    """Ours on per-rank batches against one process on the global batch, SGD with momentum.

    Not Adam: the attention key bias has a gradient of exactly zero in theory, so
    rounding noise of 1e-9 decides its sign, which Adam scales up to a full step.
    """
    ours, single = _shard_ours(gpt(), mesh), gpt()
    optimizers = [_sgd(ours.parameters()), _sgd(single.parameters())]
    for step in range(4):
        torch.autograd.backward(loss_on(ours, *batch(rank, step)))
        torch.autograd.backward(loss_on(single, *global_batch(world_size, step)))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    counts = [
        (record.forwards, record.backwards)
        for record in (fully_shard.state(ours), fully_shard.state(ours.blocks[1]))
    ]
    return largest_gap(full_parameters(ours), full_parameters(single)), counts


def _layout(mesh: DeviceMesh) -> Results:
    """Names, state_dict keys, placements and per-rank bytes after sharding."""
    plain, model = gpt(), _shard_ours(gpt(), mesh)
    parameters = list(model.parameters())
    local_bytes = sum(
        parameter.to_local().numel() * parameter.element_size()
        for parameter in parameters
        if isinstance(parameter, DTensor)
    )
    return {
        "names": [name for name, _ in model.named_parameters()]
        == [name for name, _ in plain.named_parameters()],
        "keys": list(model.state_dict()) == list(plain.state_dict()),
        "all_dtensor": all(
            isinstance(parameter, DTensor) and parameter.placements[0].is_shard(0)
            for parameter in parameters
        ),
        "tied": model.head.weight is model.embed.weight,
        "local_bytes": local_bytes,
        "full_bytes": sum(p.numel() * p.element_size() for p in plain.parameters()),
        "record": _plain(fully_shard.state(model)),
        "block_record": _plain(fully_shard.state(model.blocks[0])),
    }


def _plain(record: FullyShardState) -> tuple[tuple[str, ...], int | None, int, int, bool]:
    """What a test checks of a record, picklable without the mesh."""
    size = None if record.mesh is None else record.mesh.size()
    return record.managed, size, record.forwards, record.backwards, record.sync_gradients


def _unsharded_during_forward(rank: int, mesh: DeviceMesh) -> list[tuple[int, list[int], bool]]:
    """Inside each block's forward: which blocks, and whether the root, are unsharded."""
    model = _shard_ours(GPT(blocks=3), mesh)
    seen: list[tuple[int, list[int], bool]] = []

    def probe(index: int) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def record(module: nn.Module, args: tuple[Any, ...]) -> None:
            unsharded = [
                other
                for other, block in enumerate(model.blocks)
                if not isinstance(block.get_parameter("qkv.weight"), DTensor)
            ]
            seen.append((index, unsharded, not isinstance(model.norm.weight, DTensor)))

        return record

    for index, block in enumerate(model.blocks):
        block.register_forward_pre_hook(probe(index))  # runs after fully_shard's hook
    torch.autograd.backward(loss_on(model, *batch(rank, 0)))
    return seen


def _unshard_and_reshard(mesh: DeviceMesh) -> tuple[bool, bool, bool]:
    model = _shard_ours(gpt(), mesh)
    expected = full_parameters(model)["blocks.0.up.weight"]
    first, second = model.blocks[0], model.blocks[1]
    unshard(first)
    weight = first.get_parameter("up.weight")
    gathered = not isinstance(weight, DTensor) and torch.equal(weight, expected)
    others_sharded = isinstance(second.get_parameter("up.weight"), DTensor)
    reshard(first)
    return gathered, others_sharded, isinstance(first.get_parameter("up.weight"), DTensor)


def _no_sync(rank: int, mesh: DeviceMesh, mixed: bool = False) -> tuple[float, int, bool]:
    """Two local micro-batches then a synced one, against torch's gradient-sync switch."""
    ours_options, theirs_options = _options(mixed, keep=False)
    ours = _shard_ours(gpt(), mesh, **ours_options)
    theirs = _shard_theirs(gpt(), mesh, **theirs_options)
    assert isinstance(theirs, FSDPModule)
    with no_sync(ours):
        inside = fully_shard.state(ours.blocks[1]).sync_gradients
        for step in range(2):
            torch.autograd.backward(loss_on(ours, *batch(rank, step)))
    theirs.set_requires_gradient_sync(False)
    for step in range(2):
        torch.autograd.backward(loss_on(theirs, *batch(rank, step)))
    theirs.set_requires_gradient_sync(True)
    torch.autograd.backward(loss_on(ours, *batch(rank, 2)))
    torch.autograd.backward(loss_on(theirs, *batch(rank, 2)))
    gap = largest_gap(full_gradients(ours), full_gradients(theirs))
    return gap, fully_shard.state(ours).backwards, inside


def _freeze_norms(model: GPT) -> None:
    for block in model.blocks:
        block.norm1.requires_grad_(False)


def _checkpointed_gap(rank: int, mesh: DeviceMesh) -> float:
    """Checkpointed blocks give the gradients of unchecked ones."""
    checked, plain = gpt(), gpt()
    for block in checked.blocks:
        checkpoint(block)
    _shard_ours(checked, mesh)
    _shard_ours(plain, mesh)
    for step in range(2):
        torch.autograd.backward(loss_on(checked, *batch(rank, step)))
        torch.autograd.backward(loss_on(plain, *batch(rank, step)))
    return largest_gap(full_gradients(checked), full_gradients(plain))


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(5, 1)  # dim 0 smaller than the world: padding
        self.second = nn.Linear(1, 4)
        self.act = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.second(self.act(self.first(x)))
        return out


def _small_and_plain_inputs(
    rank: int, world_size: int, mesh: DeviceMesh
) -> tuple[float, tuple[str, ...]]:
    """Layers smaller than the world, float inputs without grad, an empty module; vs one process."""
    torch.manual_seed(1)
    ours = _Mlp()
    torch.manual_seed(1)
    single = _Mlp()
    fully_shard(ours.first, mesh=mesh)
    fully_shard(ours.act, mesh=mesh)  # no parameters: manages nothing
    fully_shard(ours, mesh=mesh)
    inputs = [
        torch.randn(4, 5, generator=torch.Generator().manual_seed(r)) for r in range(world_size)
    ]
    torch.autograd.backward(ours(inputs[rank]).pow(2).mean())
    torch.autograd.backward(single(torch.cat(inputs)).pow(2).mean())
    return largest_gap(full_gradients(ours), full_gradients(single)), fully_shard.state(
        ours.act
    ).managed


def _rule_messages(rank: int, mesh: DeviceMesh) -> list[str]:
    messages: list[str] = []
    attempts: list[Callable[[], object]] = []

    def replicate_then_ours() -> None:
        model = gpt()
        replicate(model.blocks[0])
        fully_shard(model, mesh=mesh)

    def ours_then_replicate() -> None:
        model = gpt()
        fully_shard(model.blocks[0], mesh=mesh)
        replicate(model)

    def torch_then_ours() -> None:
        model = gpt()
        torch_fully_shard(model.blocks[0], mesh=mesh)
        fully_shard(model, mesh=mesh)

    def ours_then_torch(rank: int = rank) -> None:
        model = gpt()
        fully_shard(model, mesh=mesh)
        torch_replicate(model.blocks[0])  # torch cannot see our rule: found at forward
        loss_on(model, *batch(rank, 0))

    attempts = [replicate_then_ours, ours_then_replicate, torch_then_ours, ours_then_torch]
    for attempt in attempts:
        try:
            attempt()
        except IncompatibleAPIError as error:
            messages.append(f"{type(error).__name__}: {error}")
    return messages


def _record_refusal(
    found: dict[str, str | bool], key: str, model: nn.Module, mesh: DeviceMesh
) -> None:
    """Apply fully_shard; record the error as ``key`` and whether nothing was changed."""
    before = list(model.parameters())
    try:
        fully_shard(model, mesh=mesh)
    except ContractError as error:
        found[key] = f"{type(error).__name__}: {error}"
    found[f"{key}_untouched"] = all(
        a is b for a, b in zip(model.parameters(), before, strict=True)
    ) and not fully_shard.is_applied(model)


def _bad_input_messages(mesh: DeviceMesh, world_size: int) -> dict[str, str | bool]:
    found: dict[str, str | bool] = {}
    model = gpt()
    before = list(model.parameters())
    cube = init_device_mesh("cpu", (1, 1, world_size))
    try:
        fully_shard(model, mesh=cube)
    except InvalidMeshError as error:
        found["mesh"] = f"{type(error).__name__}: {error}"
    found["mesh_untouched"] = (
        list(model.parameters()) == before and not fully_shard.is_applied(model)
    ) and all(not isinstance(p, DTensor) for p in model.parameters())

    model = gpt()
    up = model.blocks[1].get_submodule("up")
    up.weight = nn.Parameter(
        distribute_tensor(up.get_parameter("weight").detach(), mesh, [Replicate()])
    )
    _record_refusal(found, "dtensor", model, mesh)

    model = gpt()
    fully_shard(model, mesh=mesh)
    try:
        fully_shard(model.blocks[0], mesh=mesh)
    except AlreadyManagedError as error:
        found["managed"] = f"{type(error).__name__}: {error}"

    model = gpt()
    fully_shard(model.head, mesh=mesh)  # the head's weight is the embedding's
    fully_shard(model, mesh=mesh)  # shards it again, as FSDP2; refused at the first forward
    try:
        model(batch(0, 0)[0])
    except AlreadyManagedError as error:
        found["tied"] = f"{type(error).__name__}: {error}"

    model = gpt()
    model.blocks[1].register_parameter("scale", nn.Parameter(torch.tensor(1.0)))
    _record_refusal(found, "scalar", model, mesh)
    return found


def _deep_copy(rank: int, mesh: DeviceMesh) -> tuple[list[str], float]:
    """A deep copy is refused, as FSDP2 refuses it; the original keeps training as its twin.

    Returns each refusal (ours, then FSDP2's) as ``"Type: message"``, and the gradient gap.
    """
    model, twin = _shard_ours(gpt(), mesh), _shard_ours(gpt(), mesh)
    refusals: list[str] = []
    for sharded in (model, _shard_theirs(gpt(), mesh)):
        try:
            copy.deepcopy(sharded)
        except (ContractError, AssertionError) as error:
            refusals.append(f"{type(error).__name__}: {error}")
    torch.autograd.backward(loss_on(model, *batch(rank, 0)))
    torch.autograd.backward(loss_on(twin, *batch(rank, 0)))
    return refusals, largest_gap(full_gradients(model), full_gradients(twin))


def _state_dict_after_forward(rank: int, mesh: DeviceMesh) -> tuple[bool, bool, float, float]:
    """state_dict() and load_state_dict() see the shards even while the root is unsharded."""
    model = _shard_ours(gpt(), mesh)
    torch.manual_seed(5)
    other = _shard_ours(GPT(), mesh)
    tokens, targets = batch(rank, 0)
    with torch.no_grad():
        model(tokens)  # the root keeps its parameters unsharded after forward
    root_unsharded = not isinstance(model.norm.weight, DTensor)
    saved_shards = all(isinstance(value, DTensor) for value in model.state_dict().values())
    with torch.no_grad():
        model(tokens)
    model.load_state_dict(other.state_dict())
    loaded_gap = largest_gap(full_parameters(model), full_parameters(other))
    assigned = _shard_ours(gpt(), mesh)
    assigned.load_state_dict(other.state_dict(), assign=True)
    with torch.no_grad():
        loss_gap = abs(
            loss_on(assigned, tokens, targets).item() - loss_on(other, tokens, targets).item()
        )
    return root_unsharded, saved_shards, loaded_gap, loss_gap


def _freed_after_training(rank: int, mesh: DeviceMesh) -> tuple[bool, bool]:
    """Dropped after training: the model, and the sharded parameters, by reference counting."""
    model = _shard_ours(gpt(), mesh)
    optimizer = _adam(model.parameters())
    torch.autograd.backward(loss_on(model, *batch(rank, 0)))
    optimizer.step()
    alive = weakref.ref(model)
    shard = weakref.ref(model.blocks[0].get_parameter("up.weight"))
    gc.collect()
    gc.disable()
    try:
        del model, optimizer
        return alive() is None, shard() is None
    finally:
        gc.enable()


@contract()
def _shard_then_fail(module: nn.Module, mesh: DeviceMesh) -> None:
    fully_shard(module, mesh=mesh)
    raise ValueError("planned failure after fully_shard sharded the module")


def _rolled_back(rank: int, mesh: DeviceMesh) -> tuple[bool, bool, float]:
    """An apply rolled back by the API around it puts the parameters back, hooks off."""
    model, plain = gpt(), gpt()
    before = list(model.parameters())
    with contextlib.suppress(ValueError):
        _shard_then_fail(model, mesh)
    restored = all(a is b for a, b in zip(model.parameters(), before, strict=True))
    torch.autograd.backward(loss_on(model, *batch(rank, 0)))
    torch.autograd.backward(loss_on(plain, *batch(rank, 0)))
    gap = largest_gap(full_gradients(model), full_gradients(plain))
    return fully_shard.is_applied(model), restored, gap


def _checkpoint_round_trip(rank: int, world_size: int, mesh: DeviceMesh, directory: str) -> Results:
    """Save model and optimizer with DCP, load into a fresh sharded model, continue both.

    SGD with momentum, whose state is sharded like the parameters; the full state
    dict is compared with one process (see ``_against_one_process`` for why not Adam).
    """
    model = _shard_ours(gpt(), mesh)
    optimizer = _sgd(model.parameters())
    single = gpt()
    single_optimizer = _sgd(single.parameters())
    for step in range(2):
        torch.autograd.backward(loss_on(model, *batch(rank, step)))
        optimizer.step()
        optimizer.zero_grad()
        torch.autograd.backward(loss_on(single, *global_batch(world_size, step)))
        single_optimizer.step()
        single_optimizer.zero_grad()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp_save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)

    restored = _shard_ours(gpt(), mesh)
    restored_optimizer = _sgd(restored.parameters())
    model_state, optimizer_state = get_state_dict(restored, restored_optimizer)
    dcp_load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)
    set_state_dict(
        restored,
        restored_optimizer,
        model_state_dict=model_state,
        optim_state_dict=optimizer_state,
    )
    losses: list[tuple[float, float]] = []
    for step in range(2, 4):
        pair = []
        for each, each_optimizer in ((model, optimizer), (restored, restored_optimizer)):
            loss = loss_on(each, *batch(rank, step))
            torch.autograd.backward(loss)
            each_optimizer.step()
            each_optimizer.zero_grad()
            pair.append(loss.item())
        losses.append((pair[0], pair[1]))
    full_state, _ = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    for step in range(2, 4):
        torch.autograd.backward(loss_on(single, *global_batch(world_size, step)))
        single_optimizer.step()
        single_optimizer.zero_grad()
    full = {name: value for name, value in full_state.items() if isinstance(value, Tensor)}
    reference = single.state_dict()
    return {
        "losses": losses,
        "keys": sorted(full) == sorted(reference),
        "full_gap": max(float((full[k] - reference[k]).abs().max()) for k in full),
        "all_plain": all(not isinstance(value, DTensor) for value in full.values()),
    }


def _job(rank: int, world_size: int, directory: str) -> Results:
    mesh = init_device_mesh("cpu", (world_size,))
    results: Results = {}
    if REFERENCE_FULLY_SHARD_ON_CPU:
        results["adam"] = _against_torch(rank, mesh, _adam)
        results["sgd"] = _against_torch(rank, mesh, _sgd, steps=3)
        results["adamw"] = _against_torch(rank, mesh, _adamw, steps=3)
        results["frozen"] = _against_torch(rank, mesh, _adam, steps=3, prepare=_freeze_norms)
        results["twice"] = _against_torch(rank, mesh, _adam, steps=3, repeat_first=True)
        results["mixed"] = _against_torch(rank, mesh, _adam, steps=3, mixed=True)
        results["grouped"] = _against_torch(rank, mesh, _adam, steps=3, grouped=True)
        results["kept"] = _against_torch(rank, mesh, _adam, steps=3, keep=True)
        results["no_sync"] = _no_sync(rank, mesh)
        results["no_sync_mixed"] = _no_sync(rank, mesh, mixed=True)
    results["one_process"] = _against_one_process(rank, world_size, mesh)
    results["layout"] = _layout(mesh)
    results["unsharded"] = _unsharded_during_forward(rank, mesh)
    results["small"] = _small_and_plain_inputs(rank, world_size, mesh)
    results["freed"] = _freed_after_training(rank, mesh)
    results["rolled_back"] = _rolled_back(rank, mesh)
    results["state_dict"] = _state_dict_after_forward(rank, mesh)
    results["deep_copy"] = _deep_copy(rank, mesh)
    results["unshard"] = _unshard_and_reshard(mesh)
    results["checkpointed"] = _checkpointed_gap(rank, mesh)
    results["rules"] = _rule_messages(rank, mesh)
    results["bad_input"] = _bad_input_messages(mesh, world_size)
    results["dcp"] = _checkpoint_round_trip(rank, world_size, mesh, directory)
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=["2_ranks", "3_ranks"])
def ranks(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[Results]:
    world_size: int = request.param
    directory = tmp_path_factory.mktemp(f"dcp_{world_size}")
    return run_distributed(_job, world_size, timeout=150.0, args=(str(directory),))


def _each(ranks: list[Results], key: str) -> list[Any]:
    """Every rank's result of scenario ``key``."""
    return [rank[key] for rank in ranks]


def _close(mine: float, theirs: float) -> bool:
    return abs(mine - theirs) <= max(TOLERANCE, RELATIVE * abs(theirs))


# ----------------------------------------------------------------- parity


@needs_reference
def test_losses_and_parameters_match_torch_fully_shard_with_adam(ranks: list[Results]) -> None:
    for losses, gradient_gap, parameter_gap in _each(ranks, "adam"):
        assert all(_close(mine, theirs) for mine, theirs in losses)
        assert gradient_gap <= TOLERANCE
        assert parameter_gap <= TOLERANCE


@needs_reference
def test_ranks_see_different_data(ranks: list[Results]) -> None:
    first_losses = [losses[0][0] for losses, _, _ in _each(ranks, "adam")]
    assert len(set(first_losses)) == len(first_losses)


def test_parameters_match_one_process_on_the_global_batch(ranks: list[Results]) -> None:
    for gap, _ in _each(ranks, "one_process"):
        assert gap <= 1e-5


def test_records_count_forward_and_backward_passes(ranks: list[Results]) -> None:
    for _, counts in _each(ranks, "one_process"):
        assert counts == [(4, 4), (4, 4)]


@needs_reference
@pytest.mark.parametrize(
    "scenario", ["sgd", "adamw", "frozen", "twice", "mixed", "grouped", "kept"]
)
def test_variants_match_torch_fully_shard(ranks: list[Results], scenario: str) -> None:
    """SGD with momentum, AdamW, frozen norms, a block called twice, bfloat16 mixed
    precision, both blocks as one group, and parameters kept unsharded after forward."""
    for losses, gradient_gap, parameter_gap in _each(ranks, scenario):
        assert all(_close(mine, theirs) for mine, theirs in losses)
        assert gradient_gap <= TOLERANCE
        assert parameter_gap <= TOLERANCE


@needs_reference
def test_mixed_precision_runs_in_bfloat16(ranks: list[Results]) -> None:
    """The bfloat16 losses are not the float32 ones (same model, same first batch)."""
    for mixed, full in zip(_each(ranks, "mixed"), _each(ranks, "adam"), strict=True):
        assert mixed[0][0][0] != full[0][0][0]
        assert abs(mixed[0][0][0] - full[0][0][0]) < 0.1


# ----------------------------------------------------------------- layout and record


def test_names_and_state_dict_keys_are_unchanged(ranks: list[Results]) -> None:
    for layout in _each(ranks, "layout"):
        assert layout["names"]
        assert layout["keys"]
        assert layout["tied"]


def test_every_parameter_is_a_dim_0_sharded_dtensor(ranks: list[Results]) -> None:
    assert all(layout["all_dtensor"] for layout in _each(ranks, "layout"))


def test_each_rank_stores_about_its_share_of_the_parameters(ranks: list[Results]) -> None:
    layouts = _each(ranks, "layout")
    world_size = len(layouts)
    full = layouts[0]["full_bytes"]
    assert sum(layout["local_bytes"] for layout in layouts) == full
    for layout in layouts:
        assert layout["local_bytes"] <= full / world_size * 1.25


def test_record_holds_mesh_managed_fqns_and_counts(ranks: list[Results]) -> None:
    for layout in _each(ranks, "layout"):
        managed, mesh_size, forwards, backwards, sync = layout["record"]
        # named_parameters() order: the root's own parameter first; the head's tied weight once
        assert managed == ("position", "embed.weight", "norm.weight", "norm.bias")
        assert mesh_size == len(ranks)
        assert (forwards, backwards, sync) == (0, 0, True)
        assert layout["block_record"][0][:2] == ("norm1.weight", "norm1.bias")


def test_at_most_one_block_and_the_root_are_unsharded_in_forward(ranks: list[Results]) -> None:
    for seen in _each(ranks, "unsharded"):
        assert [index for index, _, _ in seen] == [0, 1, 2]
        for index, unsharded, root_unsharded in seen:
            assert unsharded == [index]
            assert root_unsharded


def test_small_layers_plain_inputs_and_empty_modules_match_one_process(
    ranks: list[Results],
) -> None:
    for gap, empty_managed in _each(ranks, "small"):
        assert gap <= 1e-6
        assert empty_managed == ()


def test_model_and_shards_are_freed_without_garbage_collection(ranks: list[Results]) -> None:
    for model_freed, shard_freed in _each(ranks, "freed"):
        assert model_freed
        assert shard_freed


def test_a_rolled_back_apply_restores_the_parameters_and_stays_local(
    ranks: list[Results],
) -> None:
    for applied, restored, gap in _each(ranks, "rolled_back"):
        assert not applied
        assert restored
        assert gap == 0.0


# ----------------------------------------------------------------- features


@needs_reference
@pytest.mark.parametrize("scenario", ["no_sync", "no_sync_mixed"])
def test_no_sync_accumulates_locally_then_matches_torch(
    ranks: list[Results], scenario: str
) -> None:
    """Also in bfloat16, where both keep the unreduced gradients in the reduce dtype."""
    for gap, backwards, sync_inside in _each(ranks, scenario):
        assert gap <= TOLERANCE
        assert backwards == 1
        assert sync_inside is False


def test_unshard_gathers_one_group_and_reshard_frees_it(ranks: list[Results]) -> None:
    for gathered, others_sharded, sharded_again in _each(ranks, "unshard"):
        assert gathered
        assert others_sharded
        assert sharded_again


def test_checkpointed_blocks_give_unchanged_gradients(ranks: list[Results]) -> None:
    for gap in _each(ranks, "checkpointed"):
        assert gap <= TOLERANCE


def test_replicate_and_torch_fully_shard_are_refused_in_either_order(
    ranks: list[Results],
) -> None:
    for first, second, third, fourth in _each(ranks, "rules"):
        assert first.startswith("IncompatibleAPIError: torchcontract.apis.fully_shard")
        assert "replicate" in first
        assert "on Block 'blocks.0', inside GPT" in first
        assert second.startswith("IncompatibleAPIError: torchcontract.apis.replicate.replicate")
        assert "fully_shard" in second
        assert third.startswith("IncompatibleAPIError: torchcontract.apis.fully_shard")
        assert "torch's fully_shard" in third
        assert fourth.startswith("IncompatibleAPIError: torchcontract.apis.fully_shard")
        assert "torch's replicate, applied after it on DDPBlock 'blocks.0' inside GPT" in fourth


def test_bad_input_is_refused_naming_the_module_and_changing_nothing(
    ranks: list[Results],
) -> None:
    for found in _each(ranks, "bad_input"):
        assert found["mesh"].startswith(
            "InvalidMeshError: fully_shard on GPT: expected a 1-D mesh (sharding) or a 2-D"
        )
        assert found["mesh_untouched"]
        assert found["dtensor"].startswith("AlreadyManagedError: fully_shard on GPT")
        assert "'blocks.1.up.weight' is already a DTensor" in found["dtensor"]
        assert found["dtensor_untouched"]
        assert found["managed"].startswith("AlreadyManagedError: fully_shard on Block")
        assert "already managed by fully_shard on GPT" in found["managed"]
        assert found["tied"].startswith(
            "AlreadyManagedError: fully_shard on GPT: parameter 'head.weight' is sharded by two "
            "applications of fully_shard"
        )
        assert (
            "Parameter 'head.weight' is shared with a parameter already managed" in (found["tied"])
        )
        assert found["scalar"].startswith(
            "ScalarParameterError: fully_shard on GPT: parameter 'blocks.1.scale' is a scalar"
        )
        assert found["scalar_untouched"]


def test_a_deep_copy_is_refused_as_torch_refuses_it(ranks: list[Results]) -> None:
    for (ours, *theirs), gradient_gap in _each(ranks, "deep_copy"):
        assert ours.startswith("ContractError: fully_shard on GPT: a sharded module cannot be")
        assert "save its state dict" in ours
        assert theirs == [
            "AssertionError: FSDP does not support deepcopy. Please use state dict "
            "for serialization."
        ]
        assert gradient_gap == 0.0


def test_state_dict_and_load_see_the_shards_while_the_root_is_unsharded(
    ranks: list[Results],
) -> None:
    for root_unsharded, saved_shards, loaded_gap, loss_gap in _each(ranks, "state_dict"):
        assert root_unsharded
        assert saved_shards
        assert loaded_gap == 0.0
        assert loss_gap == 0.0


# ----------------------------------------------------------------- checkpoints


def test_distributed_checkpoint_round_trip_continues_with_the_same_losses(
    ranks: list[Results],
) -> None:
    for result in _each(ranks, "dcp"):
        assert all(abs(mine - theirs) <= TOLERANCE for mine, theirs in result["losses"])


def test_full_state_dict_equals_the_one_process_model(ranks: list[Results]) -> None:
    for result in _each(ranks, "dcp"):
        assert result["keys"]
        assert result["all_plain"]
        assert result["full_gap"] <= 1e-5


# ----------------------------------------------------------------- collectives


def _reduce_scatter_rank_values(rank: int, world_size: int) -> list[float]:
    """Each rank offers ``10 * rank + i`` at position ``i``; its averaged slice of two."""
    group = dist.group.WORLD
    assert group is not None
    offered = torch.arange(2 * world_size, dtype=torch.float32) + 10 * rank
    mine = torch.empty(2)
    _torch.reduce_scatter_average(mine, offered, group)
    return mine.tolist()


@pytest.mark.parametrize("world_size", [2, 3])
def test_reduce_scatter_averages_on_every_torch(world_size: int) -> None:
    """torch 2.6's gloo sums when asked for ``ReduceOp.AVG`` here: fully_shard's
    gradients were the sum over ranks there, until this averaged by itself."""
    slices = run_distributed(_reduce_scatter_rank_values, world_size, timeout=60.0)
    mean_offset = 10 * (world_size - 1) / 2
    assert slices == [[2 * r + mean_offset, 2 * r + 1 + mean_offset] for r in range(world_size)]


# ----------------------------------------------------------------- in this process, no ranks


def test_fully_shard_without_a_process_group_fails_and_changes_nothing() -> None:
    assert not dist.is_initialized()
    model = gpt()
    before = list(model.parameters())
    with pytest.raises(NoProcessGroupError, match=r"fully_shard on GPT: no default process group"):
        fully_shard(model)
    assert not fully_shard.is_applied(model)
    assert all(a is b for a, b in zip(model.parameters(), before, strict=True))


def test_unshard_without_fully_shard_raises_not_applied() -> None:
    with pytest.raises(NotAppliedError, match=r"fully_shard is not applied to Block"):
        unshard(Block())


def test_no_sync_without_fully_shard_or_replicate_raises_not_applied() -> None:
    context = no_sync(Block())
    with pytest.raises(
        NotAppliedError, match=r"no_sync: neither replicate nor fully_shard is applied to Block"
    ):
        context.__enter__()
