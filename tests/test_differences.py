"""Each row of ``tests/differences.py``, the pages' one source of differences, holds in the code.

A difference whose check is a probe is run here, on one gloo rank (or PyTorch's fake
process group where it needs more ranks): ours refuses the call with the exception the
row names, or takes it. Any other check names a test that must exist. The keyword
tables list every keyword of ours and of PyTorch's, and each feature's minimum torch is
the version gate of ``apis._compat``, on the running torch.
"""

from __future__ import annotations

import builtins
import copy
import inspect
import re
import tomllib
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from differences import (
    DIFFERENCES,
    KEYWORDS,
    MINIMUM_TORCH,
    OLDEST_TORCH,
    TESTED_RELEASES,
    Difference,
    Keyword,
    MinimumTorch,
    render,
)
from pages import DOCS, ROOT, pages
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, parallelize_module
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _MixedPrecision
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchcontract import InvalidTargetError
from torchcontract.apis import _compat, fully_shard, rank_local, replicate
from torchcontract.testing import free_port

Call = Callable[[], object]
Probe = Callable[[], Call | None]


@pytest.fixture
def one_rank() -> Iterator[DeviceMesh]:
    """A one-rank gloo group and its 1-D mesh, taken down after the test."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _fake_ranks(world: int) -> None:
    """PyTorch's fake process group: rank 0 of ``world``; collectives move nothing."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


# --------------------------------------------------------------------------- probes


def _no_process_group() -> Call:
    assert not dist.is_initialized()
    return lambda: fully_shard(nn.Linear(2, 2))


#: The arguments each accelerator-only method takes.
_ACCELERATOR_ARGUMENTS: dict[str, tuple[object, ...]] = {
    "set_post_optim_event": (None,),
    "set_allocate_memory_from_process_group_for_comm": (True,),
    "set_symm_mem_for_comm": (),
    "set_separate_reduce_scatter_group": (),
}


def _accelerator_methods() -> Call:
    model = fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1,)))
    row = next(row for row in DIFFERENCES if row.check == "probe:accelerator_methods")
    calls = [
        (getattr(model, name), arguments) for name, arguments in _ACCELERATOR_ARGUMENTS.items()
    ]
    assert all(f"`{name}`" in row.what for name in _ACCELERATOR_ARGUMENTS)
    assert row.what.count("`set_") == len(_ACCELERATOR_ARGUMENTS)
    if _compat.REFERENCE_FULLY_SHARD_ON_CPU:  # they are FSDP2's methods
        assert all(hasattr(FSDPModule, name) for name in _ACCELERATOR_ARGUMENTS)
    for method, arguments in calls[:-1]:
        with pytest.raises(NotImplementedError, match="not supported"):
            method(*arguments)
    method, arguments = calls[-1]
    return lambda: method(*arguments)


def _int_reshard_with_shard_1() -> Call:
    dist.destroy_process_group()
    _fake_ranks(4)
    mesh = init_device_mesh("cpu", (4,))

    def on_dim_1(parameter: nn.Parameter) -> Shard | None:
        return Shard(1) if parameter.dim() == 2 else None

    if _compat.REFERENCE_FULLY_SHARD_ON_CPU:  # FSDP2 takes it
        torch_fully_shard(
            nn.Linear(4, 4), mesh=mesh, reshard_after_forward=2, shard_placement_fn=on_dim_1
        )
    return lambda: fully_shard(
        nn.Linear(4, 4), mesh=mesh, reshard_after_forward=2, shard_placement_fn=on_dim_1
    )


def _int_reshard_with_tensor_parallel() -> Call:
    dist.destroy_process_group()
    _fake_ranks(8)
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    if _compat.REFERENCE_FULLY_SHARD_ON_CPU:  # FSDP2's apply takes it (its forward refuses)
        theirs = parallelize_module(nn.Linear(4, 4), mesh["tp"], ColwiseParallel())
        torch_fully_shard(theirs, mesh=mesh["dp"], reshard_after_forward=2)
    linear = parallelize_module(nn.Linear(4, 4), mesh["tp"], ColwiseParallel())
    return lambda: fully_shard(linear, mesh=mesh["dp"], reshard_after_forward=2)


def _shard_placement_result() -> Call:
    common = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_common")
    kind: Any = getattr(common, "ShardPlacementResult", None)
    if kind is None:
        pytest.skip("this torch's FSDP2 has no ShardPlacementResult")
    result = kind(placement=Shard(0), mesh_info=None)
    mesh = init_device_mesh("cpu", (1,))
    return lambda: fully_shard(nn.Linear(2, 2), mesh=mesh, shard_placement_fn=lambda _: result)


def _data_parallel_mesh_dims() -> Any:
    kind = _compat.DATA_PARALLEL_MESH_DIMS
    if kind is None:
        pytest.skip("this torch has no DataParallelMeshDims (MINIMUM_TORCH covers it)")
    return kind


def _dp_mesh_dims_replicate_only() -> Call:
    dims = _data_parallel_mesh_dims()(replicate="dp")
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    if _compat.REFERENCE_FULLY_SHARD_ON_CPU:  # FSDP2 takes it
        torch_fully_shard(distribute_module(nn.Linear(2, 2), mesh), mesh=mesh, dp_mesh_dims=dims)
    model = distribute_module(nn.Linear(2, 2), mesh)
    return lambda: fully_shard(model, mesh=mesh, dp_mesh_dims=dims)


def _torch_state_internals() -> Call:
    model = fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1,)))
    lookup: Any = torch_fully_shard
    group: Any = lookup.state(model)._fsdp_param_group
    return lambda: group.fsdp_params


def _no_wrapper() -> None:
    model = replicate(nn.Linear(2, 2))
    assert set(model.state_dict()) == {"weight", "bias"}
    assert not hasattr(model, "module")
    wrapped = DistributedDataParallel(nn.Linear(2, 2))  # DDP's keys gain the prefix
    assert set(wrapped.state_dict()) == {"module.weight", "module.bias"}


def _deepcopy_of_a_replicated_module() -> None:
    model = replicate(nn.Linear(2, 2))
    copied = copy.deepcopy(model)
    assert type(copied) is nn.Linear
    assert not replicate.is_applied(copied)
    copied(torch.randn(1, 2)).sum().backward()  # nothing averaged, nothing counted
    assert replicate.state(model).step == 0
    wrapped = copy.deepcopy(DistributedDataParallel(nn.Linear(2, 2)))
    assert isinstance(wrapped, DistributedDataParallel)  # DDP's copy is a DDP


def _tensor_parallel_parameters() -> Call:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    plan: dict[str, ParallelStyle] = {"0": ColwiseParallel()}
    theirs = parallelize_module(nn.Sequential(nn.Linear(2, 2)), mesh["tp"], plan)
    DistributedDataParallel(theirs, device_mesh=mesh["dp"])  # DDP takes it
    frozen = parallelize_module(nn.Linear(2, 2), mesh["tp"], ColwiseParallel())
    frozen.requires_grad_(False)
    trains = nn.Sequential(frozen, nn.Linear(2, 2))  # the tensor-parallel layer does not
    with pytest.raises(InvalidTargetError, match=r"parameter '0.weight' is a DTensor"):
        replicate(trains, device_mesh=mesh["dp"])
    ours = parallelize_module(nn.Sequential(nn.Linear(2, 2)), mesh["tp"], plan)
    return lambda: replicate(ours, device_mesh=mesh["dp"])


def _rank_local() -> None:
    model = replicate(nn.Linear(2, 2))
    with rank_local(model):
        model(torch.randn(1, 2)).sum().backward()
    assert replicate.state(model).step == 0  # nothing was averaged
    assert not hasattr(model, "module")


def _theirs_raise(row_check: str, call: Call) -> None:
    """PyTorch's ``call`` raises the exception the row's ``theirs`` names."""
    row = next(row for row in DIFFERENCES if row.check == row_check)
    named = re.search(r"`(\w+Error)`", row.theirs)
    assert named is not None, f"{row.what}: name PyTorch's exception in `theirs`"
    expected: type[BaseException] = getattr(builtins, named[1])
    with pytest.raises(expected) as raised:
        call()
    assert type(raised.value) is expected


def _deepcopy_of_a_sharded_module() -> Call:
    mesh = init_device_mesh("cpu", (1,))
    if _compat.REFERENCE_FULLY_SHARD_ON_CPU:
        theirs = torch_fully_shard(nn.Linear(2, 2), mesh=mesh)
        _theirs_raise("probe:deepcopy_of_a_sharded_module", lambda: copy.deepcopy(theirs))
    ours = fully_shard(nn.Linear(2, 2), mesh=mesh)
    return lambda: copy.deepcopy(ours)


def _module_sharded_after_its_parent() -> Call:
    mesh = init_device_mesh("cpu", (1,))
    if _compat.REFERENCE_FULLY_SHARD_ON_CPU:
        theirs = nn.Sequential(nn.Linear(2, 2))
        torch_fully_shard(theirs, mesh=mesh)
        _theirs_raise(
            "probe:module_sharded_after_its_parent",
            lambda: torch_fully_shard(theirs[0], mesh=mesh),
        )
    ours = fully_shard(nn.Sequential(nn.Linear(2, 2)), mesh=mesh)
    return lambda: fully_shard(ours[0], mesh=mesh)


class _MixedDtypes(nn.Module):
    """A float32 and a float64 layer in one module: one group of two dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.single = nn.Linear(2, 2)
        self.wide = nn.Linear(2, 2).double()

    def forward(self, x: Tensor) -> Tensor:
        return cast(Tensor, self.single(x)) + cast(Tensor, self.wide(x.double())).float()


def _step(model: nn.Module) -> None:
    torch.autograd.backward(cast(Tensor, model(torch.ones(1, 2))).sum())


def _trainable_parameters_of_two_dtypes() -> None:
    mesh = init_device_mesh("cpu", (1,))
    if _compat.REFERENCE_FULLY_SHARD_ON_CPU:
        theirs = cast(nn.Module, torch_fully_shard(_MixedDtypes(), mesh=mesh))
        _theirs_raise("probe:trainable_parameters_of_two_dtypes", lambda: _step(theirs))
    ours = fully_shard(_MixedDtypes(), mesh=mesh)
    _step(ours)
    assert all(parameter.grad is not None for parameter in ours.parameters())


def _frozen() -> nn.Module:
    return nn.Linear(2, 2).requires_grad_(False)


def _no_trainable_parameter() -> Call:
    _theirs_raise("probe:no_trainable_parameter", lambda: DistributedDataParallel(_frozen()))
    return lambda: replicate(_frozen())


def _default(function: Callable[..., object], keyword: str) -> object:
    return inspect.signature(function).parameters[keyword].default


def _broadcast_buffers_default() -> None:
    assert _default(replicate, "broadcast_buffers") is None
    sync = inspect.signature(DistributedDataParallel).parameters.get("forward_sync_buffers")
    assert _default(DistributedDataParallel, "broadcast_buffers") is (None if sync else True)


PROBES: dict[str, Probe] = {
    "broadcast_buffers_default": _broadcast_buffers_default,
    "accelerator_methods": _accelerator_methods,
    "deepcopy_of_a_sharded_module": _deepcopy_of_a_sharded_module,
    "deepcopy_of_a_replicated_module": _deepcopy_of_a_replicated_module,
    "tensor_parallel_parameters": _tensor_parallel_parameters,
    "module_sharded_after_its_parent": _module_sharded_after_its_parent,
    "no_trainable_parameter": _no_trainable_parameter,
    "dp_mesh_dims_replicate_only": _dp_mesh_dims_replicate_only,
    "int_reshard_with_shard_1": _int_reshard_with_shard_1,
    "int_reshard_with_tensor_parallel": _int_reshard_with_tensor_parallel,
    "no_process_group": _no_process_group,
    "no_wrapper": _no_wrapper,
    "rank_local": _rank_local,
    "shard_placement_result": _shard_placement_result,
    "torch_state_internals": _torch_state_internals,
    "trainable_parameters_of_two_dtypes": _trainable_parameters_of_two_dtypes,
}

PROBED = [row for row in DIFFERENCES if row.check.startswith("probe:")]
NAMED = [row for row in DIFFERENCES if not row.check.startswith("probe:")]


def _ours(error_class: type[BaseException]) -> bool:
    return error_class.__module__.startswith("torchcontract")


@pytest.mark.parametrize("row", PROBED, ids=lambda row: row.check)
def test_a_probed_difference_holds(row: Difference) -> None:
    probe = PROBES[row.check.removeprefix("probe:")]
    if row.check == "probe:no_process_group":
        if dist.is_initialized():
            pytest.skip("a process group is up")
        call = probe()
    else:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
        try:
            call = probe()
            if row.raises is None:
                assert call is None
                return
            assert call is not None
            with pytest.raises(row.raises) as raised:
                call()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        # Ours exactly; PyTorch's or Python's type where ours is a private subclass.
        assert type(raised.value) is row.raises or not _ours(row.raises)
        return
    assert call is not None
    assert row.raises is not None
    with pytest.raises(row.raises) as raised:
        call()
    assert type(raised.value) is row.raises


def test_every_probe_is_named_by_a_row() -> None:
    assert sorted(row.check.removeprefix("probe:") for row in PROBED) == sorted(PROBES)


@pytest.mark.parametrize("row", NAMED, ids=lambda row: row.check)
def test_a_difference_names_a_test_that_exists(row: Difference) -> None:
    path, _, name = row.check.partition("::")
    source = (ROOT / path).read_text()
    assert not name or f"def {name}(" in source


# --------------------------------------------------------------------------- keywords


def _signature_keywords(function: Callable[..., object]) -> set[str]:
    return {
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind
        in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    } - {"module"}


def _ours_keywords(api: str) -> set[str]:
    return _signature_keywords(fully_shard if api == "fully_shard" else replicate)


def _theirs_keywords(api: str) -> set[str]:
    if api == "replicate":
        return set(_compat.DDP_KEYWORDS) - {"self", "module"}
    return _signature_keywords(torch_fully_shard)


@pytest.mark.parametrize("api", ["fully_shard", "replicate"])
def test_the_keyword_table_lists_every_keyword_ours_takes(api: str) -> None:
    taken = {row.name for row in KEYWORDS if row.api == api and row.taken}
    assert taken == _ours_keywords(api)


@pytest.mark.parametrize("api", ["fully_shard", "replicate"])
def test_the_keyword_table_lists_every_keyword_of_this_torchs_reference(api: str) -> None:
    listed = {row.name for row in KEYWORDS if row.api == api}
    assert _theirs_keywords(api) <= listed


@pytest.mark.parametrize("api", ["fully_shard", "replicate"])
def test_a_keyword_this_torchs_reference_lacks_is_gated_or_taken_here(
    api: str, one_rank: DeviceMesh
) -> None:
    # Gated: refused on this torch (its row says from which release). Otherwise ours takes
    # it on this torch too, as a newer release of PyTorch's API does (ignored_params on 2.6).
    closed = {row.keyword for row in MINIMUM_TORCH if row.api == api and not _gate_open(row)}
    function = fully_shard if api == "fully_shard" else replicate
    defaults = inspect.signature(function).parameters
    for keyword in sorted(_ours_keywords(api) - _theirs_keywords(api) - closed):
        keywords: dict[str, Any] = {keyword: defaults[keyword].default}
        if api == "fully_shard":
            fully_shard(nn.Linear(2, 2), mesh=one_rank, **keywords)
        else:
            replicate(nn.Linear(2, 2), **keywords)


def _not_default(name: str, model: nn.Module) -> dict[str, Any]:
    """A value of DDP's keyword ``name`` other than its default (with its pair's)."""
    first = next(model.parameters())
    paired = {
        "delay_all_reduce_named_params": list(model.named_parameters())[:1],
        "param_to_hook_all_reduce": first,
    }
    if name in paired:
        return paired
    if name == "mixed_precision":
        return {name: _MixedPrecision(param_dtype=torch.float16)}
    return {name: True}


@pytest.mark.parametrize(
    "row", [row for row in KEYWORDS if row.refused is not None], ids=lambda row: row.name
)
def test_a_keyword_taken_at_its_default_only_refuses_another_value(row: Keyword) -> None:
    assert row.api == "replicate"
    assert row.refused is not None
    model = nn.Linear(2, 2)
    keywords = _not_default(row.name, model)
    if not set(keywords) <= _compat.DDP_KEYWORDS:
        pytest.skip(f"torch {torch.__version__}'s DDP lacks {sorted(keywords)}")
    with pytest.raises(row.refused, match=f"{row.name}= (is not implemented|neither)"):
        replicate(model, **keywords)
    assert not replicate.is_applied(model)


# --------------------------------------------------------------------------- torch versions


def _gate_open(row: MinimumTorch) -> bool:
    name, _, keyword = row.gate.partition(":")
    value: object = getattr(_compat, name)
    if keyword:
        assert isinstance(value, frozenset)
        return keyword in value
    return value is not None


@pytest.mark.parametrize("row", MINIMUM_TORCH, ids=lambda row: row.keyword)
def test_the_minimum_torch_is_the_version_gate(row: MinimumTorch) -> None:
    assert row.torch > OLDEST_TORCH
    if row.torch <= _compat.TORCH_VERSION:
        assert _gate_open(row)
    elif _compat.TORCH_VERSION in TESTED_RELEASES:
        assert not _gate_open(row)


def _gated_call(row: MinimumTorch, mesh: DeviceMesh) -> object:
    if row.keyword == "dp_mesh_dims":
        named = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        model = distribute_module(nn.Linear(2, 2), named)
        dims: Any = None
        if _compat.DATA_PARALLEL_MESH_DIMS is not None:
            dims = _compat.DATA_PARALLEL_MESH_DIMS(shard="dp")
        else:  # what a user of a newer torch's class would pass
            dims = type("DataParallelMeshDims", (), {"shard": "dp", "replicate": None})()
        return fully_shard(model, mesh=named, dp_mesh_dims=dims)
    values: dict[str, Any] = {
        "bucket_cap_mb_list": [1.0, 2.0],
        "init_sync": False,
        "forward_sync_buffers": False,
        "batched_grad_copy": True,
    }
    keywords: dict[str, Any] = {row.keyword: values[row.keyword]}
    return replicate(nn.Linear(2, 2), **keywords)


@pytest.mark.parametrize("row", MINIMUM_TORCH, ids=lambda row: row.keyword)
def test_a_gated_feature_works_where_the_gate_is_open_and_is_a_type_error_elsewhere(
    row: MinimumTorch, one_rank: DeviceMesh
) -> None:
    if _gate_open(row):
        assert isinstance(_gated_call(row, one_rank), nn.Module)
    else:
        with pytest.raises(TypeError, match=row.keyword):
            _gated_call(row, one_rank)


def test_a_docstring_naming_a_keywords_torch_release_names_the_minimum_torch() -> None:
    # The API reference renders the docstrings: "bucket_cap_mb_list: As DDP's (torch 2.13 on".
    minimum = {row.keyword: row.torch for row in MINIMUM_TORCH}
    found = {
        match[1]: (int(match[2]), int(match[3]))
        for api in (fully_shard, replicate)
        for match in re.finditer(
            r"^ +(\w+): [^\n]*\(torch (\d+)\.(\d+) on", inspect.getdoc(api) or "", re.M
        )
    }
    assert found
    assert {keyword: minimum.get(keyword) for keyword in found} == found


def test_the_oldest_torch_is_the_one_compat_and_the_package_name() -> None:
    assert OLDEST_TORCH == _compat.OLDEST_TESTED == TESTED_RELEASES[0]
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch>={OLDEST_TORCH[0]}.{OLDEST_TORCH[1]}" in requires


# --------------------------------------------------------------------------- pages

MARKER = re.compile(r"^<!-- ((?:differences|keywords): \w+|minimum torch) -->$", re.M)


def test_every_marker_of_every_page_renders() -> None:
    found = {marker for page in pages() for marker in MARKER.findall(page.read_text())}
    assert found == {
        "differences: fully_shard",
        "differences: replicate",
        "keywords: fully_shard",
        "keywords: replicate",
        "minimum torch",
    }
    for marker in found:
        assert render(marker).startswith("| ")


def test_the_pages_render_the_tables_instead_of_writing_them() -> None:
    expected = {
        "coming-from-fsdp2.md": {"differences: fully_shard", "keywords: fully_shard"},
        "coming-from-ddp.md": {"differences: replicate", "keywords: replicate"},
        "fully-shard.md": {"differences: fully_shard"},
        "replicate.md": {"differences: replicate"},
        "supported-versions.md": {"minimum torch"},
    }
    for name, markers in expected.items():
        assert markers <= set(MARKER.findall((DOCS / name).read_text())), name
    # A table of differences written by hand would say what one rendered says.
    for page in pages():
        text = page.read_text()
        assert not re.search(r"^\| what \| (FSDP2|DDP) \| torchcontract", text, re.M), page


def test_a_rendered_table_names_the_exception_each_refusal_raises() -> None:
    table = render("differences: fully_shard") + render("differences: replicate")
    for row in DIFFERENCES:
        if row.raises is not None:
            assert f"`{row.raises.__name__}`" in table


def test_a_keyword_shared_with_ddp_has_ddps_default_unless_a_row_says_otherwise() -> None:
    """What "DDP's defaults" means on the pages: every keyword both take, but the rows'."""
    ours = inspect.signature(replicate).parameters
    theirs = inspect.signature(DistributedDataParallel).parameters
    shared = sorted(set(ours) & set(theirs) - {"module"})
    differing = [name for name in shared if ours[name].default != theirs[name].default]
    told = [
        name
        for name in differing
        if any(row.api == "replicate" and f"`{name}`'s default" in row.what for row in DIFFERENCES)
    ]
    assert differing == told
