"""replicate's DDP keywords refused where DDP refuses them, in one process (a group of one rank).

The numbers, against DistributedDataParallel on 2 gloo ranks, are in
``tests/distributed/test_replicate_keywords_gloo.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from torchcontract import InvalidTargetError, UnusedParameterError
from torchcontract.apis import _compat, replicate
from torchcontract.apis.replicate import ReplicateModule, manager_allreduce_hook

pytestmark = pytest.mark.usefixtures("one_rank_group")


def test_a_process_group_and_a_device_mesh_together_are_refused() -> None:
    mesh = init_device_mesh("cpu", (1,))
    with pytest.raises(ValueError, match=r"replicate on Linear: pass process_group or device_mesh"):
        replicate(nn.Linear(2, 2), process_group=mesh.get_group(), device_mesh=mesh)


def test_a_two_dimensional_mesh_is_refused() -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
    with pytest.raises(ValueError, match=r"device_mesh must be 1-D .* got 2 dims"):
        replicate(nn.Linear(2, 2), device_mesh=mesh)


def test_a_mesh_is_averaged_over_its_group() -> None:
    mesh = init_device_mesh("cpu", (1,))
    model = replicate(nn.Linear(2, 2), device_mesh=mesh)
    assert replicate.state(model).process_group is mesh.get_group()


@pytest.mark.parametrize("keyword", ["find_unused_parameters", "static_graph", "init_sync"])
def test_a_flag_that_is_not_a_bool_is_refused(keyword: str) -> None:
    with pytest.raises(TypeError, match=rf"replicate on Linear: {keyword}"):
        replicate(nn.Linear(2, 2), **{keyword: 1})  # type: ignore[arg-type]


def test_a_keyword_this_torchs_ddp_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compat, "DDP_KEYWORDS", _compat.DDP_KEYWORDS - {"init_sync"})
    with pytest.raises(TypeError, match=r"init_sync= is a keyword of a newer DistributedData"):
        replicate(nn.Linear(2, 2), init_sync=False)
    replicate(nn.Linear(2, 2))  # left at its default, it is not asked for


# ----------------------------------------------------------------- errors DDP gives at construction


def test_sync_batch_norm_on_cpu_is_refused_at_apply_as_ddp_refuses_it() -> None:
    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(2, 4), nn.SyncBatchNorm(4))

    with pytest.raises(ValueError, match=r"SyncBatchNorm layers only work with GPU modules"):
        DistributedDataParallel(model())
    target = model()
    with pytest.raises(ValueError, match=r"on Sequential: SyncBatchNorm layers only work"):
        replicate(target)
    assert not replicate.is_applied(target)
    assert type(target) is nn.Sequential


def test_a_destroyed_group_is_named_as_such() -> None:
    group = dist.new_group([0])
    dist.destroy_process_group(group)
    with pytest.raises(ValueError, match=r"process_group is not a group torch.distributed knows"):
        replicate(nn.Linear(2, 2), process_group=group)


def test_a_bucket_cap_mb_list_that_is_not_a_list_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Checked as DDP 2.13 would take it (on an older torch the keyword itself is refused)."""
    monkeypatch.setattr(_compat, "DDP_KEYWORDS", _compat.DDP_KEYWORDS | {"bucket_cap_mb_list"})
    with pytest.raises(TypeError, match=r"bucket_cap_mb_list takes a non-empty list of megabytes"):
        replicate(nn.Linear(2, 2), bucket_cap_mb_list=[])
    with pytest.raises(ValueError, match=r"bucket_cap_mb must be positive"):
        replicate(nn.Linear(2, 2), bucket_cap_mb_list=[1.0, -1.0])


def test_bucket_cap_mb_list_is_refused_where_ddp_lacks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compat, "DDP_KEYWORDS", _compat.DDP_KEYWORDS - {"bucket_cap_mb_list"})
    with pytest.raises(TypeError, match=r"bucket_cap_mb_list= is a keyword of a newer"):
        replicate(nn.Linear(2, 2), bucket_cap_mb_list=[1.0])


def test_gradients_no_backward_accumulated_are_named_at_the_next_forward() -> None:
    """torch.autograd.grad through the outputs (as zero-bubble pipeline schedules compute
    input gradients) accumulates nothing replicate could average: DDP's error, explained."""
    model = replicate(nn.Linear(2, 2))
    x = torch.randn(3, 2, requires_grad=True)
    torch.autograd.grad(model(x).sum(), x)
    with pytest.raises(UnusedParameterError) as raised:
        model(x)
    message = str(raised.value)
    assert message.startswith("Expected to have finished reduction in the prior iteration")
    assert "replicate on Linear got no gradient at all" in message
    assert "torch.autograd.grad" in message
    assert "zero-bubble pipeline schedule" in message
    assert "no_sync(module)" in message


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(2, 2)
        self.skipped = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.used(x)
        return out


def test_the_unused_parameter_error_waits_for_a_forward_with_grad_as_ddps() -> None:
    model = replicate(_Branchy())
    x = torch.randn(3, 2)
    model(x).sum().backward()
    with torch.no_grad():
        model(x)  # DDP checks only before a forward with grad enabled
    with pytest.raises(UnusedParameterError, match=r"got no gradient for 'skipped.weight'"):
        model(x)
    with pytest.raises(UnusedParameterError):
        model(x)  # and keeps raising, as DDP's


class _Reduced:
    """torchft's work and future, as far as the hook reads them: the tensor halved."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.waited = False

    def wait(self) -> torch.Tensor:
        self.waited = True
        return self.tensor

    def get_future(self) -> _Reduced:
        assert self.waited, "torchft's future is read only after the work ended"
        return self


class _HalvingManager:
    """A stand-in for torchft's Manager: an 'average' over two replica groups, one silent."""

    def __init__(self) -> None:
        self.calls = 0

    def allreduce(self, tensor: torch.Tensor, /) -> _Reduced:
        self.calls += 1
        return _Reduced(tensor / 2)


def test_the_manager_hook_averages_each_bucket_through_the_manager() -> None:
    model = replicate(nn.Linear(2, 2), find_unused_parameters=True)
    assert isinstance(model, ReplicateModule)
    manager = _HalvingManager()
    model.register_comm_hook(manager, manager_allreduce_hook)
    reference = nn.Linear(2, 2)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(3, 2)
    model(x).sum().backward()
    reference(x).sum().backward()
    assert manager.calls == 1  # one bucket
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert ours.grad is not None
        assert theirs.grad is not None
        assert torch.equal(ours.grad, theirs.grad / 2)


def test_ddps_list_of_names_to_ignore_must_be_a_collection_of_names() -> None:
    model = nn.Linear(2, 2)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["bias"])  # type: ignore[no-untyped-call]
    replicate(model)  # the list DDP's own setter writes is taken
    other = nn.Linear(2, 2)
    other._ddp_params_and_buffers_to_ignore = "bias"  # type: ignore[assignment]
    with pytest.raises(InvalidTargetError) as raised:
        replicate(other)
    assert str(raised.value) == (
        "replicate on Linear: _ddp_params_and_buffers_to_ignore must be a collection of "
        "parameter and buffer FQNs, got str; set it with "
        "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model"
    )
