"""fully_shard with tensor parallelism on 4 gloo ranks, a 2 x 2 mesh (dp, tp), against FSDP2.

``parallelize_module`` on ``mesh["tp"]``, then ``fully_shard`` on ``mesh["dp"]``, ours
and FSDP2's side by side on the same seed and data: an MLP stack and a tiny Hugging
Face Llama. One job measures placements and bytes, losses, gradients, parameters
after AdamW steps, ``clip_grad_norm_``, mixed precision with explicit prefetch, the
state dicts and DCP; a checkpoint saved under ``(dp, tp)`` is then loaded by plain
1-D ``fully_shard`` on 2 ranks, and what those save is loaded back under ``(dp, tp)``.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fully_shard_models import full_parameters, largest_gap, needs_reference_fully_shard
from tensor_parallel_models import (
    IN,
    MLP,
    MLP_PLAN,
    dim_1_of_matrices,
    llama_batch,
    llama_loss,
    local_tensors,
    mlp_batch,
    mlp_loss,
    mlp_stack,
    placements,
    sequence_batch,
    sequence_parallel_mlp,
    sharded_llama,
    sharded_mlp,
    tensors,
    tiny_llama,
    train_side_by_side,
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
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from torchcontract.apis import _torch, fully_shard
from torchcontract.testing import run_distributed

Results = dict[str, Any]
Ranks = tuple[list[Results], list[float], list[float]]
STEPS = 3
TOLERANCE = 1e-6
FULL = StateDictOptions(full_state_dict=True)

pytestmark = needs_reference_fully_shard


def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _layout(model: nn.Module) -> list[tuple[str, str, tuple[int, ...], tuple[int, ...], int]]:
    """Each parameter: placements, mesh shape, local shape and bytes on this rank."""
    found = []
    for name, parameter in model.named_parameters():
        assert isinstance(parameter, DTensor), name
        local = parameter.to_local()
        found.append(
            (
                name,
                str(parameter.placements),
                tuple(parameter.device_mesh.shape),
                tuple(local.shape),
                local.numel() * local.element_size(),
            )
        )
    return found


def _against_one_process(
    dp_rank: int, sharded: nn.Module, single: nn.Module, loss_of: Any, batch_of: Any
) -> float:
    """SGD under (dp, tp) against one process on both dp ranks' inputs: the same averages."""
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (sharded, single)]
    for step in range(2):
        torch.autograd.backward(loss_of(sharded, batch_of(dp_rank, step)))
        torch.autograd.backward(loss_of(single, torch.cat([batch_of(0, step), batch_of(1, step)])))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return largest_gap(full_parameters(sharded), full_parameters(single))


def _mixed_precision(dp_rank: int, mesh: DeviceMesh) -> Results:
    """bf16 parameters, fp32 reduction, blocks kept after forward and explicit prefetch."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models = []
    for shard in (fully_shard, torch_fully_shard):
        model = sharded_mlp(
            shard, mesh["dp"], mesh["tp"], mp_policy=policy, reshard_after_forward=False
        )
        first, second = model[0], model[1]
        assert isinstance(first, FSDPModule)
        assert isinstance(second, FSDPModule)
        first.set_modules_to_forward_prefetch([second])
        second.set_modules_to_backward_prefetch([first])
        models.append(model)
    results = train_side_by_side(models, mlp_loss, mlp_batch, dp_rank, STEPS)
    results["unsharded"] = []
    for model in models:  # the unsharded parameter: the TP DTensor in the parameter dtype
        block = model[0]
        assert isinstance(block, FSDPModule)
        block.unshard()
        weight = model[0].get_submodule("up").get_parameter("weight")
        assert isinstance(weight, DTensor)
        shape = tuple(weight.to_local().shape)
        results["unsharded"].append((str(weight.placements), weight.dtype, shape))
        block.reshard()
    return results


def _dim_1(dp_rank: int, mesh: DeviceMesh) -> Results:
    """``shard_placement_fn`` returning ``Shard(1)`` for the matrices, under TP."""
    models = [
        sharded_mlp(
            shard,
            mesh["dp"],
            mesh["tp"],
            features=8,
            hidden=12,
            shard_placement_fn=dim_1_of_matrices,
        )
        for shard in (fully_shard, torch_fully_shard)
    ]
    results = train_side_by_side(models, mlp_loss, partial(mlp_batch, features=8), dp_rank, STEPS)
    results["layout"] = (_layout(models[0]), _layout(models[1]))
    return results


def _collectives(dp_rank: int, mesh: DeviceMesh) -> Results:
    """The all-gathers and reduce-scatters of one step: (kind, group's ranks, elements)."""
    model = sharded_mlp(fully_shard, mesh["dp"], mesh["tp"])
    issued: list[tuple[str, list[int], int]] = []
    patched: Any = _torch
    originals = (
        patched.all_gather_into,
        patched.all_gather_into_async,
        patched.reduce_scatter_average,
    )

    def recorder(kind: str, collective: Any) -> Any:
        def recorded(output: Tensor, input: Tensor, group: dist.ProcessGroup) -> Any:
            issued.append((kind, dist.get_process_group_ranks(group), input.numel()))
            return collective(output, input, group)

        return recorded

    patched.all_gather_into = recorder("all_gather", originals[0])
    patched.all_gather_into_async = recorder("all_gather", originals[1])
    patched.reduce_scatter_average = recorder("reduce_scatter", originals[2])
    try:
        torch.autograd.backward(mlp_loss(model, mlp_batch(dp_rank, 0)))
    finally:
        (
            patched.all_gather_into,
            patched.all_gather_into_async,
            patched.reduce_scatter_average,
        ) = originals
    # Each block's padded shards, from its TP-local shapes: rows split over 2 dp ranks.
    tensor_parallel = parallelize_module(mlp_stack()[0], mesh["tp"], MLP_PLAN)
    block = [
        -(-parameter.to_local().shape[0] // 2) * parameter.to_local()[0].numel()
        for parameter in tensor_parallel.parameters()
        if isinstance(parameter, DTensor)
    ]
    return {
        "issued": issued,
        "dp_ranks": dist.get_process_group_ranks(mesh["dp"].get_group()),
        "block_elements": sum(block),
    }


def _accumulated(dp_rank: int, mesh: DeviceMesh) -> float:
    """Two micro-batches, the first without gradient sync (bf16 parameters, fp32 reduction)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models = [
        sharded_mlp(shard, mesh["dp"], mesh["tp"], mp_policy=policy)
        for shard in (fully_shard, torch_fully_shard)
    ]
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in models]
    for model, optimizer in zip(models, optimizers, strict=True):
        assert isinstance(model, FSDPModule)
        for step, sync in ((0, False), (1, True)):
            model.set_requires_gradient_sync(sync)
            torch.autograd.backward(mlp_loss(model, mlp_batch(dp_rank, step)))
        optimizer.step()
    return largest_gap(full_parameters(models[0]), full_parameters(models[1]))


def _on_meta(shard: Any, mesh: DeviceMesh) -> nn.Module:
    """The MLP stack built on meta, parallelized and sharded there, then materialized."""
    with torch.device("meta"):
        model = nn.Sequential(MLP(), MLP())
    for block in model:
        parallelize_module(block, mesh["tp"], MLP_PLAN)
        shard(block, mesh=mesh["dp"])
    shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.1)
    return model


def _meta_then_cast(dp_rank: int, mesh: DeviceMesh) -> Results:
    """Built on meta, initialized as DTensors, cast to float64, trained: against FSDP2."""
    models = [_on_meta(shard, mesh) for shard in (fully_shard, torch_fully_shard)]
    results: Results = {
        "init_gap": largest_gap(full_parameters(models[0]), full_parameters(models[1]))
    }
    for model in models:
        model.to(torch.float64)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in models]
    for step in range(2):
        for model, optimizer in zip(models, optimizers, strict=True):
            torch.autograd.backward(mlp_loss(model, mlp_batch(dp_rank, step).double()))
            optimizer.step()
            optimizer.zero_grad()
    results["dtypes"] = {parameter.dtype for parameter in models[0].parameters()}
    results["parameter_gap"] = largest_gap(full_parameters(models[0]), full_parameters(models[1]))
    return results


def _sequence_parallel(mesh: DeviceMesh) -> Results:
    """Norms under SequenceParallel: every parameter 2-D, clip_grad_norm_ over all of them."""
    models = [
        sequence_parallel_mlp(shard, mesh["dp"], mesh["tp"])
        for shard in (fully_shard, torch_fully_shard)
    ]
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    results = train_side_by_side(
        models,
        mlp_loss,
        lambda rank, step: sequence_batch(rank, tp_rank, step),
        dp_rank,
        STEPS,
    )
    results["layout"] = (_layout(models[0]), _layout(models[1]))
    return results


def _state_dicts(model: nn.Module, reference: nn.Module, directory: Path, dp_rank: int) -> Results:
    results: Results = {}
    mine_full = get_model_state_dict(model, options=FULL)
    theirs_full = get_model_state_dict(reference, options=FULL)
    results["full_keys"] = list(mine_full) == list(theirs_full)
    results["full_plain"] = all(not isinstance(v, DTensor) for v in mine_full.values())
    results["full_gap"] = largest_gap(tensors(mine_full), tensors(theirs_full))
    mine, theirs = get_model_state_dict(model), get_model_state_dict(reference)
    results["sharded_placements"] = (placements(mine), placements(theirs))
    results["sharded_gap"] = largest_gap(local_tensors(mine), local_tensors(theirs))
    saved = full_parameters(model)
    dcp_save(mine, checkpoint_id=str(directory / "tp"))
    if torch.distributed.get_rank() == 0:
        torch.save(saved, directory / "tp_full.pt")
    # One more step changes the model; DCP, then a full state dict, bring it back.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.autograd.backward(mlp_loss(model, mlp_batch(dp_rank, STEPS)))
    optimizer.step()
    optimizer.zero_grad()
    results["changed"] = largest_gap(full_parameters(model), saved) > 0
    loaded = get_model_state_dict(model)
    dcp_load(loaded, checkpoint_id=str(directory / "tp"))
    set_model_state_dict(model, loaded)
    results["dcp_gap"] = largest_gap(full_parameters(model), saved)
    optimizer.step()  # the same gradients again: changed once more
    # Broadcast from rank 0, as DCP's helpers do: torch's distribute_tensor cannot split a
    # full tensor into padded _StridedShard pieces directly, FSDP2's parameters neither.
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, mine_full, options=broadcast)
    results["full_load_gap"] = largest_gap(full_parameters(model), saved)
    return results


def _job(rank: int, world_size: int, directory: str) -> Results:
    mesh = _mesh()
    dp_rank = mesh.get_local_rank("dp")
    ours = sharded_mlp(fully_shard, mesh["dp"], mesh["tp"])
    theirs = sharded_mlp(torch_fully_shard, mesh["dp"], mesh["tp"])
    results: Results = {"layout": (_layout(ours), _layout(theirs))}
    results["mlp"] = train_side_by_side([ours, theirs], mlp_loss, mlp_batch, dp_rank, STEPS)
    results["state_dicts"] = _state_dicts(ours, theirs, Path(directory), dp_rank)
    results["one_process_gap"] = (
        _against_one_process(
            dp_rank,
            sharded_mlp(fully_shard, mesh["dp"], mesh["tp"]),
            mlp_stack(),
            mlp_loss,
            mlp_batch,
        ),
        _against_one_process(
            dp_rank,
            sharded_llama(fully_shard, mesh["dp"], mesh["tp"]),
            tiny_llama(),
            llama_loss,
            llama_batch,
        ),
    )
    results["collectives"] = _collectives(dp_rank, mesh)
    results["mixed_precision"] = _mixed_precision(dp_rank, mesh)
    results["dim_1"] = _dim_1(dp_rank, mesh)
    results["accumulated"] = _accumulated(dp_rank, mesh)
    results["meta_then_cast"] = _meta_then_cast(dp_rank, mesh)
    results["sequence_parallel"] = _sequence_parallel(mesh)
    llamas = [
        sharded_llama(shard, mesh["dp"], mesh["tp"]) for shard in (fully_shard, torch_fully_shard)
    ]
    results["llama_layout"] = (_layout(llamas[0]), _layout(llamas[1]))
    results["llama"] = train_side_by_side(llamas, llama_loss, llama_batch, dp_rank, STEPS)
    return results


def _plain_job(rank: int, world_size: int, directory: str) -> float:
    """On 2 ranks, plain 1-D fully_shard: load the (dp, tp) checkpoint, step, save."""
    mesh = init_device_mesh("cpu", (2,))
    model = mlp_stack()
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = get_model_state_dict(model)
    dcp_load(state, checkpoint_id=str(Path(directory) / "tp"))
    set_model_state_dict(model, state)
    expected: dict[str, Tensor] = torch.load(Path(directory) / "tp_full.pt")
    gap = largest_gap(full_parameters(model), expected)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.autograd.backward(mlp_loss(model, torch.ones(2, IN)))
    optimizer.step()
    dcp_save(get_model_state_dict(model), checkpoint_id=str(Path(directory) / "plain"))
    full = full_parameters(model)
    if rank == 0:
        torch.save(full, Path(directory) / "plain_full.pt")
    return gap


def _back_job(rank: int, world_size: int, directory: str) -> float:
    """On 4 ranks again, (dp, tp): load what plain fully_shard saved."""
    mesh = _mesh()
    model = sharded_mlp(fully_shard, mesh["dp"], mesh["tp"])
    state = get_model_state_dict(model)
    dcp_load(state, checkpoint_id=str(Path(directory) / "plain"))
    set_model_state_dict(model, state)
    expected: dict[str, Tensor] = torch.load(Path(directory) / "plain_full.pt")
    return largest_gap(full_parameters(model), expected)


@pytest.fixture(scope="module")
def ranks(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[list[Results], list[float], list[float]]:
    directory = str(tmp_path_factory.mktemp("tensor_parallel"))
    results = run_distributed(_job, 4, timeout=240.0, args=(directory,))
    plain = run_distributed(_plain_job, 2, timeout=90.0, args=(directory,))
    back = run_distributed(_back_job, 4, timeout=90.0, args=(directory,))
    return results, plain, back


def _each(ranks: Ranks, key: str) -> list[Any]:
    return [results[key] for results in ranks[0]]


def test_tp_parameters_get_torch_fully_shard_placements_and_bytes(ranks: Ranks) -> None:
    for mine, theirs in _each(ranks, "layout"):
        assert mine == theirs
        placements = {entry[1] for entry in mine}
        assert placements == {
            "(_StridedShard(dim=0, sf=2), Shard(dim=0))",  # colwise: TP rows, then dp
            "(Shard(dim=0), Shard(dim=1))",  # rowwise weight
            "(Shard(dim=0), Replicate())",  # rowwise bias
        }
        assert {entry[2] for entry in mine} == {(2, 2)}
    # dp pads: 5 TP rows split 3 and 2
    shapes = {entry[3] for results in ranks[0] for entry in results["layout"][0]}
    assert {(3, IN), (2, IN)} <= shapes


def test_tp_mlp_trains_as_torch_fully_shard_with_adamw(ranks: Ranks) -> None:
    for results in _each(ranks, "mlp"):
        assert all(abs(mine - theirs) <= TOLERANCE for mine, theirs in results["losses"])
        assert results["gradient_gap"] <= TOLERANCE
        assert results["parameter_gap"] <= TOLERANCE


def test_tp_clip_grad_norm_equals_torch_fully_shard(ranks: Ranks) -> None:
    for key in ("mlp", "llama"):
        for results in _each(ranks, key):
            for mine, theirs in results["norms"]:
                assert abs(mine - theirs) <= TOLERANCE
                assert mine > 0.05  # so the clipping acted


def test_tp_averages_gradients_over_the_dp_ranks_only(ranks: Ranks) -> None:
    """One process on both dp ranks' inputs computes the same SGD steps."""
    for mlp, llama in _each(ranks, "one_process_gap"):
        assert mlp <= 1e-6
        assert llama <= 1e-5


def test_tp_gathers_and_reduces_over_the_dp_ranks_only(ranks: Ranks) -> None:
    """Per step: each block gathered in forward and backward, reduced once; over dp's 2 ranks."""
    for results in _each(ranks, "collectives"):
        issued = results["issued"]
        assert [kind for kind, _, _ in issued].count("all_gather") == 4
        assert [kind for kind, _, _ in issued].count("reduce_scatter") == 2
        assert all(ranks == results["dp_ranks"] for _, ranks, _ in issued)
        assert len(results["dp_ranks"]) == 2
        gathered = {elements for kind, _, elements in issued if kind == "all_gather"}
        assert gathered == {results["block_elements"]}  # this rank's padded shards
        scattered = {elements for kind, _, elements in issued if kind == "reduce_scatter"}
        assert scattered == {2 * results["block_elements"]}  # the TP-local gradients, padded


def test_tp_mixed_precision_and_prefetch_train_as_torch_fully_shard(ranks: Ranks) -> None:
    for results in _each(ranks, "mixed_precision"):
        assert all(abs(mine - theirs) <= TOLERANCE for mine, theirs in results["losses"])
        assert results["parameter_gap"] <= TOLERANCE
        mine, theirs = results["unsharded"]
        assert mine == theirs == ("(Shard(dim=0),)", torch.bfloat16, (5, IN))


def test_tp_llama_gets_torch_fully_shard_placements(ranks: Ranks) -> None:
    for mine, theirs in _each(ranks, "llama_layout"):
        assert mine == theirs
        meshes = {entry[2] for entry in mine}
        assert meshes == {(2,), (2, 2)}  # embeddings and norms on dp alone


def test_tp_llama_trains_as_torch_fully_shard_with_adamw(ranks: Ranks) -> None:
    for results in _each(ranks, "llama"):
        assert all(abs(mine - theirs) <= TOLERANCE for mine, theirs in results["losses"])
        assert results["gradient_gap"] <= TOLERANCE
        assert results["parameter_gap"] <= TOLERANCE


def test_tp_parameters_shard_on_dim_1_as_torch_fully_shard(ranks: Ranks) -> None:
    for results in _each(ranks, "dim_1"):
        mine, theirs = results["layout"]
        assert mine == theirs
        placements = {entry[1] for entry in mine}
        assert "(Shard(dim=1), Shard(dim=0))" in placements  # colwise weight, dp on dim 1
        assert "(_StridedShard(dim=1, sf=2), Shard(dim=1))" in placements  # rowwise weight
        assert all(abs(a - b) <= TOLERANCE for a, b in results["losses"])
        assert results["parameter_gap"] <= TOLERANCE


def test_tp_gradients_accumulate_without_sync_as_torch_fully_shard(ranks: Ranks) -> None:
    for gap in _each(ranks, "accumulated"):
        assert gap <= TOLERANCE


def test_tp_parameters_built_on_meta_and_cast_train_as_torch_fully_shard(ranks: Ranks) -> None:
    for results in _each(ranks, "meta_then_cast"):
        assert results["init_gap"] == 0.0
        assert results["dtypes"] == {torch.float64}
        assert results["parameter_gap"] <= TOLERANCE


def test_tp_with_sequence_parallel_norms_trains_as_torch_fully_shard(ranks: Ranks) -> None:
    for results in _each(ranks, "sequence_parallel"):
        mine, theirs = results["layout"]
        assert mine == theirs
        assert ("0.norm.weight", "(Shard(dim=0), Replicate())", (2, 2), (3,), 12) in mine
        assert all(abs(a - b) <= TOLERANCE for a, b in results["losses"])
        assert all(abs(a - b) <= TOLERANCE for a, b in results["norms"])
        assert results["gradient_gap"] <= TOLERANCE
        assert results["parameter_gap"] <= TOLERANCE


def test_tp_state_dicts_equal_torch_fully_shard(ranks: Ranks) -> None:
    for results in _each(ranks, "state_dicts"):
        assert results["full_keys"]
        assert results["full_plain"]
        assert results["full_gap"] <= TOLERANCE
        assert results["sharded_gap"] <= TOLERANCE
        mine, theirs = results["sharded_placements"]
        assert mine == theirs


def test_tp_checkpoint_round_trips_through_dcp_and_a_full_state_dict(ranks: Ranks) -> None:
    for results in _each(ranks, "state_dicts"):
        assert results["changed"]
        assert results["dcp_gap"] == 0.0
        assert results["full_load_gap"] == 0.0


def test_tp_checkpoint_loads_under_plain_fully_shard_and_back(ranks: Ranks) -> None:
    _, plain, back = ranks
    assert plain == [0.0, 0.0]
    assert back == [0.0] * 4
