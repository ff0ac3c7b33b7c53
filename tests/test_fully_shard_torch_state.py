"""What torch's own code finds where it reads FSDP2's state on a module fully_shard sharded.

Over PyTorch's fake process group of 2 ranks, side by side with PyTorch's
``fully_shard`` where it says something: the lookups (``fully_shard.state``,
``_get_module_state``, ``_get_fsdp_state``), the root and the states under it,
the param groups' calls, and that the state goes with a rolled-back apply, a
pickle and a dropped model. The numbers of the calls pipelining makes are checked
on gloo ranks, ``tests/distributed/test_fully_shard_pipelining_gloo.py``.
"""

from __future__ import annotations

import gc
import pickle
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed.fsdp
from fake_world import fake_mesh
from torch import nn
from torch.distributed._composable.contract import STATE_KEY
from torch.distributed._composable_state import (
    _get_module_state,
    _insert_module_state,
    _module_state_mapping,
)
from torch.distributed._composable_state import _State as TorchState
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from torchcontract import IncompatibleAPIError, contract
from torchcontract.apis import _compat, fully_shard
from torchcontract.apis.fully_shard._torch_state import (
    TorchFullyShardState,
    UnsupportedTorchStateError,
)

Shard = Callable[..., Any]
APIS: dict[str, Shard] = {"ours": fully_shard, "torch": torch_fully_shard}
#: Both APIs, PyTorch's where it runs on CPU.
BOTH = [
    "ours",
    pytest.param(
        "torch",
        marks=pytest.mark.skipif(
            not _compat.REFERENCE_FULLY_SHARD_ON_CPU,
            reason=f"PyTorch's fully_shard fails on CPU with torch {torch.__version__}",
        ),
    ),
]


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    with fake_mesh((2,)) as mesh:
        yield mesh


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 6)
        self.second = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.second(torch.tanh(self.first(x)))
        return out


def sharded(apply: Shard, mesh: DeviceMesh, *, root_parameters: bool = True) -> Net:
    """``Net`` with ``apply`` on ``first`` (``second`` too unless ``root_parameters``), the root."""
    torch.manual_seed(0)
    model = Net()
    apply(model.first, mesh=mesh)
    if not root_parameters:
        apply(model.second, mesh=mesh)
    apply(model, mesh=mesh)
    return model


def state(module: nn.Module) -> Any:
    """What pipelining reads: ``torch.distributed.fsdp.fully_shard.state(module)``."""
    return torch_fully_shard.state(module)  # type: ignore[attr-defined]


def train_step(model: nn.Module) -> None:
    model(torch.ones(3, 4)).sum().backward()


# ----------------------------------------------------------------- the lookups


def test_every_lookup_torch_makes_finds_one_state_per_application(mesh: DeviceMesh) -> None:
    model = sharded(fully_shard, mesh)
    found = state(model)
    assert isinstance(found, TorchFullyShardState)
    assert _get_module_state(model) is found
    assert isinstance(model, FSDPModule)
    fetched: object = model._get_fsdp_state()  # typed FSDPState by torch
    assert fetched is found
    assert state(model.first) is not found
    assert state(model.second) is None  # not applied to


@pytest.mark.parametrize("api", BOTH)
def test_an_application_to_a_list_shares_one_state_as_fsdp2s(mesh: DeviceMesh, api: str) -> None:
    model = Net()
    APIS[api]([model.first, model.second], mesh=mesh)
    assert state(model.first) is state(model.second) is not None
    assert state(model.first)._modules == (model.first, model.second)


def test_a_rolled_back_apply_leaves_nothing_for_torch_to_find(mesh: DeviceMesh) -> None:
    @contract()
    def shard_then_fail(module: nn.Module, mesh: DeviceMesh) -> None:
        fully_shard(module.get_submodule("first"), mesh=mesh)
        fully_shard(module, mesh=mesh)
        raise ValueError("planned failure after fully_shard sharded the module")

    model = Net()
    with pytest.raises(ValueError, match="planned failure"):
        shard_then_fail(model, mesh)
    for module in (model, model.first):
        assert state(module) is None
        assert _get_module_state(module) is None
        assert not module.__dict__.get(STATE_KEY)  # torch's lookup leaves an empty dict
    torch_fully_shard(model, mesh=mesh)  # torch's own state goes in where ours was
    assert not isinstance(state(model), TorchFullyShardState)


def test_a_dropped_model_frees_its_state_without_the_cycle_collector(mesh: DeviceMesh) -> None:
    gc.collect()  # earlier tests' models
    held = len(_module_state_mapping)
    model = sharded(fully_shard, mesh)
    train_step(model)
    found = weakref.ref(state(model))
    assert len(_module_state_mapping) == held + 2
    gc.disable()
    try:
        del model
        assert found() is None
        assert len(_module_state_mapping) == held
    finally:
        gc.enable()


def test_a_module_holding_torch_state_already_is_refused_and_left_unchanged(
    mesh: DeviceMesh,
) -> None:
    """torch's map of states takes one state per module: refused before it would assert."""
    model = Net()
    theirs = TorchState()
    _insert_module_state(model, theirs)
    with pytest.raises(IncompatibleAPIError, match=r"fully_shard cannot be applied to Net"):
        fully_shard(model, mesh=mesh)
    assert type(model) is Net
    assert _get_module_state(model) is theirs
    assert not model.__dict__.get(STATE_KEY)
    assert not any(isinstance(parameter, DTensor) for parameter in model.parameters())


def test_a_pickle_carries_no_state_for_torch(mesh: DeviceMesh) -> None:
    model = sharded(fully_shard, mesh)
    clone = pickle.loads(pickle.dumps(model))
    assert state(clone) is None
    assert state(clone.first) is None
    assert _get_module_state(clone) is None
    assert isinstance(state(model), TorchFullyShardState)  # the original keeps it


# ----------------------------------------------------------------- the root


@pytest.mark.parametrize("api", BOTH)
def test_the_root_is_unknown_until_the_first_forward_then_the_module_it_ran(
    mesh: DeviceMesh, api: str
) -> None:
    model = sharded(APIS[api], mesh)
    assert (state(model)._is_root, state(model.first)._is_root) == (None, None)
    assert state(model)._state_ctx.all_states == []
    train_step(model)
    assert (state(model)._is_root, state(model.first)._is_root) == (True, False)
    for module in (model, model.first):
        assert state(module)._state_ctx.all_states == [state(model), state(model.first)]


@pytest.mark.parametrize("api", BOTH)
def test_lazy_init_makes_the_root_as_fsdp2s(mesh: DeviceMesh, api: str) -> None:
    model = sharded(APIS[api], mesh)
    state(model)._lazy_init()
    assert (state(model)._is_root, state(model.first)._is_root) == (True, False)
    assert state(model.first)._state_ctx.all_states == [state(model), state(model.first)]


@pytest.mark.parametrize("api", BOTH)
def test_lazy_init_again_on_the_root_changes_nothing_as_fsdp2s(mesh: DeviceMesh, api: str) -> None:
    model = sharded(APIS[api], mesh)
    state(model)._lazy_init()
    state(model)._lazy_init()
    train_step(model)
    state(model)._lazy_init()  # after a forward made the root too
    assert (state(model)._is_root, state(model.first)._is_root) == (True, False)
    assert state(model)._state_ctx.all_states == [state(model), state(model.first)]
    train_step(model)


@pytest.mark.parametrize("api", BOTH)
def test_lazy_init_on_an_inner_module_after_the_roots_changes_nothing_as_fsdp2s(
    mesh: DeviceMesh, api: str
) -> None:
    model = sharded(APIS[api], mesh)
    train_step(model)
    state(model.first)._lazy_init()
    assert (state(model)._is_root, state(model.first)._is_root) == (True, False)
    assert state(model.first)._state_ctx.all_states == [state(model), state(model.first)]
    train_step(model)
    assert isinstance(model.first.weight, DTensor)  # resharded after forward: not a root


@pytest.mark.parametrize("api", BOTH)
def test_lazy_init_on_an_inner_module_first_makes_the_roots_forward_refuse_as_fsdp2s(
    mesh: DeviceMesh, api: str
) -> None:
    model = sharded(APIS[api], mesh)
    state(model.first)._lazy_init()
    assert (state(model)._is_root, state(model.first)._is_root) == (None, True)
    with pytest.raises(RuntimeError, match="has already been lazily initialized for first"):
        train_step(model)


@pytest.mark.parametrize("api", BOTH)
def test_the_context_tells_the_last_backward_as_set(mesh: DeviceMesh, api: str) -> None:
    model = sharded(APIS[api], mesh)
    train_step(model)
    assert isinstance(model, FSDPModule)
    model.set_is_last_backward(False)
    assert not state(model)._state_ctx.is_last_backward
    model.set_is_last_backward(True)
    assert state(model)._state_ctx.is_last_backward
    assert not state(model)._state_ctx.post_backward_final_callback_queued


# ----------------------------------------------------------------- the param groups


@pytest.mark.parametrize("api", BOTH)
def test_an_application_without_parameters_of_its_own_has_no_param_group(
    mesh: DeviceMesh, api: str
) -> None:
    model = sharded(APIS[api], mesh, root_parameters=False)
    assert state(model)._fsdp_param_groups == []
    assert state(model)._fsdp_param_group is None
    assert len(state(model.first)._fsdp_param_groups) == 1
    assert state(model.first)._fsdp_param_group.modules == (model.first,)


@pytest.mark.parametrize("api", BOTH)
def test_unshard_wait_and_reshard_through_the_param_group(mesh: DeviceMesh, api: str) -> None:
    model = sharded(APIS[api], mesh)
    state(model)._lazy_init()  # FSDP2's groups gather only once the root is known
    group = state(model.first)._fsdp_param_group
    group.unshard(async_op=True)
    group.wait_for_unshard()
    assert group.is_unsharded
    assert not isinstance(model.first.weight, DTensor)
    group.reshard()
    assert not group.is_unsharded
    assert isinstance(model.first.weight, DTensor)


@pytest.mark.parametrize("api", BOTH)
def test_post_backward_reduces_the_gradients_kept_without_sync_as_fsdp2s(
    mesh: DeviceMesh, api: str
) -> None:
    """Pipelining's end of step: backwards without sync, then every group's post-backward."""
    model = sharded(APIS[api], mesh)
    assert isinstance(model, FSDPModule)
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    train_step(model)
    assert all(parameter.grad is None for parameter in model.parameters() if _is_shard(parameter))
    model.set_requires_gradient_sync(True)
    model.set_reshard_after_backward(True)
    root = state(model)
    for each in root._state_ctx.all_states:
        for group in each._fsdp_param_groups:
            group.post_backward()
    root._root_post_backward_final_callback()
    assert all(isinstance(parameter, DTensor) for parameter in model.parameters())
    assert all(isinstance(parameter.grad, DTensor) for parameter in model.parameters())
    assert not any(group.is_unsharded for group in _param_groups(model))


@pytest.mark.parametrize("api", BOTH)
def test_post_backward_of_a_group_without_backward_only_reshards(
    mesh: DeviceMesh, api: str
) -> None:
    model = sharded(APIS[api], mesh)
    state(model)._lazy_init()
    group = state(model)._fsdp_param_group
    group.unshard()
    group.post_backward()
    assert not group.is_unsharded
    assert all(parameter.grad is None for parameter in model.parameters())


@pytest.mark.skipif(
    not hasattr(torch.distributed.fsdp, "share_comm_ctx"), reason="share_comm_ctx is newer"
)
def test_share_comm_ctx_accepts_our_modules(mesh: DeviceMesh) -> None:
    """torchtitan shares one stream context among pipeline stages; ours use no streams."""
    stages = [sharded(fully_shard, mesh), sharded(fully_shard, mesh)]
    share_comm_ctx: Callable[[list[FSDPModule]], None] = torch.distributed.fsdp.share_comm_ctx
    share_comm_ctx([stage for stage in stages if isinstance(stage, FSDPModule)])
    assert state(stages[1])._comm_ctx is state(stages[0])._comm_ctx
    train_step(stages[1])


@pytest.mark.skipif(
    not hasattr(FSDPModule, "_set_unshard_async_op"), reason="_set_unshard_async_op is newer"
)
def test_set_unshard_async_op_reaches_every_group(mesh: DeviceMesh) -> None:
    model = sharded(fully_shard, mesh)
    assert isinstance(model, FSDPModule)
    model._set_unshard_async_op(True)
    assert all(group.unshard_async_op for group in _param_groups(model))


def test_the_mixed_precision_policy_is_the_applications(mesh: DeviceMesh) -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = fully_shard(Net(), mesh=mesh, mp_policy=policy)
    assert state(model)._mp_policy == policy


# ----------------------------------------------------------------- what is not there


@pytest.mark.parametrize(
    ("read", "named"),
    [
        (lambda found: found._fsdp_param_group.fsdp_params, "_fsdp_param_group.fsdp_params"),
        (lambda found: found._state_ctx.post_optim_event, "_state_ctx.post_optim_event"),
        (lambda found: found._training_state, "_training_state"),
    ],
)
def test_what_has_no_counterpart_raises_naming_it_and_the_module(
    mesh: DeviceMesh, read: Callable[[Any], object], named: str
) -> None:
    model = sharded(fully_shard, mesh)
    with pytest.raises(UnsupportedTorchStateError, match=rf"fully_shard on Net: {named} of"):
        read(state(model))


def test_what_has_no_counterpart_is_an_attribute_error_for_hasattr(mesh: DeviceMesh) -> None:
    found = state(sharded(fully_shard, mesh))
    assert not hasattr(found, "_training_state")
    assert issubclass(UnsupportedTorchStateError, AttributeError)


# ----------------------------------------------------------------- helpers


def _is_shard(parameter: nn.Parameter) -> bool:
    return isinstance(parameter, DTensor)


def _param_groups(model: nn.Module) -> list[Any]:
    return [
        group
        for module in model.modules()
        if isinstance(module, FSDPModule)
        for group in state(module)._fsdp_param_groups
    ]
