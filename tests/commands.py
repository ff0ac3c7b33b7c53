"""Running commands from tests: a command that hangs is stopped, grandchildren included."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

#: How long a command has to exit after SIGTERM before its process group gets SIGKILL.
GRACE_SECONDS = 10.0


def run_command(
    command: Sequence[str | Path],
    *,
    timeout: float,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in a session of its own; fail the test if it outlives ``timeout``.

    ``subprocess.run(timeout=...)`` kills only the child, then waits for its output
    pipes, which a grandchild still holds (a rank under ``torchrun``): the test hangs.
    Here the whole process group gets SIGTERM (``torchrun`` passes it on to its
    workers), then SIGKILL after a grace period, and the test fails with the output.
    """
    arguments = [str(part) for part in command]
    with subprocess.Popen(
        arguments,
        cwd=cwd,
        env=None if env is None else dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stdout, stderr = _stop(process)
            pytest.fail(
                f"{' '.join(arguments[:4])} did not finish within {timeout:g} s and was "
                f"stopped:\n{stdout[-3000:]}\n{stderr[-3000:]}"
            )
    return subprocess.CompletedProcess(arguments, process.returncode, stdout, stderr)


def _stop(process: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGTERM, then SIGKILL, to the process group of ``process``; what it wrote."""
    for sent in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):  # the group is gone already
            os.killpg(process.pid, sent)
        try:
            return process.communicate(timeout=GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            continue
    return "", "(no output: the command's pipes stayed open after SIGKILL)"
