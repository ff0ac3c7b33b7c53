"""The save-and-resume page's script, under torchrun: killed mid-run, it resumes and ends the same.

The script and the command are read from docs/save-and-resume.md, so the page shows what runs
here. For each API, one run is left alone; another is killed (every worker at once, SIGKILL)
once a checkpoint is published, then started again: it resumes from a published
checkpoint and ends with the uninterrupted run's check value.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path
from typing import Final

import pytest
from commands import BackgroundCommand, run_command, wait_for_directory, workers_of
from pages import DOCS, code_blocks

pytestmark = pytest.mark.slow

PAGE: Final = DOCS / "save-and-resume.md"
#: Seconds for one torchrun command: 2 workers start, train 60 steps, save 12 checkpoints.
TIMEOUT: Final = 240.0
CHECK: Final = re.compile(r"trained 60 steps; check value -?\d+\.\d{8}")
#: Unbuffered, so a killed worker's output is all there; and a worker that dies of a fatal
#: signal (SIGABRT from native code) prints its Python stacks (faulthandler).
ENVIRONMENT: Final = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}


def _script(tmp_path: Path) -> Path:
    (source,) = re.findall(
        r'^```python title="train.py"\n(.*?)^```', PAGE.read_text(), flags=re.DOTALL | re.M
    )
    script = tmp_path / "train.py"
    script.write_text(source)
    return script


def _command(tmp_path: Path, api: str) -> tuple[list[str], Path]:
    """The page's torchrun command for ``api``, torchrun the venv's; and its checkpoints."""
    (line,) = (
        line
        for block in code_blocks(PAGE, "bash")
        for line in block.splitlines()
        if "torchrun" in line
    )
    tmp_path.mkdir()
    checkpoints = tmp_path / "checkpoints"
    words = line.replace("/tmp/checkpoints", str(checkpoints)).split()
    assert words[0] == "torchrun"
    arguments = [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    arguments[arguments.index("train.py")] = str(_script(tmp_path))
    if api == "replicate":
        arguments += ["--api", "replicate"]
    return arguments, checkpoints


def _check_value(output: str) -> str:
    (line,) = (line for line in output.splitlines() if line.startswith("trained "))
    assert CHECK.fullmatch(line), line
    return line


@pytest.mark.parametrize("api", ["fully_shard", "replicate"])
def test_a_killed_run_resumes_and_ends_as_the_uninterrupted_one(api: str, tmp_path: Path) -> None:
    arguments, _ = _command(tmp_path / "uninterrupted", api)
    done = run_command(arguments, timeout=TIMEOUT, env=ENVIRONMENT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming" not in done.stdout
    expected = _check_value(done.stdout)

    arguments, checkpoints = _command(tmp_path / "killed", api)
    with BackgroundCommand(arguments, output=tmp_path / "killed", env=ENVIRONMENT) as killed:
        wait_for_directory(checkpoints / "step-000010", killed, TIMEOUT)
        workers = list(workers_of(killed.process.pid).values())
        assert len(workers) == 2
        for worker in workers:  # every worker at once, as when the job's machine goes down
            os.kill(worker, signal.SIGKILL)
        stopped = killed.wait(TIMEOUT)
    assert stopped.returncode != 0  # no --max-restarts: the agent gives up
    published = sorted(path.name for path in checkpoints.glob("step-*[0-9]"))
    assert "step-000060" not in published  # it was killed before the end

    resumed = run_command(arguments, timeout=TIMEOUT, env=ENVIRONMENT)
    assert resumed.returncode == 0, resumed.stderr[-12000:]
    assert f"resuming from {published[-1]}" in resumed.stdout
    assert _check_value(resumed.stdout) == expected


def test_the_page_says_numpy_is_needed() -> None:
    page = PAGE.read_text()
    assert "pip install numpy" in page
    assert "torch.distributed.checkpoint` needs numpy" in page
