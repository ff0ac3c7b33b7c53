"""The tests' command runner stops a hanging command, grandchildren holding its output included."""

from __future__ import annotations

import sys
import time

import pytest
from commands import GRACE_SECONDS, run_command

# A child that starts a grandchild sharing its output pipes, then hangs: what a rank
# left behind by a killed launcher looks like. subprocess.run(timeout=1) waits for
# the grandchild to close the pipes, a minute here (for ever with a hung rank).
HANGS_WITH_A_GRANDCHILD = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print('started', flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_hanging_command_fails_the_test_in_time_with_its_output() -> None:
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"did not finish within 1 s") as failure:
        run_command([sys.executable, "-c", HANGS_WITH_A_GRANDCHILD], timeout=1)
    assert time.monotonic() - started < 1 + GRACE_SECONDS
    assert "started" in str(failure.value)


def test_a_finished_command_gives_its_code_and_output() -> None:
    script = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    done = run_command([sys.executable, "-c", script], timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
