"""FSDP2's extension points on gloo ranks, beside FSDP2: all-gather hooks, custom collectives.

PyTorch's own ``test_fully_shard_extensions.py`` behaviours with their GPU guards
lifted (monkey-patched hooks after ``to_empty``, an HSDP mesh, mixed precision,
hooks that pad), plus a scaled-int8 weight of our own (``extension_tensors``)
trained with both APIs; each checks the hooks ran. One job runs every scenario
per API; each test asserts one behaviour on the results.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from custom_comms import PlainAllGather, PlainReduceScatter
from extension_tensors import CALLS, BFloat16Gathered, ScaledInt8Weight, plain
from fully_shard_models import MLP, needs_reference_fully_shard
from fully_shard_recorder import Recorder
from torch import Tensor, nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from torchcontract import AllGatherExtensionError
from torchcontract.apis import fully_shard
from torchcontract.apis._compat import REFERENCE_FULLY_SHARD_ON_CPU
from torchcontract.testing import run_distributed

Results = dict[str, Any]
APIS: dict[str, Callable[..., Any]] = {"ours": fully_shard, "torch": torch_fully_shard}
#: The APIs the jobs run: FSDP2 only where it runs on CPU (the tests beside it skip elsewhere).
RUN: tuple[str, ...] = ("ours", "torch") if REFERENCE_FULLY_SHARD_ON_CPU else ("ours",)


def _local(parameter: Tensor) -> Tensor:
    """The shard's local tensor object, where FSDP2's hooks are looked up."""
    local: Tensor = cast(DTensor, parameter)._local_tensor
    return local


def _set_hooks(parameter: Tensor, pre: Callable[..., Any], post: Callable[..., Any]) -> None:
    """Set the hooks on the shard's local tensor, as methods of it (PyTorch's monkey patch)."""
    local = _local(parameter)
    setattr(local, "fsdp_pre_all_gather", pre.__get__(local))  # noqa: B010
    setattr(local, "fsdp_post_all_gather", post.__get__(local))  # noqa: B010


def _wrap_weights(model: nn.Module, kind: type[Tensor]) -> None:
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.weight = nn.Parameter(kind(module.weight.detach().clone()))


def _full(model: nn.Module) -> dict[str, list[Any]]:
    """Every parameter, gathered, as nested lists of Python floats (exact, cheap to send)."""
    return {
        name: plain(p.full_tensor() if isinstance(p, DTensor) else p).detach().tolist()
        for name, p in model.named_parameters()
    }


def _reset_calls() -> dict[str, int]:
    before = dict(CALLS)
    for key in CALLS:
        CALLS[key] = 0
    return before


def _train(model: nn.Module, rank: int, steps: int = 3, dim: int = 8) -> list[float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses: list[float] = []
    torch.manual_seed(42 + rank + 1)
    inputs = torch.randn(2, dim)
    for _ in range(steps):
        loss = model(inputs).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _gathers(recorder: Recorder) -> list[tuple[str, int]]:
    return [item for item in recorder.collectives if item[0] == "all_gather"]


def _int8(api: str, rank: int, options: dict[str, Any]) -> Results:
    """Our scaled-int8 weights: 3 steps, losses, parameters, collectives, hook calls."""
    torch.manual_seed(0)
    # Even rows: FSDP2 wants every input of a padded shard padded, the scale too.
    model = nn.Sequential(MLP(8, bias=True), MLP(8, multiplier=3, bias=False))
    _wrap_weights(model, ScaledInt8Weight)
    for mlp in model:
        APIS[api](mlp, **options)
    APIS[api](model, **options)
    _reset_calls()
    recorder = Recorder()
    with recorder.recording():
        losses = _train(model, rank)
    calls = _reset_calls()
    return {
        "losses": losses,
        "full": _full(model),
        "gathers": _gathers(recorder),
        "collectives": recorder.collectives,
        "calls": calls,
    }


def _monkey_patch(api: str, rank: int) -> Results:
    """PyTorch's test_all_gather_extensions_monkey_patch: hooks set on each local tensor."""
    ran: list[str] = []

    def pre(self: Tensor, mesh: Any, size: Any, stride: Any, module: Any, policy: Any) -> Any:  # noqa: PLR0917
        ran.append("pre")
        return (self.to(torch.bfloat16),), None

    @torch.no_grad()
    def post(
        self: Tensor, outputs: Any, metadata: Any, dtype: torch.dtype, *, out: Any = None
    ) -> Any:
        ran.append("post")
        (tensor,) = outputs
        if out is not None:
            with _unsafe_preserve_version_counter(out):
                out.copy_(tensor)
            return None
        upcast = tensor.to(dtype)
        return upcast, (tensor, upcast)

    with torch.device("meta"):
        model = nn.Sequential(*[MLP(8, bias=False) for _ in range(3)])
    for mlp in model:
        APIS[api](mlp)
    APIS[api](model)
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    for parameter in model.parameters():
        nn.init.trunc_normal_(parameter)
    for name, parameter in model.named_parameters():
        if "weight" in name:
            _set_hooks(parameter, pre, post)
    losses = _train(model, rank)
    return {"losses": losses, "full": _full(model), "ran": sorted(set(ran)), "count": len(ran)}


def _hsdp_mesh(api: str, rank: int, world: int) -> Results:
    """PyTorch's test_all_gather_extension_hsdp_mesh: the pre-all-gather gets the shard mesh."""
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    seen: list[tuple[int, int]] = []

    def pre(self: Tensor, given: Any, size: Any, stride: Any, module: Any, policy: Any) -> Any:  # noqa: PLR0917
        seen.append((given.ndim, given.size()))
        return (self,), None

    @torch.no_grad()
    def post(
        self: Tensor, outputs: Any, metadata: Any, dtype: torch.dtype, *, out: Any = None
    ) -> Any:
        (tensor,) = outputs
        if out is not None:
            return None
        return tensor, (tensor,)

    torch.manual_seed(0)
    model = nn.Sequential(*[MLP(8, bias=False) for _ in range(2)])
    for mlp in model:
        APIS[api](mlp, mesh=mesh)
    APIS[api](model, mesh=mesh)
    for name, parameter in model.named_parameters():
        if "weight" in name:
            _set_hooks(parameter, pre, post)
    losses = _train(model, rank)
    return {"seen": sorted(set(seen)), "losses": losses, "full": _full(model)}


def _meta_with_mp(api: str, rank: int) -> Results:
    """PyTorch's test_all_gather_extensions_end_to_end: meta init, bf16 mixed precision."""
    with torch.device("meta"):
        model = nn.Sequential(*[MLP(8, bias=False) for _ in range(2)])
        _wrap_weights(model, BFloat16Gathered)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for mlp in model:
        APIS[api](mlp, mp_policy=policy)
    APIS[api](model, mp_policy=policy)
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            local = _local(parameter)
            plain(local).copy_(torch.randn(local.shape))
    _reset_calls()
    losses = _train(model, rank)
    return {"losses": losses, "full": _full(model), "calls": _reset_calls()}


def _padding_hooks(api: str, rank: int) -> Results:
    """PyTorch's test_all_gather_extension_outer_size_stride: hooks pad uneven shards."""
    torch.manual_seed(0)
    model = MLP(3, multiplier=3)
    _wrap_weights(model, BFloat16Gathered)
    APIS[api](model, reshard_after_forward=False)
    _reset_calls()
    losses = _train(model, rank, steps=2, dim=3)
    return {"losses": losses, "full": _full(model), "calls": _reset_calls()}


def _post_forward_mesh(api: str, rank: int, resharding: bool | int) -> Results:
    """Hooked weights resharded after forward to ``resharding`` ranks (an int), or fully."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(8), MLP(8))
    _wrap_weights(model, ScaledInt8Weight)
    for mlp in model:
        APIS[api](mlp, reshard_after_forward=resharding)
    APIS[api](model, reshard_after_forward=resharding)
    _reset_calls()
    recorder = Recorder()
    try:
        with recorder.recording():
            losses = _train(model, rank)
    except (NotImplementedError, AssertionError) as error:  # FSDP2's, after forward or in backward
        return {"error": type(error).__name__}
    return {
        "losses": losses,
        "full": _full(model),
        "calls": _reset_calls(),
        "gathers": _gathers(recorder),
    }


def _tensor_parallel(api: str, rank: int) -> Results:
    """Hooks on the shards of tensor-parallel weights: a (dp 2, tp 2) mesh."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    seen: list[tuple[int, tuple[int, ...]]] = []

    def pre(self: Tensor, given: Any, size: Any, stride: Any, module: Any, policy: Any) -> Any:  # noqa: PLR0917
        seen.append((given.size(), tuple(size)))
        return (self.to(torch.bfloat16),), None

    @torch.no_grad()
    def post(
        self: Tensor, outputs: Any, metadata: Any, dtype: torch.dtype, *, out: Any = None
    ) -> Any:
        (tensor,) = outputs
        if out is not None:  # the unsharded parameter: a TP DTensor, as FSDP2 passes it
            with _unsafe_preserve_version_counter(out):
                _local(out).copy_(tensor)
            return None
        upcast = tensor.to(dtype)
        return upcast, (tensor, upcast)

    torch.manual_seed(0)
    model = nn.Sequential(MLP(8), MLP(8))
    for mlp in model:
        parallelize_module(
            mlp, mesh["tp"], {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
        )
        APIS[api](mlp, mesh=mesh["dp"])
    APIS[api](model, mesh=mesh["dp"])
    for name, parameter in model.named_parameters():
        if "weight" in name:
            _set_hooks(parameter, pre, post)
    losses = _train(model, rank)
    return {"losses": losses, "full": _full(model), "seen": sorted(set(seen))}


def _four_rank_job(rank: int, world: int) -> dict[str, Results]:
    results: dict[str, Results] = {}
    for api in RUN:
        results[f"{api}/2"] = _post_forward_mesh(api, rank, 2)
        results[f"{api}/True"] = _post_forward_mesh(api, rank, True)
        results[f"tp/{api}"] = _tensor_parallel(api, rank)
    return results


class _CountingAllGather(PlainAllGather):
    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: Any, async_op: bool = False
    ) -> Any:
        self.sizes.append(input_tensor.numel())
        return super().__call__(output_tensor, input_tensor, group, async_op)


class _CountingReduceScatter(PlainReduceScatter):
    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        self.calls.append((input_tensor.numel(), str(op)))
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def _custom_comms(api: str, rank: int) -> Results:
    """set_custom_all_gather / set_custom_reduce_scatter on each module."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(8), MLP(8))
    gather, scatter = _CountingAllGather(), _CountingReduceScatter()
    for module in (*model, model):
        APIS[api](module)
        module.set_custom_all_gather(gather)
        module.set_custom_reduce_scatter(scatter)
    losses = _train(model, rank)
    return {
        "losses": losses,
        "full": _full(model),
        "gathers": gather.sizes,
        "scatters": scatter.calls,
    }


def _job(rank: int, world: int) -> dict[str, Results]:
    results: dict[str, Results] = {}
    for api in RUN:
        results[f"int8/{api}"] = _int8(api, rank, {})
        results[f"int8_mp/{api}"] = _int8(
            api, rank, {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}
        )
        results[f"int8_kept/{api}"] = _int8(api, rank, {"reshard_after_forward": False})
        results[f"monkey/{api}"] = _monkey_patch(api, rank)
        results[f"hsdp/{api}"] = _hsdp_mesh(api, rank, world)
        results[f"meta_mp/{api}"] = _meta_with_mp(api, rank)
        results[f"padding/{api}"] = _padding_hooks(api, rank)
        results[f"comms/{api}"] = _custom_comms(api, rank)
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Results]]:
    return run_distributed(_job, 2, timeout=240)


def _same(mine: dict[str, list[Any]], theirs: dict[str, list[Any]]) -> None:
    assert mine.keys() == theirs.keys()
    for name, value in mine.items():
        assert value == theirs[name], name


SCENARIOS = ["int8", "int8_mp", "int8_kept", "monkey", "hsdp", "meta_mp", "padding", "comms"]


@needs_reference_fully_shard
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_trains_as_fsdp2_to_the_bit(ranks: list[dict[str, Results]], scenario: str) -> None:
    for results in ranks:
        ours, theirs = results[f"{scenario}/ours"], results[f"{scenario}/torch"]
        assert ours["losses"] == theirs["losses"]
        _same(ours["full"], theirs["full"])


@needs_reference_fully_shard
@pytest.mark.parametrize("scenario", ["int8", "int8_mp", "int8_kept"])
def test_sends_fsdp2s_all_gather_bytes(ranks: list[dict[str, Results]], scenario: str) -> None:
    for results in ranks:
        ours, theirs = results[f"{scenario}/ours"], results[f"{scenario}/torch"]
        assert ours["gathers"] == theirs["gathers"]
        assert ours["collectives"] == theirs["collectives"]


@needs_reference_fully_shard
@pytest.mark.parametrize("scenario", ["int8", "int8_mp", "int8_kept", "meta_mp", "padding"])
def test_calls_the_hooks_as_fsdp2(ranks: list[dict[str, Results]], scenario: str) -> None:
    for results in ranks:
        ours, theirs = results[f"{scenario}/ours"], results[f"{scenario}/torch"]
        assert ours["calls"]["pre"] > 0
        assert ours["calls"] == theirs["calls"]


def test_gathers_int8_with_the_hooks(ranks: list[dict[str, Results]]) -> None:
    calls = ranks[0]["int8/ours"]["calls"]
    # 4 weights, gathered in each of 3 forwards and 3 backwards; the first gather builds
    # each unsharded weight, every later one refills it in place (out=).
    assert calls == {"pre": 24, "post": 4, "post_out": 20}


def test_monkey_patched_hooks_run(ranks: list[dict[str, Results]]) -> None:
    for results in ranks:
        assert results["monkey/ours"]["ran"] == ["post", "pre"]
        # 6 weights, gathered in 3 forwards and 3 backwards: pre and post each time.
        assert results["monkey/ours"]["count"] == 6 * 6 * 2


@needs_reference_fully_shard
def test_monkey_patched_hooks_run_as_often_as_fsdp2s(ranks: list[dict[str, Results]]) -> None:
    for results in ranks:
        assert results["monkey/ours"]["count"] == results["monkey/torch"]["count"]


def test_pre_all_gather_gets_the_shard_mesh_of_hsdp(ranks: list[dict[str, Results]]) -> None:
    for results in ranks:
        assert results["hsdp/ours"]["seen"] == [(1, 1)]


@needs_reference_fully_shard
def test_fsdp2_gives_the_same_hsdp_shard_mesh(ranks: list[dict[str, Results]]) -> None:
    for results in ranks:
        assert results["hsdp/torch"]["seen"] == [(1, 1)]


@pytest.fixture(scope="module")
def post_forward_ranks() -> list[dict[str, Results]]:
    return run_distributed(_four_rank_job, 4, timeout=240)


@needs_reference_fully_shard
def test_tensor_parallel_shards_take_the_hooks_as_fsdp2(
    post_forward_ranks: list[dict[str, Results]],
) -> None:
    for results in post_forward_ranks:
        ours, theirs = results["tp/ours"], results["tp/torch"]
        # The dp mesh, and the TP-local shapes: in_proj's (16, 8), out_proj's (8, 16).
        assert ours["seen"] == theirs["seen"] == [(2, (8, 16)), (2, (16, 8))]
        assert ours["losses"] == theirs["losses"]
        _same(ours["full"], theirs["full"])


@needs_reference_fully_shard
def test_fsdp2_refuses_hooks_with_a_post_forward_mesh(
    post_forward_ranks: list[dict[str, Results]],
) -> None:
    for results in post_forward_ranks:
        # Its post-forward reshard expects one all-gather output (AssertionError); with one,
        # its all_gather_inputs raise NotImplementedError in backward.
        assert results["torch/2"] == {"error": "AssertionError"}


@needs_reference_fully_shard
def test_a_post_forward_mesh_trains_as_fsdp2_resharding_fully(
    post_forward_ranks: list[dict[str, Results]],
) -> None:
    for results in post_forward_ranks:
        ours, theirs = results["ours/2"], results["torch/True"]
        assert ours["losses"] == theirs["losses"]
        _same(ours["full"], theirs["full"])


def test_a_post_forward_mesh_gathers_the_kept_hook_outputs(
    post_forward_ranks: list[dict[str, Results]],
) -> None:
    for results in post_forward_ranks:
        smaller, full = results["ours/2"], results["ours/True"]
        # Backward calls no pre-all-gather: it gathers what forward's hooks made, over 2
        # ranks, each sending twice forward's bytes (two of the 4 ranks' inputs).
        assert smaller["calls"]["pre"] * 2 == full["calls"]["pre"]
        assert smaller["calls"]["post_out"] == full["calls"]["post_out"]
        assert smaller["losses"] == full["losses"]
        assert smaller["full"] == full["full"]
        forward = [size for _, size in full["gathers"]]
        assert [size for _, size in smaller["gathers"]] == [
            size * (2 if index % 4 >= 2 else 1) for index, size in enumerate(forward)
        ]


def test_custom_comms_run_every_collective(ranks: list[dict[str, Results]]) -> None:
    for results in ranks:
        ours = results["comms/ours"]
        # 2 groups of 276 elements a rank (the root has none): gathered in 3 forwards and 3
        # backwards, reduced in 3 backwards, averaged (FSDP2's op for float32).
        assert ours["gathers"] == [276] * 12
        assert ours["scatters"] == [(552, str(dist.ReduceOp.AVG))] * 6


@needs_reference_fully_shard
def test_custom_comms_are_called_as_fsdp2_calls_them(ranks: list[dict[str, Results]]) -> None:
    for results in ranks:
        ours, theirs = results["comms/ours"], results["comms/torch"]
        assert ours["gathers"]
        assert ours["gathers"] == theirs["gathers"]
        assert ours["scatters"]
        assert ours["scatters"] == theirs["scatters"]


def _one_hook(rank: int, world: int) -> str:
    lin = fully_shard(nn.Linear(4, 4))
    local = _local(lin.weight)
    setattr(local, "fsdp_pre_all_gather", lambda mesh: ((local,), None))  # noqa: B010
    try:
        lin(torch.randn(1, 4))
    except AllGatherExtensionError as error:
        return str(error)
    return ""


def test_a_shard_with_one_hook_is_refused() -> None:
    (message,) = run_distributed(_one_hook, 1, timeout=60)
    assert "fully_shard on Linear" in message
    assert "defines fsdp_pre_all_gather but not fsdp_post_all_gather" in message


def _repro(rank: int, world: int, api: str) -> list[str]:
    calls: list[str] = []

    def pre(self: Tensor, mesh: Any, size: Any, stride: Any, module: Any, policy: Any) -> Any:  # noqa: PLR0917
        calls.append("pre")
        return (self,), None

    @torch.no_grad()
    def post(
        self: Tensor, outputs: Any, metadata: Any, dtype: torch.dtype, *, out: Any = None
    ) -> Any:
        calls.append("post")
        (tensor,) = outputs
        return None if out is not None else (tensor, (tensor,))

    lin = nn.Linear(4, 4)
    APIS[api](lin)
    _set_hooks(lin.weight, pre, post)
    lin(torch.randn(2, 4)).sum().backward()
    return calls


@pytest.mark.parametrize("api", [pytest.param("torch", marks=needs_reference_fully_shard), "ours"])
def test_one_rank_calls_pre_then_post(api: str) -> None:
    assert run_distributed(_repro, 1, args=(api,), timeout=60) == [["pre", "post"]]
