"""fully_shard where PyTorch's own FSDP2 tests check FSDP2, side by side on 2 gloo ranks.

The multi-rank behaviours of ``test/distributed/_composable/fsdp/test_fully_shard_init.py``
and ``test_fully_shard_training.py`` that run on CPU: uneven shards (a rank with
no rows), a parameter computed from shards and assigned before the first forward,
``shard_placement_fn`` on the largest dim and on ``-1``, meta-device init of odd
sizes, and a mesh made from a process group. Each scenario runs PyTorch's
``fully_shard`` and ours on the same values; one job runs them all (starting ranks
is the slow part) and returns what each rank saw.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from fully_shard_models import MLP, full_gradients, full_parameters, largest_gap
from fully_shard_models import needs_reference_fully_shard as needs_reference
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.parallel import DistributedDataParallel

from torchcontract.apis import fully_shard
from torchcontract.testing import run_distributed

pytestmark = needs_reference

Apply = Callable[..., Any]
Results = dict[str, Any]
APPLIES: dict[str, Apply] = {"torch": torch_fully_shard, "ours": fully_shard}


def _load(model: nn.Module, full: dict[str, Tensor]) -> None:
    """Fill every sharded parameter with this rank's part of ``full`` (after ``to_empty``)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            assert isinstance(parameter, DTensor)
            part = distribute_tensor(full[name], parameter.device_mesh, parameter.placements)
            parameter.to_local().copy_(part.to_local())


def _dtensor(tensor: Tensor) -> DTensor:
    assert isinstance(tensor, DTensor)
    return tensor


def _largest_dim(parameter: nn.Parameter) -> Shard:
    return Shard(max(range(parameter.dim()), key=lambda dim: (parameter.shape[dim], -dim)))


# ----------------------------------------------------------------- scenarios


def _uneven_largest_dim(mesh: DeviceMesh) -> Results:
    """``Linear(16, 17)``'s weight on dim 1 (17 over 2 ranks): both refuse at apply."""
    errors: dict[str, Exception] = {}
    for name, apply in APPLIES.items():
        model = nn.Sequential(nn.Linear(16, 17), nn.Linear(17, 8))
        try:
            apply(model, mesh=mesh, shard_placement_fn=_largest_dim)
        except Exception as error:
            errors[name] = error
    ours, theirs = errors["ours"], errors["torch"]
    return {
        "ours": f"{type(ours).__name__}: {ours}",
        "same_type": isinstance(ours, type(theirs)),
        "holds_theirs": str(theirs) in str(ours),
    }


class WeightNorm(nn.Module):
    """FSDP2's ``test_reset_sharded_param_in_lazy_init`` model: a parameter made from shards."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(3, 3, bias=False)
        self.layer2 = nn.Linear(3, 3, bias=False)
        self.weight_norm = nn.Parameter(torch.empty(3))

    def init_weight_norm(self) -> None:
        with torch.no_grad():
            norm = torch.linalg.norm(self.layer1.weight, dim=1)
            norm = norm + torch.linalg.norm(self.layer2.weight, dim=1)
        self.weight_norm = nn.Parameter(norm)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.layer2(self.layer1(x)).sum() + self.weight_norm.sum()
        return out


def _assigned_from_shards(mesh: DeviceMesh) -> Results:
    """Built on meta, the layers materialized, ``weight_norm`` assigned from their shards."""
    torch.manual_seed(0)
    full = {f"layer{index}.weight": torch.randn(3, 3) for index in (1, 2)}
    found: Results = {}
    models: dict[str, WeightNorm] = {}
    for name, apply in APPLIES.items():
        with torch.device("meta"):
            model = WeightNorm()
        for module in (model.layer1, model.layer2, model):
            apply(module, mesh=mesh)
        model.layer1.to_empty(device="cpu")
        model.layer2.to_empty(device="cpu")
        _load(model.layer1, {"weight": full["layer1.weight"]})
        _load(model.layer2, {"weight": full["layer2.weight"]})
        model.init_weight_norm()
        loss = model(torch.ones(2, 3))
        loss.backward()
        found[f"{name}_loss"] = loss.item()
        found[f"{name}_local"] = tuple(_dtensor(model.weight_norm).to_local().shape)
        models[name] = model
    found["gradient_gap"] = largest_gap(
        full_gradients(models["ours"]), full_gradients(models["torch"])
    )
    found["parameter_gap"] = largest_gap(
        full_parameters(models["ours"]), full_parameters(models["torch"])
    )
    return found


def _sharded_tensors(rank: int, mesh: DeviceMesh) -> Results:
    """Odd sizes, and a shared in-projection: the shards are ``torch.chunk``'s, as FSDP2's."""
    found: Results = {}
    for shared in (False, True):
        locals_: dict[str, list[Tensor]] = {}
        for name, apply in APPLIES.items():
            torch.manual_seed(0)
            model = nn.Sequential(*[MLP(3, multiplier=3) for _ in range(3)])
            if shared:
                model[0].in_proj = model[1].in_proj
            originals = [parameter.detach().clone() for parameter in model.parameters()]
            apply(model, mesh=mesh)
            sharded = list(model.parameters())
            assert len(sharded) == len(originals)
            for original, parameter in zip(originals, sharded, strict=True):
                assert isinstance(parameter, DTensor)
                assert parameter.placements == (Shard(0),)
                assert parameter.shape == original.shape
                assert parameter.stride() == original.stride()
                assert torch.equal(parameter.to_local(), torch.chunk(original, 2)[rank])
            locals_[name] = [_dtensor(parameter).to_local() for parameter in sharded]
        found[f"shared={shared}"] = all(
            torch.equal(a, b) for a, b in zip(locals_["ours"], locals_["torch"], strict=True)
        )
    return found


def _train_steps(model: nn.Module, rank: int, dim: int) -> list[float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + rank)
    losses = []
    for _ in range(3):
        loss = model(torch.randn(4, dim)).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _placement_fn_parity(rank: int, mesh: DeviceMesh) -> Results:
    """Largest dim (even) and ``Shard(-1)``: placements, full values and training as FSDP2's."""
    found: Results = {}
    functions: dict[str, Callable[[nn.Parameter], Shard]] = {
        "largest": _largest_dim,
        "last": lambda parameter: Shard(-1),
    }
    for label, function in functions.items():
        for name, apply in APPLIES.items():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8))
            reference = {key: value.detach().clone() for key, value in model.state_dict().items()}
            apply(model, mesh=mesh, shard_placement_fn=function)
            found[f"{label}_{name}_placements"] = [
                tuple(_dtensor(parameter).placements) for parameter in model.parameters()
            ]
            found[f"{label}_{name}_full_gap"] = largest_gap(full_parameters(model), reference)
            found[f"{label}_{name}_losses"] = _train_steps(model, rank, 32)
    return found


def _meta_init(rank: int, mesh: DeviceMesh) -> Results:
    """FSDP2's ``test_meta_device_1d_init``: even (8), uneven (3) and an empty shard (1)."""
    found: Results = {}
    for dim in (8, 3, 1):
        torch.manual_seed(0)
        full = nn.Sequential(MLP(dim, multiplier=1, bias=False), MLP(dim, multiplier=1, bias=False))
        values = {name: value.detach().clone() for name, value in full.named_parameters()}
        for name, apply in APPLIES.items():
            with torch.device("meta"):
                model = nn.Sequential(
                    MLP(dim, multiplier=1, bias=False), MLP(dim, multiplier=1, bias=False)
                )
            for module in (model[0], model[1], model):
                apply(module, mesh=mesh)
            model.to_empty(device="cpu")
            _load(model, values)
            found[f"{dim}_{name}_local_rows"] = [
                _dtensor(parameter).to_local().shape[0] for parameter in model.parameters()
            ]
            found[f"{dim}_{name}_losses"] = _train_steps(model, rank, dim)
    return found


def _from_group(rank: int, mesh: DeviceMesh) -> Results:
    """FSDP2's ``test_1d_process_group_init``: a mesh from the default group trains the same."""
    world = dist.group.WORLD
    assert world is not None
    group_mesh = DeviceMesh.from_group(world, "cpu", mesh_dim_names=("dp",))
    found: Results = {}
    for name, apply in APPLIES.items():
        for label, each_mesh in (("mesh", mesh), ("group", group_mesh)):
            torch.manual_seed(0)
            model = MLP(8)
            for module in (model.in_proj, model.out_proj, model):
                apply(module, mesh=each_mesh)
            found[f"{name}_{label}"] = _train_steps(model, rank, 8)
    return found


def _save_load(model: nn.Module, rank: int) -> dict[str, bool]:
    """FSDP2's ``_test_state_dict_save_load``: what a state dict shares and what a load writes."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(1.0)
    pointers = {name: _dtensor(p).to_local().data_ptr() for name, p in model.named_parameters()}
    state = model.state_dict()
    shares = all(
        isinstance(value, DTensor)
        and (pointers[key] == 0 or value.to_local().data_ptr() == pointers[key])
        for key, value in state.items()
    )
    new = {key: value.detach().clone().fill_(42.0 + rank) for key, value in state.items()}
    model.load_state_dict(new)
    loaded, kept = True, True
    for name, parameter in model.named_parameters():
        local = _dtensor(parameter).to_local()
        loaded &= bool(torch.all(local == 42.0 + rank))
        if local.size(0) * _dtensor(parameter).device_mesh.size() == parameter.size(0):
            kept &= local.data_ptr() == pointers[name]
    return {
        "same_keys": set(state) == set(pointers),
        "shares_storage": shares,
        "load_writes_values": loaded,
        "load_keeps_even_storage": kept,
    }


def _state_dicts(rank: int, mesh: DeviceMesh) -> Results:
    """FSDP2's ``test_dp_state_dict_save_load`` and ``test_cached_state_dict``, odd sizes too."""
    found: Results = {}
    for dim in (2, 3, 5):
        for name, apply in APPLIES.items():
            for resharding in (True, False):
                torch.manual_seed(0)
                model = nn.Sequential(
                    MLP(dim), nn.Sequential(MLP(dim), nn.Linear(dim, dim)), MLP(dim)
                )
                for module in (*model, model):
                    apply(module, mesh=mesh, reshard_after_forward=resharding)
                found[f"{dim}_{name}_{resharding}"] = _save_load(model, rank)
                before = {key: value.full_tensor() for key, value in model.state_dict().items()}
                model(torch.randn(2, dim))  # the root keeps its parameters unsharded
                after = {key: value.full_tensor() for key, value in model.state_dict().items()}
                same = before.keys() == after.keys()
                same = same and all(torch.equal(before[key], after[key]) for key in before)
                found[f"{dim}_{name}_{resharding}_after_forward"] = same
        for name, apply in APPLIES.items():
            torch.manual_seed(0)
            linear = apply(nn.Linear(dim, dim, bias=False), mesh=mesh)
            optimizer = torch.optim.AdamW(linear.parameters(), lr=1e-2)
            state = linear.state_dict()
            same = True
            for _ in range(3):
                optimizer.zero_grad()
                linear(torch.rand(dim, dim)).sum().backward()
                optimizer.step()
                same &= torch.equal(state["weight"].to_local(), _dtensor(linear.weight).to_local())
            found[f"{dim}_{name}_cached"] = same
    return found


class DoubleLinear(nn.Module):
    """Two linears on one input: both outputs, or the first only (the second never used)."""

    def __init__(self, dim: int, use_second: bool) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.use_second = use_second

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        if self.use_second:
            return torch.relu(self.lin1(x)), torch.relu(self.lin2(x))
        return torch.relu(self.lin1(x))


def _pack(kind: str, x: Tensor) -> Any:
    """``x`` in a ``kind`` container: those FSDP2 looks into, subclasses and dataclasses too."""
    if kind == "dict":
        return {"x": x}
    if kind == "namedtuple":
        return Pair(x, torch.ones_like(x))
    if kind == "tuple_subclass":
        return Couple((x, x))
    if kind == "dataclass":
        return Boxed(x)
    return [x] if kind == "list" else (x,)


def _unpack(kind: str, packed: Any) -> Tensor:
    if kind == "dict":
        out: Tensor = packed["x"]
    elif kind == "dataclass":
        out = packed.x
    else:
        out = packed[0]
    return out


class Packed(nn.Module):
    """A linear whose input and output are ``kind`` containers of the activation."""

    def __init__(self, dim: int, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.kind = kind

    def forward(self, packed: Any) -> Any:
        return _pack(self.kind, torch.relu(self.lin(_unpack(self.kind, packed))))


class Pack(nn.Module):
    """A tensor into a ``kind`` container."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: Tensor) -> Any:
        return _pack(self.kind, x)


class Unpack(nn.Module):
    """The tensor of a ``kind`` container."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, packed: Any) -> Tensor:
        return _unpack(self.kind, packed)


class Pair(NamedTuple):
    """A named pair, as FSDP2's test builds with ``collections.namedtuple``."""

    x: Tensor
    y: Tensor


class Couple(tuple[Tensor, Tensor]):
    """A tuple subclass, which ``pytree`` does not look into (FSDP2 does)."""


@dataclasses.dataclass
class Boxed:
    """A dataclass output, which FSDP2 looks into."""

    x: Tensor


def _step_losses(model: nn.Module, rank: int, loss_of: Callable[[Any, int], Tensor]) -> list[float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + rank)
    losses = []
    for step in range(4):
        loss = loss_of(model(torch.rand(2, 8)), step)
        torch.autograd.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=step % 2 == 1)
        losses.append(loss.item())
    return losses


def _unused_output_loss(outputs: tuple[Tensor, Tensor], step: int) -> Tensor:
    first, second = outputs
    return (first * second).sum() if step < 2 else first.sum()


KINDS = ("list", "tuple", "namedtuple", "dict", "tuple_subclass", "dataclass")


def _autograd(rank: int, mesh: DeviceMesh) -> Results:
    """FSDP2's ``test_fully_shard_autograd``: unused outputs and modules, packed activations."""
    found: Results = {}
    parameters: dict[str, dict[str, Tensor]] = {}
    for name, apply in APPLIES.items():
        for resharding in (True, False):
            torch.manual_seed(0)
            model = DoubleLinear(8, use_second=True)
            apply(model.lin1, mesh=mesh, reshard_after_forward=resharding)
            apply(model, mesh=mesh, reshard_after_forward=resharding)
            found[f"unused_output_{resharding}_{name}"] = _step_losses(
                model, rank, _unused_output_loss
            )
            parameters[f"unused_output_{resharding}_{name}"] = full_parameters(model)
            torch.manual_seed(0)
            model = DoubleLinear(8, use_second=False)
            for module in (model.lin1, model.lin2, model):
                apply(module, mesh=mesh, reshard_after_forward=resharding)
            found[f"unused_module_{resharding}_{name}"] = _step_losses(
                model, rank, lambda out, step: out.sum()
            )
            parameters[f"unused_module_{resharding}_{name}"] = full_parameters(model)
        for kind in KINDS:
            torch.manual_seed(0)
            packed = nn.Sequential(
                Pack(kind), Packed(8, kind), Packed(8, kind), Packed(8, kind), Unpack(kind)
            )
            for module in (*packed, packed):
                apply(module, mesh=mesh)
            found[f"packed_{kind}_{name}"] = _step_losses(packed, rank, lambda out, step: out.sum())
            parameters[f"packed_{kind}_{name}"] = full_parameters(packed)
    for key in [key for key in parameters if key.endswith("_ours")]:
        theirs = parameters[key.removesuffix("_ours") + "_torch"]
        found[key.removesuffix("_ours") + "_gap"] = largest_gap(parameters[key], theirs)
    return found


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin_c = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.lin_c(x)
        return out


class Middle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin_b = nn.Linear(8, 8)
        self.module_c = Inner()
        self.subtrahend = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.lin_b(self.module_c(x)) - self.subtrahend
        return out


class Outer(nn.Module):
    """FSDP2's ``test_ddp_A_fsdp_B_ddp_C`` model: A holds B, which holds C."""

    def __init__(self) -> None:
        super().__init__()
        self.module_b = Middle()
        self.addend = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = (self.module_b(x) + self.addend).sum()
        return out


def _ignored_under_ddp(mesh: DeviceMesh) -> Results:
    """FSDP2's ``test_ddp_A_fsdp_B_ddp_C``: B sharded ignoring C's parameters, DDP around all."""
    found: Results = {}
    parameters: dict[str, dict[str, Tensor]] = {}
    for name, apply in APPLIES.items():
        torch.manual_seed(0)
        model = Outer()
        ignored = set(model.module_b.module_c.parameters())
        apply(model.module_b.lin_b, mesh=mesh, ignored_params=ignored)
        apply(model.module_b, mesh=mesh, ignored_params=ignored)
        found[f"{name}_sharded_modules"] = sorted(
            fqn for fqn, module in model.named_modules() if isinstance(module, FSDPModule)
        )
        sharded = ["module_b.subtrahend", "module_b.lin_b.weight", "module_b.lin_b.bias"]
        ignore: Callable[[nn.Module, list[str]], None] = (
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model
        )
        ignore(model, sharded)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DDP's notes on DTensor parameters
            wrapped = DistributedDataParallel(model, broadcast_buffers=False)
        optimizer = torch.optim.Adam(wrapped.parameters(), lr=1e-2)
        torch.manual_seed(1)
        x = torch.randn(8, 8)
        losses = []
        for _ in range(3):
            loss = wrapped(x)
            torch.autograd.backward(loss)
            with implicit_replication():
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
        found[f"{name}_losses"] = losses
        parameters[name] = full_parameters(model)
    found["parameter_gap"] = largest_gap(parameters["ours"], parameters["torch"])
    return found


def _job(rank: int, world_size: int) -> Results:
    mesh = init_device_mesh("cpu", (world_size,))
    return {
        "uneven": _uneven_largest_dim(mesh),
        "assigned": _assigned_from_shards(mesh),
        "sharded": _sharded_tensors(rank, mesh),
        "placement": _placement_fn_parity(rank, mesh),
        "meta": _meta_init(rank, mesh),
        "from_group": _from_group(rank, mesh),
        "state_dicts": _state_dicts(rank, mesh),
        "autograd": _autograd(rank, mesh),
        "ignored_under_ddp": _ignored_under_ddp(mesh),
    }


@pytest.fixture(scope="module")
def ranks() -> list[Results]:
    return run_distributed(_job, 2, timeout=180.0)


def _each(ranks: list[Results], key: str) -> list[Results]:
    return [rank[key] for rank in ranks]


# ----------------------------------------------------------------- tests


def test_an_uneven_shard_on_the_largest_dim_is_refused_at_apply_as_fsdp2_refuses_it(
    ranks: list[Results],
) -> None:
    for found in _each(ranks, "uneven"):
        assert found["same_type"]
        assert found["holds_theirs"]
        assert found["ours"].startswith(
            "NotImplementedError: fully_shard on Sequential: shard_placement_fn returned Shard(1)"
        )
        assert "FSDP does not support uneven sharding on dim 1" in found["ours"]


def test_a_parameter_assigned_from_shards_before_the_first_forward_trains_as_in_fsdp2(
    ranks: list[Results],
) -> None:
    """3 rows over 2 ranks: rank 0 holds 2, rank 1 one; both take the assigned DTensor."""
    for rank, found in enumerate(_each(ranks, "assigned")):
        assert found["ours_loss"] == found["torch_loss"]
        assert found["ours_local"] == ((2,), (1,))[rank]
        assert found["gradient_gap"] == 0.0
        assert found["parameter_gap"] == 0.0


@pytest.mark.parametrize("shared", [False, True])
def test_shards_of_odd_sizes_are_torch_chunks_as_fsdp2s(ranks: list[Results], shared: bool) -> None:
    for found in _each(ranks, "sharded"):
        assert found[f"shared={shared}"]


@pytest.mark.parametrize("label", ["largest", "last"])
def test_shard_placement_fn_places_and_trains_as_fsdp2(ranks: list[Results], label: str) -> None:
    for found in _each(ranks, "placement"):
        assert found[f"{label}_ours_placements"] == found[f"{label}_torch_placements"]
        assert found[f"{label}_ours_full_gap"] == found[f"{label}_torch_full_gap"] == 0.0
        assert found[f"{label}_ours_losses"] == found[f"{label}_torch_losses"]


def test_shard_dim_minus_one_is_the_last_dim(ranks: list[Results]) -> None:
    for found in _each(ranks, "placement"):
        assert found["last_ours_placements"] == [(Shard(1),), (Shard(0),), (Shard(1),), (Shard(0),)]


@pytest.mark.parametrize("dim", [8, 3, 1])
def test_a_meta_built_model_of_odd_sizes_trains_as_fsdp2s(ranks: list[Results], dim: int) -> None:
    """Dim 1 leaves rank 1 no rows at all."""
    for found in _each(ranks, "meta"):
        assert found[f"{dim}_ours_local_rows"] == found[f"{dim}_torch_local_rows"]
        assert found[f"{dim}_ours_losses"] == found[f"{dim}_torch_losses"]
    if dim == 1:
        assert set(_each(ranks, "meta")[1]["1_ours_local_rows"]) == {0}


def test_a_mesh_made_from_a_process_group_trains_as_fsdp2s(ranks: list[Results]) -> None:
    for found in _each(ranks, "from_group"):
        assert found["ours_group"] == found["ours_mesh"] == found["torch_group"]
        assert found["torch_mesh"] == found["torch_group"]


@pytest.mark.parametrize("dim", [2, 3, 5])
@pytest.mark.parametrize("resharding", [True, False])
def test_a_state_dict_shares_the_shards_and_a_load_writes_into_them_as_in_fsdp2(
    ranks: list[Results], dim: int, resharding: bool
) -> None:
    for found in _each(ranks, "state_dicts"):
        ours, theirs = found[f"{dim}_ours_{resharding}"], found[f"{dim}_torch_{resharding}"]
        assert ours == theirs
        assert all(ours.values())


@pytest.mark.parametrize("dim", [2, 3, 5])
def test_a_state_dict_after_a_forward_holds_the_shards_as_in_fsdp2(
    ranks: list[Results], dim: int
) -> None:
    """With ``reshard_after_forward=False`` the forward leaves every group unsharded."""
    for found in _each(ranks, "state_dicts"):
        for resharding in (True, False):
            assert found[f"{dim}_ours_{resharding}_after_forward"]
            assert found[f"{dim}_torch_{resharding}_after_forward"]


@pytest.mark.parametrize("dim", [2, 3, 5])
def test_a_state_dict_taken_once_follows_training_as_in_fsdp2(
    ranks: list[Results], dim: int
) -> None:
    """FSDP2's ``test_cached_state_dict``: the values are the shards, updated in place."""
    for found in _each(ranks, "state_dicts"):
        assert found[f"{dim}_ours_cached"]
        assert found[f"{dim}_torch_cached"]


@pytest.mark.parametrize(
    "case",
    [
        "unused_output_True",
        "unused_output_False",
        "unused_module_True",
        "unused_module_False",
        *(f"packed_{kind}" for kind in KINDS),
    ],
)
def test_backward_through_unused_outputs_modules_and_packed_activations_as_in_fsdp2(
    ranks: list[Results], case: str
) -> None:
    """The same losses and parameters after 4 Adam steps as FSDP2's."""
    for found in _each(ranks, "autograd"):
        assert found[f"{case}_ours"] == found[f"{case}_torch"]
        assert found[f"{case}_gap"] == 0.0


def test_ignored_parameters_under_ddp_train_as_in_fsdp2(ranks: list[Results]) -> None:
    """C is left to DDP, B and its linear to fully_shard: the same losses and parameters."""
    for found in _each(ranks, "ignored_under_ddp"):
        assert found["ours_sharded_modules"] == found["torch_sharded_modules"]
        assert found["ours_sharded_modules"] == ["module_b", "module_b.lin_b"]
        assert found["ours_losses"] == found["torch_losses"]
        assert found["parameter_gap"] == 0.0
