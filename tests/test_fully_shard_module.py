"""fully_shard's modules as FSDPModules, and its FSDP2 keywords, in one process.

Over PyTorch's fake process group of 2 ranks: what needs no numbers (classes,
methods, copies, refusals). The numbers, against FSDP2 on 2 gloo ranks, are in
``tests/distributed/test_fully_shard_module_gloo.py``.
"""

from __future__ import annotations

import copy
import gc
import pickle
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from fake_world import fake_mesh
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
)
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard import _fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchcontract import ContractError, NotAppliedError, contract
from torchcontract.apis import _compat, fully_shard
from torchcontract.apis.fully_shard import FullyShardModule
from torchcontract.apis.fully_shard._managed import MANAGED

#: The methods refused with NotImplementedError: only an accelerator's collectives use them.
ACCELERATOR_ONLY: dict[str, Callable[[Any], object]] = {
    "set_post_optim_event": lambda module: fsdp(module).set_post_optim_event(torch.Event()),
    "set_allocate_memory_from_process_group_for_comm": lambda module: fsdp(
        module
    ).set_allocate_memory_from_process_group_for_comm(True),
    "set_symm_mem_for_comm": lambda module: fsdp(module).set_symm_mem_for_comm(),
    "set_separate_reduce_scatter_group": lambda module: fsdp(
        module
    ).set_separate_reduce_scatter_group(),
}


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
        out: torch.Tensor = self.second(self.first(x))
        return out


def sharded(mesh: DeviceMesh) -> Net:
    model = Net()
    fully_shard(model.first, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def fsdp(module: object) -> FullyShardModule:
    """``module`` as the ``FullyShardModule`` it must be."""
    assert isinstance(module, FullyShardModule)
    return module


def _public_methods() -> set[str]:
    return {
        name
        for name in dir(FSDPModule)
        if not name.startswith("_") and not hasattr(nn.Module, name)
    }


# ----------------------------------------------------------------- the class


def test_a_sharded_module_is_an_fsdp_module_of_its_own_class(mesh: DeviceMesh) -> None:
    model = sharded(mesh)
    assert isinstance(model, Net)
    assert isinstance(model, FSDPModule)
    assert isinstance(fsdp(model), FullyShardModule)
    assert isinstance(model.first, FSDPModule)
    assert isinstance(model.first, nn.Linear)
    assert not isinstance(model.second, FSDPModule)
    assert type(model).__name__ == "FSDPNet"
    assert repr(model).startswith("FSDPNet(")


def test_one_class_is_made_per_original_class(mesh: DeviceMesh) -> None:
    assert type(sharded(mesh)) is type(sharded(mesh))
    assert type(sharded(mesh).first) is type(fully_shard(nn.Linear(2, 2), mesh=mesh))


def test_every_public_fsdp_module_method_is_ours(mesh: DeviceMesh) -> None:
    """Whatever the installed torch's ``FSDPModule`` has, ours defines (none is inherited)."""
    methods = _public_methods()
    assert {"reshard", "unshard", "set_requires_gradient_sync", "set_is_last_backward"} <= methods
    assert {name for name in methods if name not in vars(FullyShardModule)} == set()


def test_prefetch_methods_set_the_lists_of_the_prefetch_functions(mesh: DeviceMesh) -> None:
    """The methods are ``set_modules_to_*_prefetch`` (tests/test_fully_shard_prefetch.py)."""
    model = sharded(mesh)
    fsdp(model).set_modules_to_forward_prefetch([fsdp(model.first)])
    fsdp(model).set_modules_to_backward_prefetch([fsdp(model.first)])
    group = MANAGED.group_of(model)
    assert group is not None
    assert [ref() for ref in group.forward_prefetch] == [MANAGED.group_of(model.first)]
    assert [ref() for ref in group.backward_prefetch] == [MANAGED.group_of(model.first)]
    with pytest.raises(NotAppliedError, match=r"set_modules_to_forward_prefetch: modules\[0\]"):
        fsdp(model).set_modules_to_forward_prefetch([model.second])  # type: ignore[list-item]


@pytest.mark.parametrize("method", sorted(ACCELERATOR_ONLY))
def test_accelerator_only_methods_are_refused_naming_them(mesh: DeviceMesh, method: str) -> None:
    model = sharded(mesh)
    with pytest.raises(
        NotImplementedError, match=rf"fully_shard on Net: {method} is not supported"
    ):
        ACCELERATOR_ONLY[method](model)


def test_reduce_scatter_max_input_buffers_is_recorded_recursively(mesh: DeviceMesh) -> None:
    model = sharded(mesh)
    fsdp(model).set_reduce_scatter_max_input_buffers(3)
    assert fully_shard.state(model).reduce_scatter_max_input_buffers == 3
    assert fully_shard.state(model.first).reduce_scatter_max_input_buffers == 3
    fsdp(model).set_reduce_scatter_max_input_buffers(2, recurse=False)
    assert fully_shard.state(model).reduce_scatter_max_input_buffers == 2
    assert fully_shard.state(model.first).reduce_scatter_max_input_buffers == 3


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (True, TypeError, "takes an int, got bool"),
        (2.0, TypeError, "takes an int, got float"),
        (0, ValueError, "takes a count of at least 1, got 0"),
    ],
)
def test_reduce_scatter_max_input_buffers_is_checked_as_fsdp2(
    mesh: DeviceMesh, value: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(
        error, match=rf"fully_shard on Net: set_reduce_scatter_max_input_buffers {message};"
    ):
        fsdp(sharded(mesh)).set_reduce_scatter_max_input_buffers(value)  # type: ignore[arg-type]
    assert fully_shard.state(sharded(mesh)).reduce_scatter_max_input_buffers == 1
    if _compat.REFERENCE_FULLY_SHARD_ON_CPU:
        reference = torch_fully_shard(Net(), mesh=mesh)
        with pytest.raises(error):
            reference.set_reduce_scatter_max_input_buffers(value)  # type: ignore[arg-type]


class _Owning:
    """A custom collective that keeps the model it serves, as FSDP2 lets one."""

    def __init__(self, owner: nn.Module, calls: list[str]) -> None:
        self.owner = owner
        self.calls = calls

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class OwnedGather(_Owning):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        self.calls.append("gather")
        work = dist.all_gather_into_tensor(
            output_tensor, input_tensor, group=group, async_op=async_op
        )
        return cast("dist.Work | None", work)


class OwnedScatter(_Owning):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        self.calls.append("scatter")
        work = dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )
        return cast("dist.Work | None", work)


def _noting(module: nn.Module, calls: list[str]) -> Callable[[torch.Tensor], None]:
    """A hook whose closure holds ``module``."""
    return lambda output: calls.append(type(module).__name__)


def test_hooks_and_collectives_that_reach_the_module_are_taken_and_freed_with_it(
    mesh: DeviceMesh,
) -> None:
    """A bound method, a closure and custom collectives holding the model, as FSDP2 takes
    them: used, and gone with the model (the store's records never hold them)."""
    calls: list[str] = []
    model = sharded(mesh)
    fsdp(model).set_all_reduce_hook(_noting(model, calls))
    fsdp(model.first).set_all_reduce_hook(model.first.zero_grad)  # type: ignore[arg-type]
    fsdp(model).set_custom_all_gather(OwnedGather(model, calls))
    fsdp(model).set_custom_reduce_scatter(OwnedScatter(model, calls))
    torch.autograd.backward(model(torch.randn(3, 4)).sum())
    assert sorted(set(calls)) == ["FSDPNet", "gather", "scatter"]
    freed = weakref.ref(model)
    del model
    gc.collect()
    assert freed() is None


def test_an_all_reduce_hook_on_a_stream_runs_without_hsdp(mesh: DeviceMesh) -> None:
    model, seen = sharded(mesh), list[torch.Tensor]()
    fsdp(model).set_all_reduce_hook(seen.append, stream=torch.cpu.Stream())  # type: ignore[arg-type]
    torch.autograd.backward(model(torch.randn(3, 4)).sum())
    assert len(seen) == 1


def test_an_all_reduce_hook_on_a_stream_is_refused_under_hsdp(mesh: DeviceMesh) -> None:
    hsdp = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    model = fully_shard(Net(), mesh=hsdp)
    with pytest.raises(ValueError, match=r"stream cannot be set when using native HSDP"):
        fsdp(model).set_all_reduce_hook(print, stream=torch.cpu.Stream())  # type: ignore[arg-type]


def test_set_reshard_after_forward_takes_only_a_bool(mesh: DeviceMesh) -> None:
    with pytest.raises(ValueError, match=r"fully_shard on Net: set_reshard_after_forward takes"):
        fsdp(sharded(mesh)).set_reshard_after_forward(1)  # type: ignore[arg-type]


def test_the_deprecated_divide_factor_warns_and_sets_the_new_one(mesh: DeviceMesh) -> None:
    model = sharded(mesh)
    with pytest.warns(FutureWarning, match="set_gradient_divide_factor"):
        fsdp(model).set_reduce_scatter_divide_factor(4.0)
    assert fully_shard.state(model).gradient_divide_factor == 4.0
    assert fully_shard.state(model.first).gradient_divide_factor is None


def test_recursive_setters_reach_inner_applications_and_others_do_not(mesh: DeviceMesh) -> None:
    model = sharded(mesh)
    fsdp(model).set_requires_gradient_sync(False)
    fsdp(model).set_reshard_after_backward(False, recurse=False)
    fsdp(model).set_unshard_in_backward(False)
    inner, outer = fully_shard.state(model.first), fully_shard.state(model)
    assert (outer.sync_gradients, inner.sync_gradients) == (False, False)
    assert (outer.reshard_after_backward, inner.reshard_after_backward) == (False, True)
    assert (outer.unshard_in_backward, inner.unshard_in_backward) == (False, True)


def test_unshard_and_reshard_as_methods(mesh: DeviceMesh) -> None:
    model = sharded(mesh)
    assert fsdp(model).unshard() is None
    assert not isinstance(model.second.weight, DTensor)
    assert isinstance(model.first.weight, DTensor)  # not recursive
    fsdp(model).reshard()
    assert isinstance(model.second.weight, DTensor)
    handle = fsdp(model).unshard(async_op=True)
    assert isinstance(handle, UnshardHandle)
    assert isinstance(model.second.weight, DTensor)  # started, not yet waited for
    handle.wait()
    assert not isinstance(model.second.weight, DTensor)


def test_a_class_set_by_hand_without_fully_shard_raises_not_applied() -> None:
    model = Net()
    model.__class__ = type(FullyShardModule.__name__, (FullyShardModule, Net), {})
    with pytest.raises(NotAppliedError, match=r"fully_shard is not applied to"):
        fsdp(model).reshard()


def test_reset_iter_state_off_the_root_is_refused(mesh: DeviceMesh) -> None:
    model = sharded(mesh)
    with pytest.raises(ContractError, match=r"reset_iter_state must be called on the root"):
        fsdp(model.first).reset_iter_state()


# ----------------------------------------------------------------- copies and rollback


def test_a_pickle_is_of_the_original_class(mesh: DeviceMesh) -> None:
    model = sharded(mesh)
    clone = pickle.loads(pickle.dumps(model))
    assert type(clone) is Net
    assert type(clone.first) is nn.Linear
    assert not fully_shard.is_applied(clone)
    assert isinstance(clone.first.weight, DTensor)
    assert type(model) is not Net  # the original keeps its class


def test_a_deep_copy_is_refused_naming_the_module_and_the_state_dict(mesh: DeviceMesh) -> None:
    """As FSDP2 refuses it: a copy's shards would have no group to gather them."""
    model = sharded(mesh)
    refused = r"fully_shard on Net: a sharded module cannot be deep-copied.*save its state dict"
    with pytest.raises(ContractError, match=refused):
        copy.deepcopy(model)
    parent = nn.Sequential(nn.Linear(2, 2))
    fully_shard(parent[0], mesh=mesh)
    with pytest.raises(ContractError, match=r"fully_shard on Linear: .*cannot be deep-copied"):
        copy.deepcopy(parent)  # a sharded module inside: refused as well
    assert fully_shard.is_applied(model)  # the original is untouched
    assert type(model) is not Net


def _sharded_sequential(api: str, mesh: DeviceMesh) -> nn.Sequential:
    """A two-layer ``nn.Sequential`` sharded by ours or by FSDP2."""
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    if api == "ours":
        return fully_shard(model, mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    return model


@pytest.mark.parametrize("api", ["ours", "FSDP2"])
def test_slicing_a_sharded_sequential_builds_a_sequential(mesh: DeviceMesh, api: str) -> None:
    """``FSDPModule.__new__`` builds the original class; torch 2.6's finds it at a fixed index."""
    model = _sharded_sequential(api, mesh)
    part = model[0:1]
    assert type(part) is nn.Sequential
    assert list(part) == [model[0]]


@pytest.mark.parametrize("api", ["ours", "FSDP2"])
def test_copy_constructing_a_sharded_sequential_builds_a_sequential(
    mesh: DeviceMesh, api: str
) -> None:
    model = _sharded_sequential(api, mesh)
    copied = type(model)(*model)
    assert type(copied) is nn.Sequential
    assert list(copied) == list(model)


@pytest.mark.parametrize("api", ["ours", "FSDP2"])
def test_copy_constructing_without_new_init_leaves_init_to_the_caller(
    mesh: DeviceMesh, api: str
) -> None:
    """Inside torch's ``disable_fsdp_module_new_init``, ``__new__`` runs no ``__init__``.

    A torch without that context always runs it (``_compat.fsdp_module_new_runs_init``).
    """
    disabled = getattr(_fully_shard, "disable_fsdp_module_new_init", None)
    if disabled is None:
        assert _compat.fsdp_module_new_runs_init()
        return
    model = _sharded_sequential(api, mesh)
    with disabled():
        copied = type(model)(*model)
    assert type(copied) is nn.Sequential
    assert "_modules" not in vars(copied)
    assert list(type(model)(*model)) == list(model)  # outside it, __init__ runs again


class Stack(nn.ModuleList):
    """A list of layers with a forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x)
        return x


def test_slicing_and_copying_a_sharded_module_list_build_its_class(mesh: DeviceMesh) -> None:
    """FSDP2 refuses a ``ModuleList`` (2.6: every one; later: one without a forward)."""
    stack = fully_shard(Stack([nn.Linear(2, 2), nn.ReLU()]), mesh=mesh)
    part, copied = stack[0:1], type(stack)(list(stack))
    assert (type(part), type(copied)) == (Stack, Stack)
    assert (list(part), list(copied)) == ([stack[0]], list(stack))


@contract()
def _shard_then_fail(module: nn.Module, mesh: DeviceMesh) -> None:
    fully_shard(module.get_submodule("first"), mesh=mesh)
    fully_shard(module, mesh=mesh)
    raise ValueError("planned failure after fully_shard sharded the module")


def test_a_rolled_back_apply_restores_the_original_classes(mesh: DeviceMesh) -> None:
    model = Net()
    with pytest.raises(ValueError, match="planned failure"):
        _shard_then_fail(model, mesh)
    assert type(model) is Net
    assert type(model.first) is nn.Linear
    assert not any(isinstance(parameter, DTensor) for parameter in model.parameters())


def test_a_refused_apply_keeps_the_class(mesh: DeviceMesh) -> None:
    model = Net()
    with pytest.raises(TypeError, match="mp_policy"):
        fully_shard(model, mesh=mesh, mp_policy=torch.bfloat16)  # type: ignore[call-overload]
    assert type(model) is Net


# ----------------------------------------------------------------- keywords


def test_the_policies_are_recorded(mesh: DeviceMesh) -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    model = fully_shard(Net(), mesh=mesh, mp_policy=policy, offload_policy=CPUOffloadPolicy())
    record = fully_shard.state(model)
    assert record.mp_policy == policy
    assert record.offload_policy == CPUOffloadPolicy()
    assert fully_shard.state(fully_shard(Net(), mesh=mesh)).mp_policy == MixedPrecisionPolicy()


def test_cpu_offload_on_an_accelerator_mesh_is_refused(mesh: DeviceMesh) -> None:
    accelerator = DeviceMesh("cuda", [0, 1])
    model = Net()
    with pytest.raises(
        NotImplementedError, match=r"offload_policy=CPUOffloadPolicy\(\) on a 'cuda'"
    ):
        fully_shard(model, mesh=accelerator, offload_policy=CPUOffloadPolicy())
    assert type(model) is Net
    assert not fully_shard.is_applied(model)


def test_a_wrong_offload_policy_is_refused(mesh: DeviceMesh) -> None:
    with pytest.raises(TypeError, match=r"offload_policy must be a torch.distributed.fsdp"):
        fully_shard(Net(), mesh=mesh, offload_policy="cpu")  # type: ignore[call-overload]
    assert OffloadPolicy() == fully_shard.state(fully_shard(Net(), mesh=mesh)).offload_policy


def test_ignored_params_stay_plain_and_unmanaged(mesh: DeviceMesh) -> None:
    model = Net()
    ignored = set(model.second.parameters())
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    assert set(model.second.parameters()) == ignored
    assert all(isinstance(parameter, DTensor) for parameter in model.first.parameters())
    record = fully_shard.state(model)
    assert record.ignored == ("second.weight", "second.bias")
    assert record.managed == ("first.weight", "first.bias")


def test_ignored_params_must_be_a_set_of_parameters(mesh: DeviceMesh) -> None:
    model = Net()
    with pytest.raises(TypeError, match=r"ignored_params must be a set of nn.Parameter"):
        fully_shard(model, mesh=mesh, ignored_params=[model.first.weight])  # type: ignore[call-overload]


def _first_dim_from_the_end(parameter: nn.Parameter) -> Shard:
    return Shard(-parameter.dim())


@pytest.mark.parametrize(
    "placement_fn",
    [lambda parameter: None, lambda parameter: Shard(0), _first_dim_from_the_end],
    ids=["none", "shard_0", "shard_minus_ndim"],
)
def test_placements_on_dim_0_shard_as_the_default(
    mesh: DeviceMesh, placement_fn: Callable[[nn.Parameter], Shard | None]
) -> None:
    model = fully_shard(Net(), mesh=mesh, shard_placement_fn=placement_fn)
    assert all(
        isinstance(parameter, DTensor) and parameter.placements == (Shard(0),)
        for parameter in model.parameters()
    )


def _dim_1_of_matrices(parameter: nn.Parameter) -> Shard | None:
    return Shard(1) if parameter.dim() == 2 else None


def test_a_placement_on_dim_1_shards_the_matrices_on_dim_1(mesh: DeviceMesh) -> None:
    model = fully_shard(Net(), mesh=mesh, shard_placement_fn=_dim_1_of_matrices)
    first = model.first.weight
    assert isinstance(first, DTensor)
    assert first.placements == (Shard(1),)
    assert first.to_local().shape == (6, 2)
    assert first.shape == (6, 4)
    bias = model.first.bias
    assert isinstance(bias, DTensor)
    assert bias.placements == (Shard(0),)


def test_a_placement_out_of_range_is_refused_naming_the_parameter(mesh: DeviceMesh) -> None:
    model = Net()
    with pytest.raises(ValueError, match=r"Shard\(2\) for parameter 'first.weight' of 2 dims"):
        fully_shard(model, mesh=mesh, shard_placement_fn=lambda parameter: Shard(2))
    assert type(model) is Net
    assert not any(isinstance(parameter, DTensor) for parameter in model.parameters())


def test_an_uneven_placement_on_another_dim_than_0_is_refused(mesh: DeviceMesh) -> None:
    """As FSDP2: only dim 0 is padded; dim 1 of 3 does not split over 2 ranks."""
    model = nn.Sequential(nn.Linear(3, 4))
    with pytest.raises(NotImplementedError, match=r"parameter '0.weight', whose dim 1 of size 3"):
        fully_shard(model, mesh=mesh, shard_placement_fn=_dim_1_of_matrices)
    assert type(model) is nn.Sequential
    assert not any(isinstance(parameter, DTensor) for parameter in model.parameters())


def test_a_placement_that_is_not_a_shard_is_refused(mesh: DeviceMesh) -> None:
    with pytest.raises(TypeError, match=r"shard_placement_fn returned a Replicate"):
        fully_shard(Net(), mesh=mesh, shard_placement_fn=lambda parameter: Replicate())  # type: ignore[arg-type,return-value]


def test_a_placement_function_that_is_not_callable_is_refused(mesh: DeviceMesh) -> None:
    refused = (
        "fully_shard on Net: shard_placement_fn must be callable or None, got 0; pass a "
        "function of a parameter returning Shard(dim) or None"
    )
    with pytest.raises(TypeError, match=f"^{re.escape(refused)}$"):
        fully_shard(Net(), mesh=mesh, shard_placement_fn=0)  # type: ignore[call-overload]


def test_dp_mesh_dims_of_another_type_is_refused(mesh: DeviceMesh) -> None:
    """Where torch has no ``DataParallelMeshDims``, any value is refused as needing it."""
    refused = "must be a" if _compat.DATA_PARALLEL_MESH_DIMS is not None else "needs"
    with pytest.raises(TypeError, match=rf"dp_mesh_dims {refused} torch.distributed.fsdp.Data"):
        fully_shard(Net(), mesh=mesh, dp_mesh_dims=object())  # type: ignore[call-overload]
