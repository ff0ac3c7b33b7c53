"""The demo under torchrun survives: two nodes, a killed worker, a rerun, one final line.

Rank 0 prints one final line per phase. Every scenario ends with the final lines of one
uninterrupted run on 4 workers (the
module-scoped fixture, per phase: HSDP, and replicate then fully_shard). The
commands are those of docs/running-across-machines.md, with its shell variables
filled in: ``test_the_page_shows_the_tested_commands`` holds the two together.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import uuid
from pathlib import Path
from typing import Final

import attrs
import pytest
import torch
from commands import BackgroundCommand, run_command, wait_for_directory, workers_of
from pages import DOCS, code_blocks

from torchcontract.apis._compat import REFERENCE_FULLY_SHARD_ON_CPU
from torchcontract.testing import free_port

pytestmark = pytest.mark.slow

PAGE: Final = DOCS / "running-across-machines.md"
#: Seconds for one torchrun command: 4 workers start, train 10 steps, save 5 checkpoints.
TIMEOUT: Final = 240.0
#: The HSDP phase's commands as the page shows them; the replicate phase's drop ``--hsdp``.
DEMO: Final = (
    "-m torchcontract.demo --hsdp --steps 10 --checkpoint-every 2 --checkpoint-dir $CHECKPOINTS"
)
STANDALONE: Final = f"torchrun --standalone --nproc-per-node 4 {DEMO}"
TWO_NODES: Final = (
    "torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d "
    f"--rdzv-endpoint $HOST:$PORT --rdzv-id $JOB {DEMO}"
)
#: A restarted group needs a store of its own: in the one the agents share, the previous
#: attempt's addresses remain, and gloo connects to them (pytorch/pytorch#135712).
RESTARTING: Final = (
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 4 "
    f"--max-restarts 1 {DEMO} --pause-after-checkpoint 6"
)
PHASES: Final = ("hsdp", "replicate")
FINAL_LINE: Final = re.compile(
    r"final \((?:replicate|fully_shard|hsdp)\): step 10 loss \d+\.\d{6} parameters [0-9a-f]{16}"
)
#: Unbuffered, so a killed worker's output is all there; and a worker that dies of a fatal
#: signal (SIGABRT from native code) prints its Python stacks (faulthandler).
ENVIRONMENT: Final = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}


@attrs.frozen
class Command:
    arguments: list[str]
    environment: dict[str, str]


def _command(template: str, phase: str, checkpoints: Path, port: int = 0, job: str = "") -> Command:
    """``template`` with its variables filled in, ``torchrun`` the venv's, for ``phase``."""
    if phase == "replicate":
        template = template.replace(" --hsdp", "")
    filled = (
        template.replace("$CHECKPOINTS", str(checkpoints))
        .replace("$HOST", "127.0.0.1")
        .replace("$PORT", str(port))
        .replace("$JOB", job)
    )
    words = filled.split()
    environment = dict(ENVIRONMENT)
    while "=" in words[0]:  # VARIABLE=value before the program
        name, value = words.pop(0).split("=", 1)
        environment[name] = value
    program, *arguments = words
    assert program == "torchrun"
    return Command([sys.executable, "-m", "torch.distributed.run", *arguments], environment)


def _final_lines(output: str) -> list[str]:
    return sorted(line for line in output.splitlines() if line.startswith("final ("))


def _run(command: Command) -> str:
    done = run_command(command.arguments, timeout=TIMEOUT, env=command.environment)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@attrs.frozen
class Uninterrupted:
    phase: str
    checkpoints: Path
    output: str

    @property
    def final_lines(self) -> list[str]:
        return _final_lines(self.output)


@pytest.fixture(scope="module", params=PHASES)
def uninterrupted(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Uninterrupted:
    phase = str(request.param)
    checkpoints = tmp_path_factory.mktemp(f"uninterrupted-{phase}")
    output = _run(_command(STANDALONE, phase, checkpoints))
    return Uninterrupted(phase, checkpoints, output)


def test_rank_0_prints_one_labelled_final_line_per_phase(uninterrupted: Uninterrupted) -> None:
    lines = uninterrupted.final_lines
    phases = ["hsdp"] if uninterrupted.phase == "hsdp" else ["fully_shard", "replicate"]
    assert [line.split(")")[0].removeprefix("final (") for line in lines] == phases
    assert all(FINAL_LINE.fullmatch(line) for line in lines)
    assert "disagree" not in uninterrupted.output


@pytest.mark.parametrize("uninterrupted", ["replicate"], indirect=True)  # --hsdp: one phase
def test_both_phases_say_whether_their_parameters_agree(uninterrupted: Uninterrupted) -> None:
    digests = {line.rsplit(" ", 1)[1] for line in uninterrupted.final_lines}
    # 4 ranks: the all-reduce and the reduce-scatter may add the gradients in other orders.
    if len(digests) == 1:
        assert "both phases end with the same parameters" in uninterrupted.output
    else:
        assert "the phases' parameters differ in the last bits" in uninterrupted.output


def test_a_fresh_run_still_compares_with_pytorch(uninterrupted: Uninterrupted) -> None:
    if uninterrupted.phase == "replicate":
        claim = "gradients matched DistributedDataParallel's on the first step: yes"
    elif REFERENCE_FULLY_SHARD_ON_CPU:
        claim = "first-step losses matched PyTorch's fully_shard: yes"
    else:  # the demo says why it could not compare
        claim = (
            "first-step losses not compared: PyTorch's fully_shard does not run on CPU "
            f"with torch {torch.__version__}"
        )
    assert claim in uninterrupted.output


def test_two_agents_as_two_nodes_end_with_the_same_lines(
    uninterrupted: Uninterrupted, tmp_path: Path
) -> None:
    command = _command(
        TWO_NODES, uninterrupted.phase, tmp_path / "checkpoints", free_port(), uuid.uuid4().hex
    )
    with (
        BackgroundCommand(
            command.arguments, output=tmp_path / "node0", env=command.environment
        ) as first,
        BackgroundCommand(
            command.arguments, output=tmp_path / "node1", env=command.environment
        ) as second,
    ):
        nodes = [first.wait(TIMEOUT), second.wait(TIMEOUT)]
    assert [node.returncode for node in nodes] == [0, 0], nodes[0].stderr + nodes[1].stderr
    # Each agent's output holds its own two workers' lines.
    assert _final_lines(nodes[0].stdout + nodes[1].stdout) == uninterrupted.final_lines


def test_a_killed_worker_is_restarted_and_resumes_from_the_step_6_checkpoint(
    uninterrupted: Uninterrupted, tmp_path: Path
) -> None:
    checkpoints = tmp_path / "checkpoints"
    command = _command(RESTARTING, uninterrupted.phase, checkpoints)
    with BackgroundCommand(
        command.arguments, output=tmp_path / "agent", env=command.environment
    ) as agent:
        # The first phase's step-6 checkpoint: the workers wait after it, on this attempt.
        phase = "hsdp" if uninterrupted.phase == "hsdp" else "replicate"
        wait_for_directory(checkpoints / phase / "step-000006", agent, TIMEOUT)
        os.kill(workers_of(agent.process.pid)[1], signal.SIGKILL)
        done = agent.wait(TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{phase}: resuming from {checkpoints / phase / 'step-000006'}" in done.stdout
    assert _final_lines(done.stdout) == uninterrupted.final_lines


def test_a_restart_in_the_agents_shared_store_is_refused_with_what_to_do(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    command = _command(RESTARTING.split(" ", 1)[1], "hsdp", checkpoints)
    with BackgroundCommand(
        command.arguments, output=tmp_path / "agent", env=command.environment
    ) as agent:
        wait_for_directory(checkpoints / "hsdp" / "step-000006", agent, TIMEOUT)
        os.kill(workers_of(agent.process.pid)[1], signal.SIGKILL)
        done = agent.wait(TIMEOUT)
    assert done.returncode != 0
    assert "torchrun restarted the workers in the store its agents share" in done.stderr
    assert "run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in done.stderr


def test_a_rerun_on_a_finished_directory_trains_nothing_and_ends_the_same(
    uninterrupted: Uninterrupted,
) -> None:
    output = _run(_command(STANDALONE, uninterrupted.phase, uninterrupted.checkpoints))
    assert "resuming from" in output
    assert "[###" not in output  # no step: no progress bar
    assert _final_lines(output) == uninterrupted.final_lines


def _page_commands() -> list[str]:
    commands = []
    for block in code_blocks(PAGE, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if "torchrun " in line:
                commands.append(" ".join(line.split()))
    return commands


def test_the_page_shows_the_tested_commands() -> None:
    assert sorted(set(_page_commands())) == sorted({STANDALONE, TWO_NODES, RESTARTING})
