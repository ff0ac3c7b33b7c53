"""A script that ends right after these APIs' gloo collectives exits cleanly, gloo starved.

The failure this guards against: gloo's thread frees a collective's tensor after the
script's last line, while the interpreter exits, and the process aborts ("terminate
called without an active exception"). It needs gloo's thread to run late, so here it
is made to: its threads run at the lowest priority, on the one core the script and a
busy loop share (the first this process may use). Through torch's own call the
script aborts in some of the runs; through ``_torch``, which returns once
gloo has let go (``_let_go``), it must never. Nor may it once a collective of these
APIs ran before torch's own calls: PyTorch's collectives (a checkpoint's, Join's)
still leave tensors to gloo's threads, and the exit grace these APIs register gives
them the GIL before the interpreter ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

from torchcontract.testing import free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses Linux scheduling"),
]

#: Runs through torchcontract, none of which may abort.
RUNS: Final = 12
#: At most this many runs through torch's own call, to see the harness reproduce the abort,
#: for at most this many seconds: each run starts torch on a core a busy loop shares, which
#: takes seconds, and many more where other work loads the machine.
CONTROL_RUNS: Final = 30
CONTROL_SECONDS: Final = 150.0

SCRIPT: Final = """
import os, sys, threading
import torch, torch.distributed as dist
from torchcontract.apis import _torch

os.sched_setaffinity(0, {int(sys.argv[3])})
dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
main = threading.get_native_id()
for thread in os.listdir("/proc/self/task"):  # gloo's threads, at the lowest priority
    if int(thread) != main:
        os.setpriority(os.PRIO_PROCESS, int(thread), 19)
group = dist.group.WORLD
for _ in range(20):
    gathered = torch.empty(10)
    if sys.argv[2] == "torchcontract":
        _torch.all_gather_into(gathered, torch.ones(10), group)
    else:
        if sys.argv[2] == "after torchcontract" and _ == 0:
            _torch.all_gather_into(gathered, torch.ones(10), group)
        dist.all_gather_into_tensor(gathered, torch.ones(10), group=group)
"""


#: The core the script and the busy loop share: the first this process may run on.
CORE: Final = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0


@pytest.fixture
def busy_core() -> Iterator[None]:
    """A busy loop on ``CORE`` for the test's length."""
    loop = subprocess.Popen(
        [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{CORE}}})\nwhile True: pass"]
    )
    try:
        yield
    finally:
        loop.kill()
        loop.wait()


def _exits_cleanly(script: Path, implementation: str) -> bool:
    done = subprocess.run(
        [sys.executable, str(script), f"tcp://127.0.0.1:{free_port()}", implementation, str(CORE)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        check=False,
    )
    if done.returncode != 0:
        assert "terminate called without an active exception" in done.stderr, done.stderr
    return done.returncode == 0


def _reproduces_the_abort(script: Path) -> bool:
    """Whether a run through torch's own call aborts, within the control runs' bounds."""
    deadline = time.monotonic() + CONTROL_SECONDS
    for _ in range(CONTROL_RUNS):
        if not _exits_cleanly(script, "torch"):
            return True
        if time.monotonic() > deadline:
            break
    return False


@pytest.mark.usefixtures("busy_core")
@pytest.mark.parametrize("implementation", ["torchcontract", "after torchcontract"])
@pytest.mark.timeout(600)  # the control runs' bound, then every one of ours, on a loaded machine
def test_a_script_ending_after_gloo_collectives_exits_cleanly(
    tmp_path: Path, implementation: str
) -> None:
    script = tmp_path / "end_after_gathers.py"
    script.write_text(SCRIPT)
    if not _reproduces_the_abort(script):
        pytest.skip("torch's own all-gather exited cleanly in every control run here")
    assert [_exits_cleanly(script, implementation) for _ in range(RUNS)] == [True] * RUNS
