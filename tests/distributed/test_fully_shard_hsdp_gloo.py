"""fully_shard's HSDP on 4 gloo ranks, a 2 x 2 mesh (replicate, shard), against FSDP2's.

One job, a tiny model and a few steps (4 ranks share the machine's cores): losses,
gradients and parameters after Adam steps, the placements and bytes each rank
holds, and the state dicts (full, sharded, through DCP) against FSDP2's. The same
job checks ``reshard_after_forward=2`` on a 1-D mesh of 4 (FSDP2's post-forward
mesh), which needs 4 ranks too: what is registered after forward, the group
backward gathers over, and the numbers, against FSDP2.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fully_shard_models import (
    GPT,
    batch,
    full_gradients,
    full_parameters,
    global_batch,
    largest_gap,
    loss_on,
    needs_reference_fully_shard,
)
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchcontract.apis import fully_shard
from torchcontract.apis.fully_shard import _group
from torchcontract.testing import run_distributed

Results = dict[str, Any]
STEPS = 3
TOLERANCE = 1e-6

pytestmark = needs_reference_fully_shard


def _model(mesh: DeviceMesh, torch_api: bool) -> GPT:
    torch.manual_seed(0)
    model = GPT(blocks=2)
    shard = torch_fully_shard if torch_api else fully_shard
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def _local_bytes(model: nn.Module) -> int:
    return sum(
        parameter.to_local().numel() * parameter.element_size()
        for parameter in model.parameters()
        if isinstance(parameter, DTensor)
    )


def _largest_tensor_gap(mine: dict[str, Any], theirs: dict[str, Any]) -> float:
    def local(value: object) -> Tensor:
        assert isinstance(value, Tensor)
        return value.to_local() if isinstance(value, DTensor) else value

    return largest_gap(
        {name: local(value) for name, value in mine.items()},
        {name: local(value) for name, value in theirs.items()},
    )


def _registered(model: GPT) -> list[tuple[str, tuple[int, ...], str, tuple[int, ...], int]]:
    """Each block parameter as registered now: type, mesh shape, placements, local shape, bytes."""
    found = []
    for name, parameter in model.blocks.named_parameters():
        if isinstance(parameter, DTensor):
            local = parameter.to_local()
            found.append(
                (
                    f"{name} DTensor",
                    tuple(parameter.device_mesh.shape),
                    str(parameter.placements),
                    tuple(local.shape),
                    local.numel() * local.element_size(),
                )
            )
        else:
            found.append((f"{name} {type(parameter).__name__}", (), "", tuple(parameter.shape), 0))
    return found


def _post_forward(rank: int) -> Results:
    """``reshard_after_forward=2`` on a 1-D mesh of 4, ours and FSDP2's side by side."""
    mesh = init_device_mesh("cpu", (4,))
    models = []
    for shard in (fully_shard, torch_fully_shard):
        torch.manual_seed(0)
        model = GPT(blocks=2)
        for block in model.blocks:
            shard(block, mesh=mesh, reshard_after_forward=2)
        shard(model, mesh=mesh)
        models.append(model)
    ours, theirs = models
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    gathers: list[tuple[int, bool]] = []
    patched: Any = _group
    original = patched.start_all_gather

    def start(parameters: Any, group: Any, *, async_op: bool, post_forward: bool = False) -> Any:
        gathers.append((group.size(), post_forward))
        return original(parameters, group, async_op=async_op, post_forward=post_forward)

    results: Results = {"losses": []}
    for step in range(STEPS):
        tokens, targets = batch(rank, step)
        losses = [loss_on(model, tokens, targets) for model in models]
        if step == 0:
            results["registered"] = (_registered(ours), _registered(theirs))
        patched.start_all_gather = start
        try:
            torch.autograd.backward(losses[0])
        finally:
            patched.start_all_gather = original
        torch.autograd.backward(losses[1])
        results["losses"].append((losses[0].item(), losses[1].item()))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    results["backward_gathers"] = gathers
    results["parameter_gap"] = largest_gap(full_parameters(ours), full_parameters(theirs))
    return results


def _set_after_int(rank: int, value: bool) -> Results:
    """``reshard_after_forward=2`` on a mesh of 4, then ``set_reshard_after_forward(value)``.

    As FSDP2's, the bool replaces the int's post-forward mesh: ``True`` frees the
    parameters to the full mesh's shards after forward, ``False`` keeps them.
    """
    mesh = init_device_mesh("cpu", (4,))
    models = []
    for shard in (fully_shard, torch_fully_shard):
        torch.manual_seed(0)
        model = GPT(blocks=2)
        for block in model.blocks:
            shard(block, mesh=mesh, reshard_after_forward=2)
        shard(model, mesh=mesh)
        for block in model.blocks:
            assert isinstance(block, FSDPModule)
            block.set_reshard_after_forward(value)
        models.append(model)
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    results: Results = {}
    for step in range(2):
        losses = [loss_on(model, *batch(rank, step)) for model in models]
        if step == 0:
            results["registered"] = (_registered(models[0]), _registered(models[1]))
        for loss in losses:
            torch.autograd.backward(loss)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    results["parameter_gap"] = largest_gap(*(full_parameters(model) for model in models))
    return results


def _signs(tensor: Tensor) -> None:
    """Not linear: before the all-reduce it would average signs, not take the average's sign."""
    tensor.copy_(tensor.sign() * 0.01)


def _all_reduce_hook(rank: int, mesh: DeviceMesh) -> float:
    """``set_all_reduce_hook`` under HSDP: called on the all-reduced shards, as FSDP2's."""
    models = [_model(mesh, False), _model(mesh, True)]
    for model in models:
        for module in (*model.blocks, model):
            assert isinstance(module, FSDPModule)
            module.set_all_reduce_hook(_signs)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step in range(2):
        for model, optimizer in zip(models, optimizers, strict=True):
            torch.autograd.backward(loss_on(model, *batch(rank, step)))
            optimizer.step()
            optimizer.zero_grad()
    return largest_gap(full_parameters(models[0]), full_parameters(models[1]))


def _job(rank: int, world_size: int, directory: str) -> Results:
    post_forward = _post_forward(rank)
    set_after_int = {value: _set_after_int(rank, value) for value in (True, False)}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ours, theirs = _model(mesh, False), _model(mesh, True)
    results: Results = {
        "post_forward": post_forward,
        "set_after_int": set_after_int,
        "placements": {
            str(parameter.placements)
            for parameter in ours.parameters()
            if isinstance(parameter, DTensor)
        },
        "all_dtensor": all(isinstance(parameter, DTensor) for parameter in ours.parameters()),
        "same_local_shapes": [
            mine.to_local().shape == reference.to_local().shape
            for mine, reference in zip(ours.parameters(), theirs.parameters(), strict=True)
            if isinstance(mine, DTensor) and isinstance(reference, DTensor)
        ],
        "bytes": (_local_bytes(ours), _local_bytes(theirs)),
        "full_bytes": sum(p.numel() * p.element_size() for p in GPT(blocks=2).parameters()),
    }
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    losses: list[tuple[float, float]] = []
    gradient_gap = 0.0
    for step in range(STEPS):
        tokens, targets = batch(rank, step)
        mine, reference = loss_on(ours, tokens, targets), loss_on(theirs, tokens, targets)
        torch.autograd.backward(mine)
        torch.autograd.backward(reference)
        losses.append((mine.item(), reference.item()))
        gradient_gap = max(gradient_gap, largest_gap(full_gradients(ours), full_gradients(theirs)))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    results["losses"] = losses
    results["gradient_gap"] = gradient_gap
    results["parameter_gap"] = largest_gap(full_parameters(ours), full_parameters(theirs))
    # The gradient of every rank's batch reaches every replica: one process on the
    # global batch computes the same averaged gradient (SGD: no Adam scaling of noise).
    results["global_gap"] = _against_one_process(rank, world_size, mesh)
    results["hook_gap"] = _all_reduce_hook(rank, mesh)

    full = StateDictOptions(full_state_dict=True)
    mine_full = get_model_state_dict(ours, options=full)
    theirs_full = get_model_state_dict(theirs, options=full)
    results["full_keys"] = list(mine_full) == list(theirs_full)
    results["full_gap"] = _largest_tensor_gap(mine_full, theirs_full)
    results["full_plain"] = all(not isinstance(value, DTensor) for value in mine_full.values())
    mine_sharded, theirs_sharded = get_model_state_dict(ours), get_model_state_dict(theirs)
    results["sharded_gap"] = _largest_tensor_gap(mine_sharded, theirs_sharded)
    results["sharded_placements"] = {
        str(value.placements) for value in mine_sharded.values() if isinstance(value, DTensor)
    }

    # DCP: save ours, train one more step (changes it), load: back to what was saved.
    saved = full_parameters(ours)
    dcp_save(mine_sharded, checkpoint_id=directory)
    torch.autograd.backward(loss_on(ours, *batch(rank, STEPS)))
    optimizers[0].step()
    optimizers[0].zero_grad()
    results["changed"] = largest_gap(full_parameters(ours), saved) > 0
    loaded = get_model_state_dict(ours)
    dcp_load(loaded, checkpoint_id=directory)
    set_model_state_dict(ours, loaded)
    results["dcp_gap"] = largest_gap(full_parameters(ours), saved)
    # A full state dict loads too (broadcast from rank 0, as DCP's helpers do).
    set_model_state_dict(
        ours, mine_full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    results["full_load_gap"] = largest_gap(full_parameters(ours), saved)
    # Loaded state trains on: one more step of both, as before.
    tokens, targets = batch(rank, STEPS + 1)
    after = [loss_on(model, tokens, targets) for model in (ours, theirs)]
    for loss in after:
        torch.autograd.backward(loss)
    results["after_load"] = (after[0].item(), after[1].item())
    return results


def _against_one_process(rank: int, world_size: int, mesh: DeviceMesh) -> float:
    torch.manual_seed(0)
    sharded, single = _model(mesh, False), GPT(blocks=2)
    single.load_state_dict(
        {name: value.full_tensor() for name, value in sharded.state_dict().items()}
    )
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (sharded, single)]
    for step in range(2):
        torch.autograd.backward(loss_on(sharded, *batch(rank, step)))
        torch.autograd.backward(loss_on(single, *global_batch(world_size, step)))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return largest_gap(full_parameters(sharded), full_parameters(single))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Results]:
    directory = tmp_path_factory.mktemp("hsdp_checkpoint")
    return run_distributed(_job, 4, timeout=150.0, args=(str(directory),))


def test_hsdp_shards_on_the_inner_dim_and_replicates_on_the_outer(ranks: list[Results]) -> None:
    for results in ranks:
        assert results["all_dtensor"]
        assert results["placements"] == {str((Replicate(), Shard(0)))}
        assert all(results["same_local_shapes"])


def test_hsdp_holds_the_bytes_torch_fully_shard_holds_per_rank(ranks: list[Results]) -> None:
    for results in ranks:
        mine, theirs = results["bytes"]
        assert mine == theirs
        assert mine < results["full_bytes"] * 0.6  # about half: sharded over 2, not 4 or 1


def test_hsdp_losses_gradients_and_parameters_match_torch_with_adam(
    ranks: list[Results],
) -> None:
    for results in ranks:
        assert all(abs(mine - theirs) <= TOLERANCE for mine, theirs in results["losses"])
        assert results["gradient_gap"] <= TOLERANCE
        assert results["parameter_gap"] <= TOLERANCE
    first_losses = {results["losses"][0][0] for results in ranks}
    assert len(first_losses) == 4  # every rank trained on its own batch


def test_hsdp_averages_gradients_over_all_four_ranks(ranks: list[Results]) -> None:
    for results in ranks:
        assert results["global_gap"] <= 1e-5


def test_hsdp_all_reduce_hook_acts_as_torch_fully_shard(ranks: list[Results]) -> None:
    for results in ranks:
        assert results["hook_gap"] <= TOLERANCE


def test_hsdp_state_dicts_equal_torch_fully_shard(ranks: list[Results]) -> None:
    for results in ranks:
        assert results["full_keys"]
        assert results["full_plain"]
        assert results["full_gap"] <= TOLERANCE
        assert results["sharded_gap"] <= TOLERANCE
        assert results["sharded_placements"] == {str((Replicate(), Shard(0)))}


def test_hsdp_checkpoint_round_trips_through_dcp_and_full_state_dict(
    ranks: list[Results],
) -> None:
    for results in ranks:
        assert results["changed"]
        assert results["dcp_gap"] == 0.0
        assert results["full_load_gap"] == 0.0
        mine, theirs = results["after_load"]
        assert abs(mine - theirs) <= TOLERANCE


def test_reshard_after_forward_2_registers_what_torch_registers_after_forward(
    ranks: list[Results],
) -> None:
    """Each rank keeps 1/2 of the rows, on a (2, 2) post-forward mesh, as FSDP2."""
    for results in ranks:
        mine, theirs = results["post_forward"]["registered"]
        assert mine == theirs
        assert all(entry[1] == (2, 2) for entry in mine)
        assert {entry[2] for entry in mine} == {str((Replicate(), Shard(0)))}


def test_reshard_after_forward_2_gathers_over_2_ranks_in_backward(ranks: list[Results]) -> None:
    """Backward gathers the two blocks over the post-forward group of 2, not the mesh of 4."""
    for results in ranks:
        assert results["post_forward"]["backward_gathers"] == [(2, True), (2, True)] * STEPS


def test_reshard_after_forward_2_trains_as_torch_fully_shard(ranks: list[Results]) -> None:
    for results in ranks:
        losses = results["post_forward"]["losses"]
        assert all(abs(mine - theirs) <= TOLERANCE for mine, theirs in losses)
        assert results["post_forward"]["parameter_gap"] <= TOLERANCE


@pytest.mark.parametrize("value", [True, False])
def test_set_reshard_after_forward_replaces_an_int_as_torch(
    ranks: list[Results], value: bool
) -> None:
    for results in ranks:
        found = results["set_after_int"][value]
        mine, theirs = found["registered"]
        assert mine == theirs
        if value:  # the full mesh's shards, not a share of a group of 2
            assert all(entry[1] == (4,) and entry[2] == "(Shard(dim=0),)" for entry in mine)
        else:
            assert all(entry[0].endswith("Parameter") for entry in mine)
        assert found["parameter_gap"] <= TOLERANCE
