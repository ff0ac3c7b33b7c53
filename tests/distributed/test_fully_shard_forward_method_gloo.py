"""A method registered with ``register_fsdp_forward_method``, then training, against FSDP2.

After a registered method that runs the model's forward (Hugging Face ``generate``)
FSDP2 frees every group's parameters, the root's too: an optimizer built next holds
the shards. Had the root's stayed registered unsharded, that optimizer would hold
plain tensors that no step reaches, and the numbers would drift from FSDP2's
without an error. A method that runs no forward inside keeps the root's parameters
as a forward would. Both on 2 gloo ranks, the same calls on both models.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, cast

import pytest
import torch
from fully_shard_models import (
    GPT,
    batch,
    full_parameters,
    largest_gap,
    loss_on,
    needs_reference_fully_shard,
    tiny_llama_config,
)
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp import register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from torchcontract.apis import fully_shard
from torchcontract.testing import run_distributed

pytestmark = needs_reference_fully_shard

TOLERANCE: Final = 1e-6
Results = dict[str, Any]
Apply = Callable[..., Any]


class Generating(GPT):
    """The test GPT with two registered methods: one runs forward inside, one does not."""

    def generate(self, tokens: Tensor, steps: int) -> Tensor:
        """Greedy decoding: one forward per new token."""
        for _ in range(steps):
            logits: Tensor = self(tokens)
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
        return tokens

    def score(self, tokens: Tensor) -> Tensor:
        """The embedding's norm of the tokens: parameters read, no forward run."""
        norm: Tensor = self.embed(tokens).norm()
        return norm


def _sharded(apply: Apply, mesh: DeviceMesh) -> Generating:
    torch.manual_seed(0)
    model = Generating()
    for block in model.blocks:
        apply(block, mesh=mesh)
    apply(model, mesh=mesh)
    register_fsdp_forward_method(model, "generate")
    register_fsdp_forward_method(model, "score")
    return model


def _unsharded(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]


def _generate_then_train(rank: int, mesh: DeviceMesh) -> Results:
    """generate() under no_grad, then an AdamW built and stepped 3 times: as FSDP2."""
    models: list[Generating] = []
    found: Results = {"unsharded": [], "tokens": []}
    for apply in (fully_shard, torch_fully_shard):
        model = _sharded(apply, mesh)
        with torch.no_grad():
            found["tokens"].append(model.generate(batch(rank, 0)[0][:, :3], 3).tolist())
        found["unsharded"].append(_unsharded(model))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        found.setdefault("optimized", []).append(
            all(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])
        )
        for step in range(3):
            torch.autograd.backward(loss_on(model, *batch(rank, step)))
            optimizer.step()
            optimizer.zero_grad()
        models.append(model)
    found["gap"] = largest_gap(*(full_parameters(model) for model in models))
    return found


def _score_keeps_the_root(rank: int, mesh: DeviceMesh) -> list[list[str]]:
    """A registered method without a forward inside: what stays registered unsharded."""
    seen: list[list[str]] = []
    for apply in (fully_shard, torch_fully_shard):
        model = _sharded(apply, mesh)
        with torch.no_grad():
            model.score(batch(rank, 0)[0])
        seen.append(_unsharded(model))
        cast(Any, model).reshard()
    return seen


def _llama_generate_then_train(rank: int, mesh: DeviceMesh) -> float:
    """Hugging Face generate() on a tiny Llama, then 3 AdamW steps: the parameter gap."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config()
    models: list[nn.Module] = []
    generator = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, 37, (2, 6), generator=generator) for _ in range(3)]
    for apply in (fully_shard, torch_fully_shard):
        torch.manual_seed(0)
        model = cast(nn.Module, LlamaForCausalLM(config))
        for layer in cast(Any, model).model.layers:
            apply(layer, mesh=mesh)
        apply(model, mesh=mesh)
        register_fsdp_forward_method(model, "generate")
        with torch.no_grad():
            generate = cast(Callable[..., Tensor], cast(Any, model).generate)
            generate(torch.tensor([[1, 5, 9, 3]]), max_new_tokens=3, do_sample=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for tokens in data:
            loss = cast(Any, model)(input_ids=tokens, labels=tokens).loss
            torch.autograd.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        models.append(model)
    return largest_gap(*(full_parameters(model) for model in models))


def _job(rank: int, world_size: int) -> Results:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.use_deterministic_algorithms(True)
    return {
        "generate": _generate_then_train(rank, mesh),
        "score": _score_keeps_the_root(rank, mesh),
        "llama": _llama_generate_then_train(rank, mesh),
    }


@pytest.fixture(scope="module")
def ranks() -> list[Results]:
    return run_distributed(_job, 2, timeout=240.0)


def test_a_registered_method_running_forward_reshards_the_root_as_torch(
    ranks: list[Results],
) -> None:
    for found in ranks:
        result = found["generate"]
        assert result["unsharded"] == [[], []]
        assert result["tokens"][0] == result["tokens"][1]


def test_an_optimizer_built_after_a_registered_method_trains_as_torch(
    ranks: list[Results],
) -> None:
    for found in ranks:
        result = found["generate"]
        assert result["optimized"] == [True, True]
        assert result["gap"] <= TOLERANCE


def test_a_registered_method_without_forward_keeps_the_root_as_torch(
    ranks: list[Results],
) -> None:
    for found in ranks:
        ours, theirs = found["score"]
        assert ours == theirs
        assert "embed.weight" in ours


def test_hugging_face_generate_then_training_matches_torch(ranks: list[Results]) -> None:
    for found in ranks:
        assert found["llama"] <= TOLERANCE
