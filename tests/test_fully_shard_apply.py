"""fully_shard's apply at scale, on a fake process group of 64 ranks (nothing is communicated).

Models are Llama-7B-shaped stacks built on the meta device, as large models are.
Covered: every argument checked before anything changes, the default mesh, and an
apply whose cost does not grow with what is sharded already. Cost is measured in
Python lines executed (``sys.settrace``), which is deterministic: no timing.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any, Final, cast

import attrs
import pytest
import torch
import torch.distributed as dist
from fake_world import fake_mesh
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import torchcontract
from torchcontract import AlreadyManagedError, InvalidMeshError, contract, module_label
from torchcontract.apis import _torch, fully_shard
from torchcontract.apis.fully_shard._managed import MANAGED

WORLD = 64


class Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)


class Layer(nn.Module):
    """A Llama decoder layer's parameters: 9 of them, 202 million elements at 7B's sizes."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)


class Llama(nn.Module):
    def __init__(self, layers: int, dim: int = 4096, hidden: int = 11008) -> None:
        super().__init__()
        self.embed = nn.Embedding(32000, dim)
        self.layers = nn.ModuleList(Layer(dim, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, 32000, bias=False)


PARAMETERS_PER_LAYER = 9
ROOT_PARAMETERS = 3  # embed, norm, head


def on_meta(layers: int) -> Llama:
    with torch.device("meta"):
        return Llama(layers)


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    """A 1-D mesh of 64 ranks over the fake backend, this process being rank 0."""
    with fake_mesh((WORLD,)) as mesh:
        yield mesh


def shard_each(model: Llama, mesh: DeviceMesh | None) -> None:
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


@attrs.frozen
class Cost:
    """What one call ran, counted with ``sys.settrace``: deterministic, unlike a timing.

    ``lines``: Python lines executed in every function. ``own_lines``: those in the
    files of ``own`` (torchcontract's, by default). ``calls_out``: calls made from those
    files into any other code, torch's included. torch's own lines vary from run to run
    (its DTensor spec comparisons take a shortcut only when the mesh object is the one
    cached by an earlier test), so a claim about our code counts ``own_lines`` and
    ``calls_out``, which no cache outside it can change.
    """

    lines: int
    own_lines: int
    calls_out: int


PACKAGE: Final = str(Path(torchcontract.__file__).parent)


def cost_of(call: Callable[[], object], own: tuple[str, ...] = (PACKAGE,)) -> Cost:
    """The ``Cost`` of ``call()``, with collections off so no finalizer runs in the middle."""
    lines = own_lines = calls_out = 0

    def is_own(frame: FrameType | None) -> bool:
        return frame is not None and frame.f_code.co_filename.startswith(own)

    def local(frame: FrameType, event: str, argument: object) -> Any:
        nonlocal lines, own_lines
        if event == "line":
            lines += 1
            own_lines += is_own(frame)
        return local

    def start(frame: FrameType, event: str, argument: object) -> Any:
        nonlocal calls_out
        calls_out += is_own(frame.f_back) and not is_own(frame)
        return local

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    sys.settrace(start)
    try:
        call()
    finally:
        sys.settrace(None)
        if enabled:
            gc.enable()
    return Cost(lines, own_lines, calls_out)


def lines_run(call: Callable[[], object]) -> int:
    """How many Python lines ``call()`` executes, in every function it calls."""
    return cost_of(call).lines


def applying(module: nn.Module, mesh: DeviceMesh) -> Callable[[], object]:
    """``fully_shard(module, mesh=mesh)``, to call later."""
    return lambda: fully_shard(module, mesh=mesh)


def unchanged(model: nn.Module, before: list[nn.Parameter]) -> bool:
    """Whether ``model`` holds exactly the parameters of ``before`` and no fully_shard."""
    return not fully_shard.is_applied(model) and all(
        a is b for a, b in zip(model.parameters(), before, strict=True)
    )


# ----------------------------------------------------------------- arguments


def _refused(model: nn.Module, error: type[Exception], match: str, **options: Any) -> bool:
    before = list(model.parameters())
    with pytest.raises(error, match=match):
        fully_shard(model, **options)
    return unchanged(model, before)


@pytest.mark.parametrize("name", ["group", "string", "int"])
def test_a_mesh_that_is_not_a_device_mesh_is_a_type_error_naming_mesh(
    mesh: DeviceMesh, name: str
) -> None:
    """FSDP2 fails later with ``AttributeError: ... has no attribute 'ndim'``."""
    value = {"group": mesh.get_group(), "string": "cpu", "int": 64}[name]
    kind = {"group": "a ProcessGroup", "string": "'cpu'", "int": "64"}[name]
    assert _refused(
        nn.Linear(4, 4),
        TypeError,
        rf"fully_shard on Linear: mesh must be a DeviceMesh or None, got {kind}; pass "
        r"mesh=init_device_mesh",
        mesh=value,
    )


def test_a_3d_mesh_is_an_invalid_mesh_error_and_a_value_error(mesh: DeviceMesh) -> None:
    cube = init_device_mesh("cpu", (2, 4, 8))
    assert _refused(
        nn.Linear(4, 4),
        InvalidMeshError,
        r"expected a 1-D mesh \(sharding\) or a 2-D mesh \(replicate, shard\) for HSDP, got one "
        r"of shape \(2, 4, 8\)",
        mesh=cube,
    )
    assert issubclass(InvalidMeshError, ValueError)


@pytest.mark.parametrize(("value", "shown"), [("yes", "'yes'"), (1.0, "1.0"), ([True], "a list")])
def test_reshard_after_forward_of_another_type_is_a_type_error_naming_it(
    mesh: DeviceMesh, value: object, shown: str
) -> None:
    assert _refused(
        nn.Linear(4, 4),
        TypeError,
        rf"fully_shard on Linear: reshard_after_forward must be a bool, an int or None, "
        rf"got {shown}",
        mesh=mesh,
        reshard_after_forward=value,
    )


@pytest.mark.parametrize("value", [0, -1, 3, 48, 65, 128])
def test_reshard_after_forward_int_that_does_not_divide_the_mesh_is_a_value_error(
    mesh: DeviceMesh, value: int
) -> None:
    """As FSDP2, which refuses each of them with a ValueError too."""
    assert _refused(
        nn.Linear(4, 4),
        ValueError,
        rf"reshard_after_forward as an int .* must divide the mesh's size 64, got {value}",
        mesh=mesh,
        reshard_after_forward=value,
    )
    with pytest.raises(ValueError, match="factor of 64"):
        torch_fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=value)


@pytest.mark.parametrize("value", [2, 8, 32])
def test_reshard_after_forward_to_a_smaller_world_gets_a_post_forward_group_of_that_size(
    mesh: DeviceMesh, value: int
) -> None:
    """As FSDP2's post-forward mesh: rows of ``value`` ranks (its behaviour: 4 gloo ranks)."""
    model = fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=value)
    group = MANAGED.group_of(model)
    assert group is not None
    assert group.post_forward_group is not None
    assert group.post_forward_group.size() == value
    assert fully_shard.state(model).reshard_after_forward is True
    torch_fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=value)


@pytest.mark.parametrize(
    ("value", "recorded"), [(None, None), (True, True), (False, False), (64, True)]
)
def test_reshard_after_forward_is_recorded_as_fsdp2_reads_it(
    mesh: DeviceMesh, value: bool | int | None, recorded: bool | None
) -> None:
    model = fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=value)
    assert fully_shard.state(model).reshard_after_forward is recorded


def test_reshard_after_forward_one_means_false_and_warns_at_the_caller(mesh: DeviceMesh) -> None:
    with pytest.warns(
        UserWarning, match=r"fully_shard on Linear: reshard_after_forward=1 \(int\)"
    ) as caught:
        model = fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=1)
    assert fully_shard.state(model).reshard_after_forward is False
    assert [warning.filename for warning in caught] == [__file__]


@pytest.mark.parametrize("name", ["param_dtype", "reduce_dtype", "output_dtype"])
@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ("bfloat16", TypeError, r"must be a torch.dtype or None, got 'bfloat16'"),
        (32, TypeError, r"must be a torch.dtype or None, got 32"),
        (torch.int32, ValueError, r"must be a floating-point dtype, got torch.int32"),
    ],
)
def test_a_dtype_argument_is_checked_naming_it(
    mesh: DeviceMesh, name: str, value: object, error: type[Exception], message: str
) -> None:
    assert _refused(
        nn.Linear(4, 4),
        error,
        rf"fully_shard on Linear: mp_policy.{name} {message}",
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(**cast(dict[str, Any], {name: value})),
    )


def test_arguments_are_checked_before_the_default_mesh_is_made(mesh: DeviceMesh) -> None:
    """A bad option fails as itself, not as whatever building a mesh would say."""
    assert _refused(nn.Linear(4, 4), TypeError, r"reshard_after_forward", reshard_after_forward="x")


# ----------------------------------------------------------------- default mesh


def test_the_default_mesh_of_a_meta_model_is_on_the_accelerator_else_cpu(
    mesh: DeviceMesh,
) -> None:
    """Never on ``meta``, the parameters' device; on the device FSDP2 picks."""
    ours, theirs = on_meta(1), on_meta(1)
    shard_each(ours, None)
    for layer in theirs.layers:
        torch_fully_shard(layer)
    torch_fully_shard(theirs)
    record_mesh = fully_shard.state(ours).mesh
    assert record_mesh is not None
    assert record_mesh.device_type == _torch.accelerator_type() == "cpu"
    assert record_mesh.size() == WORLD

    def mesh_devices(model: nn.Module) -> set[str]:
        return {p.device_mesh.device_type for p in model.parameters() if isinstance(p, DTensor)}

    assert mesh_devices(ours) == mesh_devices(theirs) == {"cpu"}


# ----------------------------------------------------------------- scale


def test_apply_builds_no_error_text_when_nothing_is_wrong(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Labels walk every applied tree; one per parameter made applies quadratic."""
    labels: list[str] = []

    def counted(module: nn.Module) -> str:
        labels.append(type(module).__qualname__)
        return module_label(module)

    # The package's name is the API (apis re-exports it), so import the modules by their paths.
    for name in ("_api", "_arguments", "_parameters"):
        module = importlib.import_module(f"torchcontract.apis.fully_shard.{name}")
        monkeypatch.setattr(module, "module_label", counted)
    model = on_meta(16)
    shard_each(model, mesh)
    assert labels == []
    with pytest.raises(
        AlreadyManagedError, match=r"already managed by fully_shard on Layer 'layers.0' of Llama"
    ):
        fully_shard(model.layers[0].get_submodule("attention"), mesh=mesh)
    assert labels  # the same function names modules in errors: the spy is in place


def test_applying_to_a_layer_costs_the_same_however_many_are_sharded(mesh: DeviceMesh) -> None:
    """The 48th layer's apply runs as many lines as the 2nd's, not 47 groups' worth more."""
    model = on_meta(48)
    cost = [lines_run(applying(layer, mesh)) for layer in model.layers]
    assert cost[-1] == cost[1]
    assert max(cost[1:]) == min(cost[1:])


def _layer_cost_on_2_and_64_ranks(
    mesh: DeviceMesh, own: tuple[str, ...] = (PACKAGE,)
) -> list[Cost]:
    """The cost of applying to a second layer on a 2-rank mesh, then on the 64-rank one."""
    costs: list[Cost] = []
    for each_mesh in (DeviceMesh("cpu", [0, 1]), mesh):
        model = on_meta(2)
        fully_shard(model.layers[0], mesh=each_mesh)  # the first apply on a mesh warms caches
        costs.append(cost_of(applying(model.layers[1], each_mesh), own))
    return costs


def test_applying_to_a_layer_costs_no_more_on_64_ranks_than_on_2(mesh: DeviceMesh) -> None:
    """Nothing of ours loops over ranks: the same lines of ours, the same calls out of them."""
    on_2, on_64 = _layer_cost_on_2_and_64_ranks(mesh)
    assert on_64.own_lines == on_2.own_lines > 0
    assert on_64.calls_out == on_2.calls_out > 0


def test_the_rank_cost_test_sees_a_loop_over_ranks(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test above would fail if the apply visited every rank once."""
    api = importlib.import_module("torchcontract.apis.fully_shard._api")
    check_mesh = api.check_mesh

    def visiting_every_rank(target: nn.Module, each_mesh: DeviceMesh) -> None:
        for rank in range(each_mesh.size()):
            dist.get_global_rank(each_mesh.get_group(), rank)
        check_mesh(target, each_mesh)

    monkeypatch.setattr(api, "check_mesh", visiting_every_rank)
    on_2, on_64 = _layer_cost_on_2_and_64_ranks(mesh, own=(PACKAGE, __file__))
    assert on_64.own_lines >= on_2.own_lines + (WORLD - 2)  # a line per rank at least
    assert on_64.calls_out >= on_2.calls_out + (WORLD - 2)  # a call into torch per rank


def test_root_apply_costs_linear_in_the_layers(mesh: DeviceMesh) -> None:
    """Twice the layers, at most twice the lines (a fixed part makes it less)."""
    fully_shard(on_meta(2), mesh=mesh)  # once-per-process work (caches) left out of the count
    costs: list[int] = []
    for layers in (16, 32):
        model = on_meta(layers)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        gc.collect()  # freed models' index entries go now, not inside the count
        costs.append(lines_run(applying(model, mesh)))
    assert costs[1] <= 2 * costs[0]
    assert costs[1] >= 1.5 * costs[0]  # the walk does cover the whole model


def test_the_index_grows_by_each_apply_and_forgets_a_dropped_model(mesh: DeviceMesh) -> None:
    """One entry per place a managed parameter is registered; freed with the model, no gc."""
    gc.collect()
    baseline = len(MANAGED)
    model = on_meta(4)
    sizes: list[int] = []
    for index in range(4):
        fully_shard(model.layers[index], mesh=mesh)
        sizes.append(len(MANAGED) - baseline)
    fully_shard(model, mesh=mesh)
    assert sizes == [PARAMETERS_PER_LAYER * n for n in range(1, 5)]
    assert len(MANAGED) - baseline == 4 * PARAMETERS_PER_LAYER + ROOT_PARAMETERS
    gc.disable()
    try:
        del model
        assert len(MANAGED) == baseline
    finally:
        gc.enable()


@contract()
def _shard_then_fail(module: nn.Module, mesh: DeviceMesh) -> None:
    fully_shard(module, mesh=mesh)
    raise ValueError("planned failure after fully_shard sharded the module")


def test_a_rolled_back_apply_leaves_nothing_in_the_index(mesh: DeviceMesh) -> None:
    model = on_meta(1)
    before = len(MANAGED)
    with contextlib.suppress(ValueError):
        _shard_then_fail(model.layers[0], mesh)
    assert len(MANAGED) == before
    fully_shard(model.layers[0], mesh=mesh)  # the parameters are its own again: it shards them
    assert len(MANAGED) == before + PARAMETERS_PER_LAYER


def test_a_parameter_shared_outside_the_group_is_sharded_again_and_forgotten_when_freed(
    mesh: DeviceMesh,
) -> None:
    """The head shares the embedding's weight: sharding the head leaves the original at the
    embedding, which the root's apply shards again, as FSDP2's; the first forward refuses the
    two groups; dropping the model forgets both."""
    gc.collect()
    baseline = len(MANAGED)
    model = on_meta(1)
    model.head.weight = model.embed.weight
    fully_shard(model.head, mesh=mesh)
    assert len(MANAGED) == baseline + 2  # the head's location, and the original
    fully_shard(model, mesh=mesh)
    with pytest.raises(
        AlreadyManagedError, match=r"Parameter 'head.weight' is shared with a parameter already"
    ):
        model(torch.zeros(1, dtype=torch.long))
    del model
    gc.collect()
    assert len(MANAGED) == baseline
