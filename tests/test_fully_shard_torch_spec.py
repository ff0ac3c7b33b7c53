"""fully_shard where PyTorch's own FSDP2 tests check FSDP2, side by side, on a one-rank group.

Each scenario runs twice, with PyTorch's ``fully_shard`` and with ours, on fresh
modules. A refusal must come at the same step (apply, or the first forward), be an
instance of the type FSDP2 raises (ours is a subclass naming what went wrong), and
hold FSDP2's message as well as ours. The behaviours are those of
``test/distributed/_composable/fsdp/test_fully_shard_init.py`` and
``test_fully_shard_comm.py`` (argument checks, lazy init, hooks); the multi-rank
ones are in ``tests/distributed/test_fully_shard_torch_spec_gloo.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torchcontract import (
    AlreadyManagedError,
    ContractError,
    InvalidMeshError,
    InvalidShardDimError,
    ReplacedParameterError,
    ScalarParameterError,
    UnmaterializedParameterError,
    UnnamedMeshError,
)
from torchcontract.apis import fully_shard
from torchcontract.apis._compat import REFERENCE_FULLY_SHARD_ON_CPU

pytestmark = [
    pytest.mark.usefixtures("one_rank_group"),
    pytest.mark.skipif(
        not REFERENCE_FULLY_SHARD_ON_CPU,
        reason=f"PyTorch's fully_shard fails on CPU with torch {torch.__version__}",
    ),
]

Apply = Callable[..., Any]
#: A scenario: given an apply function and a one-item list naming the step it is at.
Scenario = Callable[[Apply, list[str]], object]
APPLIES: dict[str, Apply] = {"torch": torch_fully_shard, "ours": fully_shard}


def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (1,))


class MLP(nn.Module):
    """The MLP of PyTorch's FSDP tests: in and out projections."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.out_proj(torch.relu(self.in_proj(x)))
        return out


def _raised(scenario: Scenario, apply: Apply) -> tuple[str, Exception]:
    """The step at which ``scenario`` raised with ``apply``, and the error."""
    step = ["apply"]
    try:
        scenario(apply, step)
    except Exception as error:
        return step[0], error
    raise AssertionError(f"{apply.__module__}: nothing raised")


def _refused_as_torch(scenario: Scenario, *, same_text: bool = True) -> Exception:
    """Ours refuses ``scenario`` where FSDP2 does, with its type and its message; ours returned."""
    theirs_step, theirs = _raised(scenario, torch_fully_shard)
    ours_step, ours = _raised(scenario, fully_shard)
    assert ours_step == theirs_step
    assert isinstance(ours, type(theirs)), (type(ours), type(theirs))
    if same_text:
        assert str(theirs) in str(ours)
    return ours


# ----------------------------------------------------------------- refused at apply


def _scalar(apply: Apply, step: list[str]) -> None:
    model = nn.Sequential(MLP(3), MLP(3))
    model.register_parameter("scalar_p", nn.Parameter(torch.tensor(1.0)))
    apply(model, mesh=_mesh())


def test_a_scalar_parameter_is_refused_at_apply_with_fsdp2s_value_error() -> None:
    error = _refused_as_torch(_scalar)
    assert type(error) is ScalarParameterError
    assert "Change scalar_p to a 1D tensor with numel equal to 1." in str(error)
    assert str(error).startswith("fully_shard on Sequential: parameter 'scalar_p' is a scalar")


def _channels_last_conv() -> nn.Conv2d:
    conv = nn.Conv2d(8, 8, 3)
    return cast(Callable[..., nn.Conv2d], conv.to)(memory_format=torch.channels_last)


def _channels_last(apply: Apply, step: list[str]) -> None:
    apply(_channels_last_conv(), mesh=_mesh())


def test_a_channels_last_parameter_is_refused_at_apply_as_fsdp2_refuses_it() -> None:
    error = _refused_as_torch(_channels_last)
    assert type(error) is NotImplementedError
    assert "FSDP does not support non-contiguous parameters" in str(error)
    assert "fully_shard on Conv2d: parameter 'weight' is not contiguous" in str(error)


def test_a_channels_last_refusal_leaves_the_module_as_it_was() -> None:
    conv = _channels_last_conv()
    before = list(conv.parameters())
    with pytest.raises(NotImplementedError):
        fully_shard(conv, mesh=_mesh())
    assert list(conv.parameters()) == before
    assert not isinstance(conv, FSDPModule)


def _cube(apply: Apply, step: list[str]) -> None:
    apply(MLP(), mesh=init_device_mesh("cpu", (1, 1, 1)))


def test_a_3d_mesh_is_refused_with_fsdp2s_value_error_and_message() -> None:
    error = _refused_as_torch(_cube)
    assert type(error) is InvalidMeshError
    assert "fully_shard expects a 1D or 2D DeviceMesh but got DeviceMesh" in str(error)


def _unnamed_square(apply: Apply, step: list[str]) -> None:
    apply(MLP(), mesh=init_device_mesh("cpu", (1, 1)))


def test_a_2d_mesh_without_dim_names_is_refused_with_fsdp2s_assertion_error() -> None:
    error = _refused_as_torch(_unnamed_square)
    assert type(error) is UnnamedMeshError
    assert isinstance(error, InvalidMeshError)
    assert "Please init the 2D mesh for HSDP with mesh_dim_names specified" in str(error)


def test_a_2d_mesh_with_dim_names_is_taken_as_hsdp() -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    model = fully_shard(MLP(), mesh=mesh)
    weight = model.in_proj.weight
    assert isinstance(weight, DTensor)
    assert weight.device_mesh.mesh_dim_names == ("replicate", "shard")


@pytest.mark.parametrize("dim", [1, 5, -3])
def test_a_shard_dim_a_parameter_lacks_is_refused_with_fsdp2s_assertion_error(dim: int) -> None:
    """``Shard(1)`` is invalid for a bias (1-D): FSDP2's ``test_invalid_shard_dim``."""

    def scenario(apply: Apply, step: list[str]) -> None:
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8))
        apply(model, mesh=_mesh(), shard_placement_fn=lambda parameter: Shard(dim))

    error = _refused_as_torch(scenario)
    assert type(error) is InvalidShardDimError
    assert isinstance(error, ValueError)
    assert f"shard_placement_fn returned Shard({dim}) for parameter" in str(error)


def test_shard_dim_minus_one_is_the_last_dim_as_in_fsdp2() -> None:
    placements = {}
    for name, apply in APPLIES.items():
        model = apply(nn.Linear(4, 6), mesh=_mesh(), shard_placement_fn=lambda p: Shard(-1))
        placements[name] = [tuple(p.placements) for p in model.parameters()]
    assert placements["ours"] == placements["torch"] == [(Shard(1),), (Shard(0),)]


# ----------------------------------------------------------------- refused at the first forward


def _shared_by_two(apply: Apply, step: list[str]) -> None:
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    second.weight = first.weight
    model = nn.Sequential(first, second)
    apply(first, mesh=_mesh())
    apply(second, mesh=_mesh())
    apply(model, mesh=_mesh())
    step[0] = "forward"
    model(torch.randn(1, 2))


def test_a_parameter_two_applications_share_is_refused_at_the_first_forward() -> None:
    error = _refused_as_torch(_shared_by_two)
    assert type(error) is AlreadyManagedError
    assert isinstance(error, ValueError)
    assert "Parameter '1.weight' is shared with a parameter already managed" in str(error)
    assert str(error).startswith("fully_shard on Sequential: parameter '1.weight'")


def test_a_tied_parameter_shared_with_a_nested_application_is_sharded_again_at_apply() -> None:
    """As FSDP2: the root's apply shards the original at the module the nested one left out."""
    model = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 4, bias=False))
    model[1].weight = model[0].weight
    fully_shard(model[1], mesh=_mesh())
    fully_shard(model, mesh=_mesh())
    assert isinstance(model[0].weight, DTensor)
    assert model[0].weight is not model[1].weight
    assert fully_shard.state(model).managed == ("0.weight",)


def _meta_not_materialized(apply: Apply, step: list[str]) -> None:
    with torch.device("meta"):
        model = nn.Sequential(MLP(), MLP())
    apply(model[0], mesh=_mesh())
    apply(model[1], mesh=_mesh())
    apply(model, mesh=_mesh())
    step[0] = "forward"
    model(torch.randn(4, 8))


def test_a_forward_on_meta_parameters_is_refused_with_fsdp2s_message() -> None:
    """FSDP2's ``test_invalid_meta_device_init``: FQNs in the root, in FSDP2's order."""
    error = _refused_as_torch(_meta_not_materialized)
    assert type(error) is UnmaterializedParameterError
    assert (
        "['0.in_proj.weight', '0.in_proj.bias', '0.out_proj.weight', '0.out_proj.bias']"
    ) in str(error)


def _replaced_by_a_plain_tensor(apply: Apply, step: list[str]) -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    apply(model, mesh=_mesh())
    model.to_empty(device="cpu")
    model.weight = nn.Parameter(torch.ones(4, 4))
    step[0] = "forward"
    model(torch.randn(1, 4))


def test_a_plain_tensor_assigned_after_apply_is_refused_at_the_first_forward() -> None:
    error = _refused_as_torch(_replaced_by_a_plain_tensor)
    assert type(error) is ReplacedParameterError
    assert isinstance(error, AttributeError)
    assert "parameter 'weight' was replaced after fully_shard by a Parameter" in str(error)


def _replaced_by_a_larger_dtensor(apply: Apply, step: list[str]) -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    apply(model, mesh=_mesh())
    model.to_empty(device="cpu")
    model.weight = nn.Parameter(distribute_tensor(torch.ones(6, 4), _mesh(), [Shard(0)]))
    step[0] = "forward"
    model(torch.randn(1, 4))


def test_a_dtensor_of_another_shape_assigned_after_apply_is_refused_at_the_first_forward() -> None:
    """FSDP2 fails copying it into its padded shard (``RuntimeError``); ours says why."""
    error = _refused_as_torch(_replaced_by_a_larger_dtensor, same_text=False)
    assert type(error) is ReplacedParameterError
    assert "by a DTensor of shape (6, 4)" in str(error)


def test_a_dtensor_assigned_after_apply_trains_as_in_fsdp2() -> None:
    """Assigned after ``to_empty``: both take it as the shard; the same loss and gradient."""
    results: dict[str, tuple[float, Tensor]] = {}
    for name, apply in APPLIES.items():
        with torch.device("meta"):
            model = nn.Linear(4, 4)
        apply(model, mesh=_mesh())
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.bias.zero_()
        weight = torch.arange(16.0).view(4, 4)
        model.weight = nn.Parameter(distribute_tensor(weight, _mesh(), [Shard(0)]))
        loss = model(torch.ones(2, 4)).square().sum()
        loss.backward()
        assert model.weight.grad is not None
        results[name] = (loss.item(), cast(DTensor, model.weight.grad).full_tensor())
    assert results["ours"][0] == results["torch"][0]
    assert torch.equal(results["ours"][1], results["torch"][1])


def _inner_forward_first(apply: Apply, step: list[str]) -> None:
    first = MLP()
    model = nn.Sequential(first, MLP())
    apply(first.in_proj, mesh=_mesh())
    apply(first.out_proj, mesh=_mesh())
    apply(model, mesh=_mesh())
    step[0] = "inner forward"
    first.in_proj(torch.randn(2, 8))
    step[0] = "forward"
    model(torch.randn(2, 8))


def test_a_root_whose_inner_application_ran_forward_first_is_refused_as_in_fsdp2() -> None:
    """FSDP2's ``test_fully_shard_double_lazy_init``, through forwards."""
    error = _refused_as_torch(_inner_forward_first)
    assert type(error) is ContractError
    assert "fully_shard on Sequential: the application on '0.in_proj' ran forward" in str(error)


def _list_as_root(apply: Apply, step: list[str]) -> None:
    model = nn.Sequential(MLP(), MLP())
    apply([model[0], model[1]], mesh=_mesh())
    step[0] = "forward"
    model(torch.randn(2, 8))


def test_a_list_application_as_the_root_is_refused_at_the_first_forward_as_in_fsdp2() -> None:
    """FSDP2's ``test_fully_shard_multi_module_root``, through a forward."""
    error = _refused_as_torch(_list_as_root, same_text=False)
    assert type(error) is ContractError
    assert "FSDP requires a single root module but got (MLP, MLP)" in str(error)


def test_a_list_application_under_a_root_trains_as_in_fsdp2() -> None:
    losses: dict[str, float] = {}
    for name, apply in APPLIES.items():
        torch.manual_seed(0)
        model = nn.Sequential(MLP(), MLP())
        apply([model[0], model[1]], mesh=_mesh())
        apply(model, mesh=_mesh())
        loss = model(torch.ones(2, 8)).sum()
        loss.backward()
        losses[name] = loss.item()
    assert losses["ours"] == losses["torch"]


def test_a_list_stays_gathered_until_its_last_modules_forward_as_in_fsdp2() -> None:
    seen: dict[str, list[bool]] = {}
    for name, apply in APPLIES.items():
        first, second = nn.Linear(2, 2), nn.Linear(2, 2)
        model = nn.Sequential(first, second)
        apply([first, second], mesh=_mesh(), reshard_after_forward=True)
        apply(model, mesh=_mesh())
        found = seen[name] = []
        first.register_forward_hook(
            lambda *_, found=found, first=first: found.append(isinstance(first.weight, DTensor))
        )
        model(torch.randn(1, 2))
        found.append(isinstance(first.weight, DTensor))
    # Still gathered after the first module's forward; freed after the second's.
    assert seen["ours"] == seen["torch"] == [False, True]


class SkipsHead(nn.Module):
    """torchtitan's model under a chunked loss: its forward runs the norm, not the head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.norm = nn.RMSNorm(8)
        self.head = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.norm(self.body(x))
        return out


def test_a_chunked_loss_on_a_list_applications_head_keeps_the_model_gathered_as_fsdp2() -> None:
    """The norm and head sharded as one list: the head's backwards per chunk end no backward.

    FSDP2 ends a list's forward when the last of its modules ran (the root's forward
    ends it when one did not), so a head run by the loss, per chunk, hooks no
    pre-backward and its backwards queue no end-of-backward callback: the model's
    parameters stay gathered for the model's own backward.
    """
    seen: dict[str, tuple[object, ...]] = {}
    gradients: dict[str, dict[str, Tensor]] = {}
    for name, apply in APPLIES.items():
        torch.manual_seed(0)
        model = SkipsHead()
        apply(model.body, mesh=_mesh(), reshard_after_forward=False)
        apply([model.norm, model.head], mesh=_mesh(), reshard_after_forward=False)
        apply(model, mesh=_mesh())
        hidden = model(torch.randn(4, 8))
        detached = hidden.detach().requires_grad_()
        for chunk in detached.chunk(2):
            model.head(chunk).square().sum().backward()
        seen[name] = tuple(
            type(module.weight).__name__ for module in (model.body, model.norm, model.head)
        )
        assert detached.grad is not None
        hidden.backward(detached.grad)
        gradients[name] = {
            key: cast(DTensor, parameter.grad).full_tensor()
            for key, parameter in model.named_parameters()
        }
    # The body stays gathered; the list's own post-backward resharded the norm and head.
    assert seen["ours"] == seen["torch"] == ("Parameter", "DTensor", "DTensor")
    assert gradients["ours"].keys() == gradients["torch"].keys()
    for key, gradient in gradients["torch"].items():
        assert torch.equal(gradients["ours"][key], gradient), key


# ----------------------------------------------------------------- forward inputs


class ParameterOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self) -> Tensor:
        return self.weight @ self.weight


def test_a_root_without_forward_inputs_trains_as_in_fsdp2() -> None:
    """FSDP2's ``test_root_no_forward_inputs``."""
    results: dict[str, Tensor] = {}
    for name, apply in APPLIES.items():
        torch.manual_seed(0)
        model = apply(ParameterOnly(), mesh=_mesh())
        model().sum().backward()
        results[name] = cast(DTensor, model.weight.grad).full_tensor()
    assert torch.equal(results["ours"], results["torch"])


class Parameterless(nn.Module):
    def forward(self, x: Tensor, ys: tuple[Tensor, ...]) -> Tensor:
        return x + ys[0] + ys[1] + 1


def test_a_module_without_parameters_runs_its_forward_as_in_fsdp2() -> None:
    """FSDP2's ``test_root_move_forward_input_to_device``, on CPU: nested inputs pass through."""
    x, ys = torch.randn(3), (torch.randn(3), torch.randn(3))
    outputs = {name: apply(Parameterless(), mesh=_mesh())(x, ys) for name, apply in APPLIES.items()}
    assert torch.equal(outputs["ours"], outputs["torch"])


# ----------------------------------------------------------------- the all-reduce hook's stream


def _hsdp_stream(apply: Apply, step: list[str]) -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    model = apply(MLP(), mesh=mesh)
    model.set_all_reduce_hook(lambda output: None, stream=torch.cpu.Stream())


def test_an_all_reduce_hook_stream_is_refused_under_hsdp_with_fsdp2s_value_error() -> None:
    error = _refused_as_torch(_hsdp_stream)
    assert type(error) is ValueError
    assert "fully_shard on MLP: set_all_reduce_hook(stream=...)" in str(error)


def test_an_all_reduce_hook_with_a_stream_runs_after_each_reduce_scatter_as_in_fsdp2() -> None:
    called: dict[str, list[torch.Size]] = {}
    for name, apply in APPLIES.items():
        torch.manual_seed(0)
        model = apply(MLP(), mesh=_mesh())
        seen = called[name] = []
        model.set_all_reduce_hook(_appending_shapes(seen), stream=torch.cpu.Stream())
        model(torch.randn(2, 8)).sum().backward()
    assert called["ours"] == called["torch"]
    assert len(called["ours"]) == 1


def _appending_shapes(seen: list[torch.Size]) -> Callable[[Tensor], None]:
    def hook(output: Tensor) -> None:
        seen.append(output.shape)

    return hook


def test_a_dtensor_assigned_after_apply_is_what_unshard_gathers_as_in_fsdp2() -> None:
    """FSDP2's ``unshard`` runs its group's lazy init: the assigned DTensor is gathered."""
    gathered: dict[str, Tensor] = {}
    for name, apply in APPLIES.items():
        model = apply(nn.Linear(4, 4), mesh=_mesh())
        weight = torch.arange(16.0).view(4, 4)
        model.weight = nn.Parameter(distribute_tensor(weight, _mesh(), [Shard(0)]))
        model.unshard()
        gathered[name] = model.weight.detach().clone()
        model.reshard()
        assert isinstance(model.weight, DTensor)
        assert torch.equal(model.weight.full_tensor(), weight)
    assert torch.equal(gathered["ours"], gathered["torch"])
    assert torch.equal(gathered["ours"], torch.arange(16.0).view(4, 4))
