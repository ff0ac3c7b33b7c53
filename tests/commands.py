"""Running commands from tests: a command that hangs is stopped, grandchildren included."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
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
            stdout, stderr = process.communicate(timeout=GRACE_SECONDS)
            return stdout or "", stderr or ""
        except subprocess.TimeoutExpired:
            continue
    return "", "(no output: the command's pipes stayed open after SIGKILL)"


class BackgroundCommand:
    """A command started in a session of its own, its output written to files.

    For commands that run side by side, or that a test acts on while they run. Used
    as a context manager: on exit, a command still running is stopped as
    ``run_command`` stops one (its whole process group), so nothing outlives the test.
    """

    def __init__(
        self, command: Sequence[str | Path], *, output: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.arguments = [str(part) for part in command]
        self._stdout = output.with_suffix(".out")
        self._stderr = output.with_suffix(".err")
        with self._stdout.open("w") as stdout, self._stderr.open("w") as stderr:
            self.process = subprocess.Popen(
                self.arguments,
                env=None if env is None else dict(env),
                stdout=stdout,
                stderr=stderr,
                text=True,
                start_new_session=True,
            )

    def __enter__(self) -> BackgroundCommand:
        return self

    def __exit__(self, *exception: object) -> None:
        if self.process.poll() is None:
            _stop(self.process)

    def output(self) -> tuple[str, str]:
        """What the command wrote so far: stdout and stderr."""
        return self._stdout.read_text(), self._stderr.read_text()

    def wait(self, timeout: float) -> subprocess.CompletedProcess[str]:
        """Wait for the command to exit; stop it and fail the test if it outlives ``timeout``."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(self.process)
            stdout, stderr = self.output()
            pytest.fail(
                f"{' '.join(self.arguments[:4])} did not finish within {timeout:g} s and was "
                f"stopped:\n{stdout[-3000:]}\n{stderr[-3000:]}"
            )
        stdout, stderr = self.output()
        return subprocess.CompletedProcess(self.arguments, self.process.returncode, stdout, stderr)


def workers_of(agent: int) -> dict[int, int]:
    """The processes ``agent`` (a ``torchrun``) started: pid by ``LOCAL_RANK``."""
    workers: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "stat").read_text()
            environment = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours
            continue
        parent = int(status.rsplit(")", 1)[1].split()[1])
        if parent != agent:
            continue
        for variable in environment:
            if variable.startswith(b"LOCAL_RANK="):
                workers[int(variable.split(b"=", 1)[1])] = int(entry.name)
    return workers


def wait_for_directory(path: Path, command: BackgroundCommand, timeout: float) -> None:
    """Return once ``path`` is a directory; fail the test, with the command's output, if
    the command exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not path.is_dir():
        if command.process.poll() is not None or time.monotonic() > deadline:
            stdout, stderr = command.output()
            pytest.fail(f"{path.name} never appeared:\n{stdout[-3000:]}\n{stderr[-3000:]}")
        time.sleep(0.05)
