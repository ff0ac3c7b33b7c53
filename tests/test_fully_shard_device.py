"""fully_shard moves what it manages onto the mesh's device at apply, as FSDP2 does.

Only the CPU is here, where nothing moves; so the mesh's device is made an
accelerator's for the apply, and the move a copy that stays on the CPU (a new storage
for each tensor moved). What is checked: which tensors move (FSDP2's own selection
functions give the same, on the same model), that each moves in place (the same
object), and that a rolled-back apply moves them back. The move to a real GPU runs
under the ``gpu`` marker (``distributed/test_cuda_parity.py``).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
import torch.distributed.fsdp._fully_shard._fsdp_init as fsdp_init
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal.two_tensor import TwoTensor

from torchcontract import contract
from torchcontract.apis import fully_shard

_api = importlib.import_module("torchcontract.apis.fully_shard._api")
_device = importlib.import_module("torchcontract.apis.fully_shard._device")

pytestmark = pytest.mark.usefixtures("one_rank_group")

ACCELERATOR = torch.device("cuda", 0)


@pytest.fixture
def mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (1,))


@pytest.fixture
def moved(monkeypatch: pytest.MonkeyPatch) -> list[Tensor]:
    """The tensors each apply moves, in order; the mesh's device an accelerator's."""
    seen: list[Tensor] = []

    def copy_to(tensor: Tensor, device: torch.device) -> Tensor:
        assert device == ACCELERATOR
        seen.append(tensor)
        return tensor.detach().clone()  # a new storage, as a move's copy

    monkeypatch.setattr(_api, "mesh_device", lambda mesh: ACCELERATOR)
    monkeypatch.setattr(_device, "_copy_to", copy_to)
    return seen


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)


class Model(nn.Module):
    """A first layer, two blocks (the first holding the model's buffer under a second
    name too) and a last norm."""

    scale: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.inner = Block()
        self.other = Block()
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.ones(1))
        self.inner.register_buffer("shared", self.scale)


def _model() -> Model:
    torch.manual_seed(0)
    return Model()


def _namer(model: nn.Module) -> Callable[[list[Tensor]], list[str]]:
    """Names the tensors of ``model`` as it is now (the first name of each), sorted."""
    names: dict[int, str] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        names.setdefault(id(tensor), name)
    return lambda tensors: sorted(names[id(tensor)] for tensor in tensors)


def _fsdp2_would_move(model: nn.Module, ignored: set[nn.Parameter]) -> list[str]:
    """What FSDP2's apply to ``model`` moves, by its own selection functions."""
    if "ignored_params" in inspect.signature(fsdp_init._get_managed_modules).parameters:
        modules = fsdp_init._get_managed_modules((model,), ignored)
        parameters, buffers = fsdp_init._get_managed_states(modules, ignored)
    else:  # a release before ignored_params: the same walk, the ignored left out after
        modules = fsdp_init._get_managed_modules((model,))
        parameters, buffers = fsdp_init._get_managed_states(modules)
        left_out = {id(parameter) for parameter in ignored}
        parameters = [parameter for parameter in parameters if id(parameter) not in left_out]
    return _namer(model)([*parameters, *buffers])


def test_the_parameters_and_buffers_moved_are_fsdp2s(mesh: DeviceMesh, moved: list[Tensor]) -> None:
    """A nested application first: the root's apply leaves its tensors (already moved),
    the ignored parameter, and moves the rest, each once; as FSDP2 selects them on the
    same model with FSDP2's nested application."""
    model = _model()
    named = _namer(model)
    fully_shard(model.inner, mesh=mesh)
    assert named(moved) == [
        "inner.linear.bias",
        "inner.linear.weight",
        "inner.norm.bias",
        "inner.norm.num_batches_tracked",
        "inner.norm.running_mean",
        "inner.norm.running_var",
        "inner.norm.weight",
        "scale",  # the block's too, as "inner.shared"
    ]
    theirs = _model()
    torch_fully_shard(theirs.inner, mesh=mesh)
    expected = _fsdp2_would_move(theirs, {theirs.first.bias})
    ignored = {model.first.bias}
    moved.clear()
    named = _namer(model)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    assert named(moved) == expected
    assert "first.bias" not in expected
    assert not any(name.startswith("inner.") for name in expected)


def test_each_tensor_moves_in_place(mesh: DeviceMesh, moved: list[Tensor]) -> None:
    model = _model()
    scale, running_mean = model.scale, model.norm.running_mean
    assert running_mean is not None
    before = scale.data_ptr(), running_mean.data_ptr()
    fully_shard(model, mesh=mesh)
    assert model.scale is scale
    assert model.norm.running_mean is running_mean
    assert (scale.data_ptr(), running_mean.data_ptr()) != before  # the move's new storage


def test_a_rolled_back_apply_moves_everything_back(mesh: DeviceMesh, moved: list[Tensor]) -> None:
    model = _model()
    storages = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}
    originals = dict(model.named_parameters())

    @contract()
    def failing(module: nn.Module) -> None:
        fully_shard(module, mesh=mesh)
        raise RuntimeError("fails after sharding")

    with pytest.raises(RuntimeError, match="fails after sharding"):
        failing(model)
    assert len(moved) == len(set(storages.values()))  # every parameter and buffer moved
    assert dict(model.named_parameters()) == originals
    assert {name: tensor.data_ptr() for name, tensor in model.state_dict().items()} == storages


def test_nothing_moves_on_the_meshs_own_device(mesh: DeviceMesh) -> None:
    model = _model()
    storages = {name: tensor.data_ptr() for name, tensor in model.named_buffers()}
    fully_shard(model, mesh=mesh)
    assert {name: tensor.data_ptr() for name, tensor in model.named_buffers()} == storages


def test_tensors_on_the_meta_device_stay_there(mesh: DeviceMesh, moved: list[Tensor]) -> None:
    with torch.device("meta"):
        model = _model()
    fully_shard(model, mesh=mesh)
    assert moved == []
    assert all(buffer.is_meta for buffer in model.buffers())


def _first_of(two: Tensor) -> Tensor:
    """A ``TwoTensor``'s first inner tensor."""
    first: Tensor = cast(Any, two).a
    return first


def test_a_wrapper_subclass_is_swapped_in_place_and_back(moved: list[Tensor]) -> None:
    """Its data cannot be set: its contents are swapped, as FSDP2 does, the same objects
    kept (a parameter stays one, frozen or not), and swapped back on rollback."""
    wrapper: Any = TwoTensor  # untyped in torch
    frozen = nn.Parameter(wrapper(torch.ones(2), torch.ones(2)), requires_grad=False)
    inner = _first_of(frozen).data_ptr()
    plain = torch.zeros(3)
    undo = _device.move_to(ACCELERATOR, [frozen], [plain])
    assert moved == [frozen, plain]
    assert isinstance(frozen, nn.Parameter)
    assert isinstance(frozen, TwoTensor)
    assert not frozen.requires_grad
    assert _first_of(frozen).data_ptr() != inner  # the copy's contents
    undo()
    assert _first_of(frozen).data_ptr() == inner
    assert torch.equal(_first_of(frozen), torch.ones(2))
