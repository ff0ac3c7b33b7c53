"""The demo on two gloo ranks: it trains, matches DDP, and prints its report, also via torchrun."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from commands import run_command
from pages import DOCS

from torchcontract.apis._compat import REFERENCE_FULLY_SHARD_ON_CPU
from torchcontract.demo import Outcome, Settings, ShardedOutcome, train, train_sharded
from torchcontract.testing import run_distributed

REPORT_LINES = (
    "describe(model)",
    "GPT  [replicate]",
    "0-3: Block ×4  [checkpoint]",
    "rank 0  replicate   on GPT: gloo rank 0 of 2",
    "rank 1  replicate   on GPT: gloo rank 1 of 2",
    "rank 1  checkpoint  on blocks.3: use_reentrant=False",
    "gradients matched DistributedDataParallel's on the first step: yes",
    "describe(model)  (fully_shard on each block and the root, 2 ranks)",
    "GPT  [fully_shard]",
    "0-3: Block ×4  [fully_shard]",
    "parameter bytes per rank: rank 0: 412,416, rank 1: 412,416 of 824,832 for the whole model",
    "first-step losses matched PyTorch's fully_shard: yes"
    if REFERENCE_FULLY_SHARD_ON_CPU
    else "first-step losses not compared",
)


@pytest.fixture(scope="module")
def outcomes() -> list[Outcome]:
    return run_distributed(train, 2, timeout=120.0, args=(Settings(steps=8),))


def test_first_step_gradients_match_ddp_on_every_rank(outcomes: list[Outcome]) -> None:
    assert [outcome.ddp_gradient_gap <= 1e-6 for outcome in outcomes] == [True, True]


def test_loss_falls_from_chance_level(outcomes: list[Outcome]) -> None:
    for outcome in outcomes:
        assert outcome.first_loss == pytest.approx(math.log(64), abs=0.2)
        assert outcome.final_loss < outcome.first_loss - 0.2


def test_ranks_report_the_same_averaged_loss(outcomes: list[Outcome]) -> None:
    assert outcomes[0].final_loss == outcomes[1].final_loss


@pytest.fixture(scope="module")
def sharded() -> list[ShardedOutcome]:
    return run_distributed(train_sharded, 2, timeout=120.0, args=(Settings(steps=8),))


@pytest.mark.skipif(
    not REFERENCE_FULLY_SHARD_ON_CPU,
    reason=f"PyTorch's fully_shard, the reference, fails on CPU with torch {torch.__version__}",
)
def test_sharded_first_losses_match_torch_fully_shard(sharded: list[ShardedOutcome]) -> None:
    assert [outcome.torch_loss_gap <= 1e-6 for outcome in sharded] == [True, True]


def test_each_rank_stores_half_of_the_parameter_bytes(sharded: list[ShardedOutcome]) -> None:
    assert sum(outcome.local_bytes for outcome in sharded) == sharded[0].full_bytes
    assert [outcome.local_bytes for outcome in sharded] == [sharded[0].full_bytes // 2] * 2


def test_sharded_loss_falls_and_ranks_agree(sharded: list[ShardedOutcome]) -> None:
    for outcome in sharded:
        assert outcome.final_loss < outcome.first_loss - 0.2
    assert sharded[0].final_loss == sharded[1].final_loss


def _completed(command: list[str]) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = run_command(command, timeout=180, env=environment)
    assert done.returncode == 0, done.stderr
    return done


def _run(command: list[str]) -> str:
    return _completed(command).stdout


@pytest.fixture(scope="module")
def demo_run() -> subprocess.CompletedProcess[str]:
    return _completed([sys.executable, "-m", "torchcontract.demo", "--nproc", "2", "--steps", "3"])


@pytest.fixture(scope="module")
def demo_output(demo_run: subprocess.CompletedProcess[str]) -> str:
    return demo_run.stdout


#: DDP's warning, which docs/getting-started.md explains: one per process, from the DDP copy.
DDP_WARNING = "find_unused_parameters=True was specified in DDP constructor"


def test_demo_warns_as_the_getting_started_page_explains(
    demo_run: subprocess.CompletedProcess[str],
) -> None:
    warned = [line for line in demo_run.stderr.splitlines() if DDP_WARNING in line]
    assert sorted(line.split("]")[0] for line in warned) == ["[rank0", "[rank1"]
    page = " ".join((DOCS / "getting-started.md").read_text().split())
    assert f"`{DDP_WARNING}, but did not find any unused parameters`" in page


def test_demo_command_prints_the_report(demo_output: str) -> None:
    assert "[##############################] 3/3  loss" in demo_output
    for line in REPORT_LINES:
        assert line in demo_output


def test_demo_prints_each_phase_result_once_and_why_both_agree(demo_output: str) -> None:
    lines = [line for line in demo_output.splitlines() if line.startswith("final (")]
    assert [line.split(")")[0] for line in lines] == ["final (replicate", "final (fully_shard"]
    results = {line.split("): ", 1)[1] for line in lines}
    assert len(results) == 1  # the same step, loss and digest: 2 ranks sum in either order
    (digest,) = {line.rsplit(" ", 1)[1] for line in lines}
    assert f"both phases end with the same parameters ({digest})" in demo_output


def test_demo_under_torchrun_prints_the_report() -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun), "--standalone", "--nproc-per-node", "2"]
    output = _run([*launcher, "-m", "torchcontract.demo", "--steps", "3"])
    for line in REPORT_LINES:
        assert line in output


def test_demo_hsdp_option_trains_on_4_ranks_as_hsdp() -> None:
    """``--hsdp``: the fully_shard phase alone, on a (2, 2) mesh of 4 processes."""
    output = _run([sys.executable, "-m", "torchcontract.demo", "--hsdp", "--steps", "3"])
    assert "training a small GPT on 4 gloo processes for 3 steps: fully_shard" in output
    assert "[##############################] 3/3  loss" in output
    assert "(fully_shard on each block and the root, HSDP, 2 replicas x 2 shards)" in output
    shares = ", ".join(f"rank {rank}: 412,416" for rank in range(4))
    assert f"parameter bytes per rank: {shares} of 824,832 for the whole model" in output
    if REFERENCE_FULLY_SHARD_ON_CPU:
        assert "first-step losses matched PyTorch's fully_shard: yes" in output
    assert "replicate" not in output
