"""replicate's module as DDP's wrapper: its class, methods, copies and refusals, in one process.

Over a gloo group of one rank: what needs no numbers. The numbers, against
DistributedDataParallel on 2 gloo ranks, are in ``tests/distributed/``
(``test_replicate_join_gloo.py``, ``test_replicate_comm_hooks_gloo.py``).
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join, Joinable
from torch.nn.parallel import DistributedDataParallel

from torchcontract import ContractError, NotAppliedError, contract
from torchcontract.apis import no_sync, replicate
from torchcontract.apis.replicate import ReplicateModule

pytestmark = pytest.mark.usefixtures("one_rank_group")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.second = nn.Linear(3, 1)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.second(self.first(x))
        return out


def ddp(module: object) -> ReplicateModule:
    """``module`` as the ``ReplicateModule`` it must be."""
    assert isinstance(module, ReplicateModule)
    return module


def _hook(state: object, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def test_a_replicated_module_is_a_replicate_module_of_its_own_class() -> None:
    model = replicate(Net())
    assert isinstance(model, Net)
    assert isinstance(model, ReplicateModule)
    assert isinstance(model, Joinable)
    assert type(model).__name__ == "ReplicateNet"
    assert type(model).__qualname__ == "Net"  # errors keep naming the user's class
    assert type(model.first) is nn.Linear  # only the module replicate was applied to


def test_one_class_is_made_per_original_class() -> None:
    assert type(replicate(Net())) is type(replicate(Net()))


def test_join_device_and_process_group_are_the_applications() -> None:
    model = replicate(Net())
    assert ddp(model).join_device == torch.device("cpu")
    assert ddp(model).join_process_group is replicate.state(model).process_group


def test_join_returns_a_join_of_the_module() -> None:
    model = replicate(Net())
    join = ddp(model).join()
    assert isinstance(join, Join)
    with join:
        model(torch.ones(2, 3)).sum().backward()
    assert replicate.state(model).step == 1


def test_the_no_sync_method_switches_gradient_sync_off_and_back() -> None:
    model = replicate(Net())
    with ddp(model).no_sync():
        assert not replicate.state(model).sync_gradients
        with no_sync(model):  # the function and the method nest
            assert not replicate.state(model).sync_gradients
        assert not replicate.state(model).sync_gradients
    assert replicate.state(model).sync_gradients


def test_a_deep_copy_and_a_pickle_are_of_the_original_class() -> None:
    model = replicate(Net())
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(clone) is Net
        assert not replicate.is_applied(clone)
    assert type(model) is not Net  # the original keeps its class


def test_indexing_a_replicated_container_builds_the_original_class() -> None:
    model = replicate(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    assert type(model[0:1]) is nn.Sequential


@contract()
def _replicate_then_fail(module: nn.Module) -> None:
    replicate(module)
    raise ValueError("planned failure after replicate")


def test_a_rolled_back_apply_restores_the_original_class() -> None:
    model = Net()
    with pytest.raises(ValueError, match="planned failure"):
        _replicate_then_fail(model)
    assert type(model) is Net
    replicate(model)  # and it can be applied again
    assert isinstance(model, ReplicateModule)


def test_a_refused_apply_keeps_the_class() -> None:
    model = Net()
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive"):
        replicate(model, bucket_cap_mb=0)
    assert type(model) is Net


def test_a_class_set_by_hand_without_replicate_raises_not_applied() -> None:
    model = Net()
    model.__class__ = type(replicate(Net()))
    with pytest.raises(NotAppliedError, match=r"replicate is not applied to Net"):
        ddp(model).register_comm_hook(None, _hook)
    with pytest.raises(NotAppliedError, match=r"replicate is not applied to Net"):
        Join([ddp(model)])


def test_a_second_comm_hook_is_refused() -> None:
    model = ddp(replicate(Net()))
    model.register_comm_hook(None, _hook)
    with pytest.raises(ContractError, match=r"replicate on Net: register_comm_hook can only"):
        model.register_comm_hook(None, _hook)


def test_a_hook_that_is_not_callable_is_refused() -> None:
    model = ddp(replicate(Net()))
    with pytest.raises(TypeError, match=r"replicate on Net: register_comm_hook takes a callable"):
        model.register_comm_hook(None, 3)  # type: ignore[arg-type]


def _errors_of(
    register: Callable[[object, Any], None], hook: object
) -> tuple[type[BaseException], str] | None:
    """The exception ``register(None, hook)`` raises, its type and message; None if none."""
    try:
        register(None, hook)
    except (TypeError, ValueError) as error:
        return type(error), str(error)
    return None


def _wrong_bucket(state: object, bucket: Tensor) -> torch.futures.Future[Tensor]:
    raise AssertionError("never called")


def _wrong_return(state: object, bucket: GradBucket) -> Tensor:
    raise AssertionError("never called")


# DDP compares the annotations as written: give it objects, not this module's strings.
_wrong_bucket.__annotations__ = {"bucket": Tensor, "return": torch.futures.Future[Tensor]}
_wrong_return.__annotations__ = {"bucket": GradBucket, "return": Tensor}


def test_a_hook_with_string_annotations_is_accepted() -> None:
    """``from __future__ import annotations`` in the hook's module: DDP refuses, replicate reads."""
    ddp(replicate(Net())).register_comm_hook(None, _hook)
    with pytest.raises(ValueError, match=r"bucket annotation should be dist\.GradBucket"):
        DistributedDataParallel(Net()).register_comm_hook(None, _hook)


@pytest.mark.parametrize(
    "hook",
    [default_hooks.bf16_compress_hook, _wrong_bucket, _wrong_return],
    ids=lambda hook: hook.__name__,  # not repr: an address differs between xdist's workers
)
def test_hooks_ddp_refuses_are_refused_with_its_error(hook: object) -> None:
    """bf16 without NCCL (a TypeError; a build with NCCL takes it) and wrong annotations
    (ValueError), as DDP says them."""
    ours = _errors_of(ddp(replicate(Net())).register_comm_hook, hook)
    theirs = _errors_of(DistributedDataParallel(Net()).register_comm_hook, hook)
    assert ours == theirs
    assert theirs is not None or hook is default_hooks.bf16_compress_hook


def _resolved_with(value: object) -> Callable[[object, GradBucket], torch.futures.Future[Any]]:
    """A hook whose future gives ``value`` instead of the reduced bucket."""

    def hook(state: object, bucket: GradBucket) -> torch.futures.Future[Any]:
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result(value)
        return future

    hook.__annotations__ = {}  # DDP's check reads annotations as objects: give it none
    return hook


@pytest.mark.parametrize(
    ("value", "given"),
    [(torch.zeros(2), "a tensor of 2 elements"), ([torch.zeros(16)], "list")],
    ids=["wrong size", "not a tensor"],
)
def test_a_hook_whose_future_is_not_the_bucket_raises_naming_the_module(
    value: object, given: str
) -> None:
    net = Net()
    ddp(replicate(net)).register_comm_hook(None, _resolved_with(value))
    with pytest.raises(ContractError) as caught:
        torch.autograd.backward(net(torch.ones(2, 3)).sum())
    assert str(caught.value) == (
        f"replicate on Net: the communication hook's future for bucket 0 gave {given}, not a "
        "tensor of the bucket buffer's 16 elements; return a future of the reduced "
        "bucket.buffer()"
    )


def test_a_hook_registered_during_a_backward_is_refused() -> None:
    net = Net()
    model = ddp(replicate(net))

    def register(module: nn.Module, grad_input: object, grad_output: object) -> None:
        model.register_comm_hook(None, _hook)  # in the synchronizing backward

    net.second.register_full_backward_hook(register)
    with pytest.raises(ContractError) as caught:
        torch.autograd.backward(net(torch.ones(2, 3)).sum())
    assert str(caught.value) == (
        "replicate on Net: register_comm_hook during a backward; register it between "
        "backwards (before training, or after a step)"
    )
