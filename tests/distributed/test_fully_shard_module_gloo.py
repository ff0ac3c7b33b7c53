"""fully_shard's FSDPModule methods and FSDP2 keywords against FSDP2, on 2 gloo ranks.

Each scenario makes the same calls on a model under ours and one under PyTorch's
``fully_shard`` (the methods through ``FSDPModule``, as library code calls them),
trains both and returns what differs. One job runs them all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from fully_shard_models import (
    GPT,
    batch,
    full_gradients,
    full_parameters,
    gpt,
    largest_gap,
    loss_on,
    needs_reference_fully_shard,
    tiny_llama_config,
)
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    register_fsdp_forward_method,
)
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from torchcontract.apis import fully_shard
from torchcontract.testing import run_distributed

pytestmark = needs_reference_fully_shard

TOLERANCE = 1e-6
Results = dict[str, Any]
Apply = Callable[..., Any]
Configure = Callable[[nn.Module], None]


def _shard(model: GPT, apply: Apply, mesh: DeviceMesh, **options: Any) -> GPT:
    for block in model.blocks:
        apply(block, mesh=mesh, **options)
    apply(model, mesh=mesh, **options)
    return model


def _fsdp(module: nn.Module) -> FSDPModule:
    assert isinstance(module, FSDPModule)
    return module


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(rank: int, step: int, model: GPT, optimizer: torch.optim.Optimizer) -> float:
    loss = loss_on(model, *batch(rank, step))
    torch.autograd.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _side_by_side(
    rank: int,
    mesh: DeviceMesh,
    configure: Configure,
    *,
    steps: int = 3,
    options: dict[str, Any] | None = None,
    prepare: Callable[[GPT], dict[str, Any]] | None = None,
) -> tuple[float, float, float]:
    """Shard both, ``configure`` both, train: largest loss, gradient and parameter gaps.

    Gradients are compared after each backward, before the optimizer's step.
    """
    losses = 0.0
    gradients = 0.0
    models: list[GPT] = []
    optimizers: list[torch.optim.Optimizer] = []
    for apply in (fully_shard, torch_fully_shard):
        model = gpt()
        extra = prepare(model) if prepare is not None else {}
        _shard(model, apply, mesh, **(options or {}), **extra)
        configure(model)
        models.append(model)
        optimizers.append(_adam(model))
    for step in range(steps):
        pair: list[float] = []
        for model in models:
            loss = loss_on(model, *batch(rank, step))
            torch.autograd.backward(loss)
            pair.append(loss.item())
        losses = max(losses, abs(pair[0] - pair[1]))
        gradients = max(gradients, largest_gap(*(full_gradients(model) for model in models)))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return losses, gradients, largest_gap(*(full_parameters(model) for model in models))


# ----------------------------------------------------------------- scenarios


def _classes(mesh: DeviceMesh) -> tuple[list[str], list[str]]:
    """The names of the FSDPModules each finds by isinstance, in module order."""
    found: list[list[str]] = []
    for apply in (fully_shard, torch_fully_shard):
        model = _shard(gpt(), apply, mesh)
        found.append(
            [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]
        )
    return found[0], found[1]


def _trainer(rank: int, mesh: DeviceMesh) -> tuple[float, float, bool]:
    """Hugging Face Trainer's order: eval forward, reshard every FSDPModule, optimizer, train."""
    models: list[GPT] = []
    optimizers: list[torch.optim.Optimizer] = []
    for apply in (fully_shard, torch_fully_shard):
        model = _shard(gpt(), apply, mesh)
        model.eval()
        with torch.no_grad():
            model(batch(rank, 9)[0])
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        model.train()
        models.append(model)
        optimizers.append(_adam(model))
    every_sharded = all(
        isinstance(parameter, DTensor)
        for group in optimizers[0].param_groups
        for parameter in group["params"]
    )
    gap = 0.0
    for step in range(4):
        losses = [
            _step(rank, step, model, opt) for model, opt in zip(models, optimizers, strict=True)
        ]
        gap = max(gap, abs(losses[0] - losses[1]))
    return gap, largest_gap(*(full_parameters(model) for model in models)), every_sharded


def _accumulation(
    rank: int, mesh: DeviceMesh, reshard_after_backward: bool
) -> tuple[float, list[bool]]:
    """Two microbatches without sync (and maybe without reshard after backward), then one with.

    Returns the parameter gap and, for each, whether the root's parameters were
    still unsharded after the first backward.
    """
    models: list[GPT] = []
    unsharded: list[bool] = []
    for apply in (fully_shard, torch_fully_shard):
        model = _shard(gpt(), apply, mesh)
        optimizer = _adam(model)
        for step in range(2):
            for micro in range(3):
                last = micro == 2
                _fsdp(model).set_requires_gradient_sync(last)
                _fsdp(model).set_reshard_after_backward(last or reshard_after_backward)
                _fsdp(model).set_is_last_backward(last)
                torch.autograd.backward(loss_on(model, *batch(rank, 10 * step + micro)))
                if step == 0 and micro == 0:
                    unsharded.append(
                        not isinstance(model.get_parameter("blocks.0.up.weight"), DTensor)
                    )
            optimizer.step()
            optimizer.zero_grad()
        models.append(model)
    return largest_gap(*(full_parameters(model) for model in models)), unsharded


def _reshard_after_forward(
    rank: int, mesh: DeviceMesh
) -> tuple[tuple[float, float, float], list[list[bool]]]:
    """Set on the root only, then off everywhere: numbers, and what is sharded after forward."""
    after: list[list[bool]] = []
    for apply in (fully_shard, torch_fully_shard):
        model = _shard(gpt(), apply, mesh)
        _fsdp(model).set_reshard_after_forward(True, recurse=False)
        with torch.no_grad():
            model(batch(rank, 0)[0])
        root = isinstance(model.norm.weight, DTensor)
        _fsdp(model).set_reshard_after_forward(False)
        with torch.no_grad():
            model(batch(rank, 0)[0])
        block = isinstance(model.get_parameter("blocks.0.up.weight"), DTensor)
        _fsdp(model).reshard()
        for block_module in model.blocks:
            _fsdp(block_module).reshard()
        after.append([root, block])

    def configure(model: nn.Module) -> None:
        _fsdp(model).set_reshard_after_forward(False)
        _fsdp(model).set_reshard_after_forward(True, recurse=False)

    return _side_by_side(rank, mesh, configure), after


def _unshard_in_backward(rank: int, mesh: DeviceMesh) -> tuple[float, float]:
    """The embedding, sharded alone, is not gathered again in backward (it needs no weight)."""
    models: list[GPT] = []
    for apply in (fully_shard, torch_fully_shard):
        model = gpt()
        model.head.weight = nn.Parameter(model.embed.weight.detach().clone())  # untied
        apply(model.embed, mesh=mesh)
        _shard(model, apply, mesh)
        _fsdp(model.embed).set_unshard_in_backward(False)
        models.append(model)
    optimizers = [_adam(model) for model in models]
    losses = 0.0
    for step in range(3):
        pair = [
            _step(rank, step, model, opt) for model, opt in zip(models, optimizers, strict=True)
        ]
        losses = max(losses, abs(pair[0] - pair[1]))
    return losses, largest_gap(*(full_parameters(model) for model in models))


def _gradients_after_one_backward(
    rank: int, mesh: DeviceMesh, configure: Configure
) -> list[dict[str, Tensor]]:
    found: list[dict[str, Tensor]] = []
    for apply in (fully_shard, torch_fully_shard):
        model = _shard(gpt(), apply, mesh)
        configure(model)
        torch.autograd.backward(loss_on(model, *batch(rank, 0)))
        found.append(full_gradients(model))
    return found


def _divide_factor(rank: int, mesh: DeviceMesh) -> Results:
    """Gradients summed and divided by 3, not averaged over 2; FSDP2's where it runs on gloo."""

    def configure(model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(3.0)

    averaged = full_gradients(_trained_once(rank, mesh, lambda model: None))
    ours = full_gradients(_trained_once(rank, mesh, configure))
    scaled = largest_gap(ours, {name: grad * 2 / 3 for name, grad in averaged.items()})
    try:
        theirs: float | str = largest_gap(*_gradients_after_one_backward(rank, mesh, configure))
    except (RuntimeError, ValueError) as error:  # gloo has no PREMUL_SUM
        theirs = type(error).__name__
    return {"scaled": scaled, "theirs": theirs}


def _trained_once(rank: int, mesh: DeviceMesh, configure: Configure) -> GPT:
    model = _shard(gpt(), fully_shard, mesh)
    configure(model)
    torch.autograd.backward(loss_on(model, *batch(rank, 0)))
    return model


def _all_reduce_hook(rank: int, mesh: DeviceMesh) -> tuple[float, float]:
    """A hook doubling each reduce-scatter output, set on the root and on one block."""
    calls: list[int] = [0, 0]

    def configure_for(index: int) -> Configure:
        def hook(output: Tensor) -> None:
            calls[index] += 1
            output.mul_(2)

        def configure(model: nn.Module) -> None:
            _fsdp(model).set_all_reduce_hook(hook)
            _fsdp(model.get_submodule("blocks.1")).set_all_reduce_hook(hook)

        return configure

    ours_model = _shard(gpt(), fully_shard, mesh)
    theirs_model = _shard(gpt(), torch_fully_shard, mesh)
    configure_for(0)(ours_model)
    configure_for(1)(theirs_model)
    for model in (ours_model, theirs_model):
        torch.autograd.backward(loss_on(model, *batch(rank, 0)))
    plain = full_gradients(_trained_once(rank, mesh, lambda model: None))
    doubled = full_gradients(ours_model)
    unhooked = max(
        float((doubled[name] - plain[name]).abs().max())
        for name in doubled
        if name.startswith("blocks.0")
    )
    return largest_gap(doubled, full_gradients(theirs_model)), unhooked + abs(calls[0] - calls[1])


def _unused_parameters(rank: int, mesh: DeviceMesh, include: bool) -> tuple[list[bool], float]:
    """A block whose MLP is skipped: with the setting, its gradients are zeros, not None."""
    found: list[dict[str, Tensor]] = []
    for apply in (fully_shard, torch_fully_shard):
        model = _shard(gpt(), apply, mesh)
        _fsdp(model).set_reduce_scatter_unused_params(include)
        block = model.blocks[1]

        def skipping(x: Tensor, block: nn.Module = block) -> Tensor:
            out: Tensor = block.get_submodule("proj")(block.get_submodule("norm1")(x)) + x
            return out

        cast(Any, block).forward = skipping  # the MLP (up, down, norm2) takes no part
        torch.autograd.backward(loss_on(model, *batch(rank, 0)))
        found.append(full_gradients(model))
    has_up = ["blocks.1.up.weight" in grads for grads in found]
    return has_up, largest_gap(*found)


def _settings_without_effect_here(rank: int, mesh: DeviceMesh) -> tuple[float, float, float]:
    """All-reduce off and forced sums: on a 1-D gloo mesh FSDP2's numbers do not change."""

    def configure(model: nn.Module) -> None:
        _fsdp(model).set_requires_all_reduce(False)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    return _side_by_side(rank, mesh, configure)


def _unshard_methods(mesh: DeviceMesh) -> list[list[bool]]:
    """unshard(), unshard(async_op=True) + wait(), reshard(): what is registered after each."""
    seen: list[list[bool]] = []
    for apply in (fully_shard, torch_fully_shard):
        model = _shard(gpt(), apply, mesh)
        block = _fsdp(model.blocks[0])
        states: list[bool] = []
        block.unshard()
        states.append(isinstance(model.get_parameter("blocks.0.up.weight"), DTensor))
        states.append(isinstance(model.norm.weight, DTensor))
        block.reshard()
        states.append(isinstance(model.get_parameter("blocks.0.up.weight"), DTensor))
        handle = block.unshard(async_op=True)
        states.append(handle is not None)
        states.append(isinstance(model.get_parameter("blocks.0.up.weight"), DTensor))  # not yet
        if handle is not None:
            handle.wait()
        states.append(isinstance(model.get_parameter("blocks.0.up.weight"), DTensor))
        block.reshard()
        seen.append(states)
    return seen


class _Failing(nn.Module):
    """Raises in forward once armed."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: Tensor) -> Tensor:
        if self.armed:
            raise ValueError("planned failure in forward")
        return x


def _reset_iter_state(rank: int, mesh: DeviceMesh) -> tuple[float, float, float]:
    """A backward that raised half-way, reset_iter_state() on the root, then training."""

    def configure(model: nn.Module) -> None:
        failing = _Failing()
        cast(Any, model.get_submodule("blocks.1")).register_forward_hook(
            lambda module, args, output: failing(output)
        )
        failing.armed = True
        with contextlib.suppress(ValueError):
            torch.autograd.backward(loss_on(model, *batch(rank, 5)))
        _fsdp(model).reset_iter_state()
        failing.armed = False

    return _side_by_side(rank, mesh, configure)


def _mixed_precision(
    rank: int, mesh: DeviceMesh, blocks: MixedPrecisionPolicy, root: MixedPrecisionPolicy
) -> tuple[float, float, list[str]]:
    """Three Adam steps with these policies: loss and parameter gaps, the outputs' dtypes."""
    models: list[GPT] = []
    dtypes: list[str] = []
    for apply in (fully_shard, torch_fully_shard):
        model = gpt()
        for block in model.blocks:
            apply(block, mesh=mesh, mp_policy=blocks)
        apply(model, mesh=mesh, mp_policy=root)
        with torch.no_grad():
            dtypes.append(str(model(batch(rank, 0)[0]).dtype))
        models.append(model)
    optimizers = [_adam(model) for model in models]
    losses = 0.0
    for step in range(3):
        pair = [
            _step(rank, step, model, opt) for model, opt in zip(models, optimizers, strict=True)
        ]
        losses = max(losses, abs(pair[0] - pair[1]))
    return losses, largest_gap(*(full_parameters(model) for model in models)), dtypes


def _offload(rank: int, mesh: DeviceMesh) -> tuple[tuple[float, float, float], float]:
    """CPUOffloadPolicy on a CPU mesh: FSDP2's numbers, and ours without it.

    FSDP2 pins memory, which needs an accelerator, unless ``pin_memory=False``.
    """
    unpinned = {"offload_policy": CPUOffloadPolicy(pin_memory=False)}
    against_theirs = _side_by_side(rank, mesh, lambda model: None, options=unpinned)
    with_policy = _shard(gpt(), fully_shard, mesh, offload_policy=CPUOffloadPolicy())
    without = _shard(gpt(), fully_shard, mesh)
    for model in (with_policy, without):
        torch.autograd.backward(loss_on(model, *batch(rank, 0)))
    return against_theirs, largest_gap(full_gradients(with_policy), full_gradients(without))


def _ignored(rank: int, mesh: DeviceMesh) -> tuple[tuple[float, float, float], list[bool]]:
    """The final norm ignored: plain, updated from this rank's gradients only, as FSDP2."""
    plain: list[bool] = []

    def prepare(model: GPT) -> dict[str, Any]:
        return {"ignored_params": set(model.norm.parameters())}

    numbers = _side_by_side(rank, mesh, lambda model: None, prepare=prepare)
    for apply in (fully_shard, torch_fully_shard):
        model = gpt()
        _shard(model, apply, mesh, **prepare(model))
        plain.append(not any(isinstance(p, DTensor) for p in model.norm.parameters()))
    return numbers, plain


def _placement(rank: int, mesh: DeviceMesh) -> tuple[float, float, float]:
    from torch.distributed.tensor import Shard

    options = {"shard_placement_fn": lambda parameter: Shard(0)}
    return _side_by_side(rank, mesh, lambda model: None, options=options)


def _generate(mesh: DeviceMesh) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Hugging Face generate() on a tiny Llama, registered as a forward method: both, and plain."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config()
    prompt = torch.tensor([[1, 5, 9, 3]])
    outputs: list[list[list[int]]] = []
    for apply in (fully_shard, torch_fully_shard, None):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        cast(nn.Module, model).eval()
        if apply is not None:
            for layer in model.model.layers:
                apply(layer, mesh=mesh)
            apply(model, mesh=mesh)
            register_fsdp_forward_method(model, "generate")
        with torch.no_grad():
            generate = cast(Callable[..., Tensor], cast(Any, model).generate)
            tokens = generate(prompt, max_new_tokens=6, do_sample=False)
        outputs.append(tokens.tolist())
    return outputs[0], outputs[1], outputs[2]


def _job(rank: int, world_size: int) -> Results:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.use_deterministic_algorithms(True)
    return {
        "classes": _classes(mesh),
        "trainer": _trainer(rank, mesh),
        "accumulate": _accumulation(rank, mesh, reshard_after_backward=True),
        "accumulate_kept": _accumulation(rank, mesh, reshard_after_backward=False),
        "reshard_after_forward": _reshard_after_forward(rank, mesh),
        "unshard_in_backward": _unshard_in_backward(rank, mesh),
        "divide_factor": _divide_factor(rank, mesh),
        "all_reduce_hook": _all_reduce_hook(rank, mesh),
        "unused": _unused_parameters(rank, mesh, include=True),
        "unused_default": _unused_parameters(rank, mesh, include=False),
        "no_effect": _settings_without_effect_here(rank, mesh),
        "unshard": _unshard_methods(mesh),
        "reset": _reset_iter_state(rank, mesh),
        "mixed_output": _mixed_precision(
            rank,
            mesh,
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
            ),
        ),
        "mixed_no_cast": _mixed_precision(
            rank,
            mesh,
            MixedPrecisionPolicy(param_dtype=torch.float64, cast_forward_inputs=False),
            MixedPrecisionPolicy(param_dtype=torch.float64, cast_forward_inputs=False),
        ),
        "offload": _offload(rank, mesh),
        "ignored": _ignored(rank, mesh),
        "placement": _placement(rank, mesh),
        "generate": _generate(mesh),
    }


@pytest.fixture(scope="module")
def ranks() -> list[Results]:
    return run_distributed(_job, 2, timeout=300.0)


def _each(ranks: list[Results], key: str) -> list[Any]:
    return [rank[key] for rank in ranks]


def _matches(gaps: tuple[float, ...]) -> bool:
    return all(gap <= TOLERANCE for gap in gaps)


# ----------------------------------------------------------------- tests


def test_isinstance_finds_the_same_fsdp_modules_as_torch(ranks: list[Results]) -> None:
    for ours, theirs in _each(ranks, "classes"):
        assert ours == theirs == ["", "blocks.0", "blocks.1"]


def test_the_trainer_pattern_trains_every_parameter_as_torch(ranks: list[Results]) -> None:
    for loss_gap, parameter_gap, every_sharded in _each(ranks, "trainer"):
        assert every_sharded
        assert loss_gap <= TOLERANCE
        assert parameter_gap <= TOLERANCE


@pytest.mark.parametrize("key", ["accumulate", "accumulate_kept"])
def test_accumulation_with_sync_and_reshard_settings_matches_torch(
    ranks: list[Results], key: str
) -> None:
    for gap, unsharded in _each(ranks, key):
        assert gap <= TOLERANCE
        assert unsharded == [key == "accumulate_kept"] * 2


def test_reshard_after_forward_set_at_run_time_matches_torch(ranks: list[Results]) -> None:
    for numbers, after in _each(ranks, "reshard_after_forward"):
        assert _matches(numbers)
        assert after == [[True, False], [True, False]]


def test_unshard_in_backward_off_matches_torch(ranks: list[Results]) -> None:
    for numbers in _each(ranks, "unshard_in_backward"):
        assert _matches(numbers)


def test_gradient_divide_factor_divides_the_sum(ranks: list[Results]) -> None:
    for result in _each(ranks, "divide_factor"):
        assert result["scaled"] <= TOLERANCE
        theirs = result["theirs"]
        assert isinstance(theirs, str) or theirs <= TOLERANCE


def test_all_reduce_hook_sees_each_reduce_scatter_output_as_torch(ranks: list[Results]) -> None:
    for gap, unhooked in _each(ranks, "all_reduce_hook"):
        assert gap <= TOLERANCE
        assert unhooked == 0.0


@pytest.mark.parametrize("key", ["unused", "unused_default"])
def test_unused_parameters_get_zeros_only_when_asked_as_torch(
    ranks: list[Results], key: str
) -> None:
    for has_up, gap in _each(ranks, key):
        assert has_up == [key == "unused"] * 2
        assert gap <= TOLERANCE


def test_all_reduce_and_sum_settings_change_nothing_on_a_1d_mesh_as_torch(
    ranks: list[Results],
) -> None:
    for numbers in _each(ranks, "no_effect"):
        assert _matches(numbers)


def test_unshard_and_reshard_methods_register_what_torch_registers(ranks: list[Results]) -> None:
    for ours, theirs in _each(ranks, "unshard"):
        assert ours == theirs == [False, True, True, True, True, False]


def test_reset_iter_state_after_a_failed_forward_trains_as_torch(ranks: list[Results]) -> None:
    for numbers in _each(ranks, "reset"):
        assert _matches(numbers)


@pytest.mark.parametrize("key", ["mixed_output", "mixed_no_cast"])
def test_mixed_precision_policies_match_torch(ranks: list[Results], key: str) -> None:
    expected = {"mixed_output": "torch.float32", "mixed_no_cast": "torch.float64"}[key]
    for loss_gap, parameter_gap, dtypes in _each(ranks, key):
        assert loss_gap <= 1e-5
        assert parameter_gap <= 1e-5
        assert dtypes == [expected, expected]


def test_cpu_offload_on_a_cpu_mesh_changes_nothing(ranks: list[Results]) -> None:
    for against_theirs, against_ours in _each(ranks, "offload"):
        assert _matches(against_theirs)
        assert against_ours == 0.0


def test_ignored_parameters_stay_plain_and_train_locally_as_torch(ranks: list[Results]) -> None:
    for numbers, plain in _each(ranks, "ignored"):
        assert _matches(numbers)
        assert plain == [True, True]


def test_a_dim_0_placement_function_matches_torch(ranks: list[Results]) -> None:
    for numbers in _each(ranks, "placement"):
        assert _matches(numbers)


def test_generate_registered_as_a_forward_method_matches_torch_and_plain(
    ranks: list[Results],
) -> None:
    for ours, theirs, plain in _each(ranks, "generate"):
        assert ours == theirs == plain
        assert len(ours[0]) == 10
