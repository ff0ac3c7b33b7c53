"""The timeouts the guides give (troubleshooting, running on GPUs) are torch's.

gloo's default and message are checked by running one; NCCL's default is read from the
header torch ships (its watchdog cannot run on the CPU).
"""

from __future__ import annotations

import datetime
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from pages import DOCS
from torch.distributed import constants

from torchcontract.testing import run_distributed

#: The two pages that give the defaults, and the words each must hold.
PAGES = (DOCS / "troubleshooting.md", DOCS / "running-on-gpus.md")


def _nccl_default_minutes() -> int:
    header = (
        Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"
    ).read_text()
    found = re.search(
        r"kProcessGroupNCCLDefaultTimeout =\s*std::chrono::milliseconds\((\d+) \* 60 \* 1000\)",
        header,
    )
    assert found is not None
    return int(found[1])


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_the_page_gives_gloos_and_nccls_defaults(page: Path) -> None:
    text = page.read_text().replace("\n", " ")
    gloo = int(constants.default_pg_timeout / datetime.timedelta(minutes=1))
    assert gloo == 30
    assert re.search(rf"gloo[^.]*\b{gloo} minutes", text, flags=re.I)
    assert re.search(rf"NCCL[^.]*\b{_nccl_default_minutes()} minutes", text)


def _timed_out(rank: int, world: int) -> str:
    group = dist.new_group(timeout=datetime.timedelta(seconds=1))
    if rank == 1:  # never joins the collective
        time.sleep(3)
        return ""
    try:
        dist.all_reduce(torch.ones(1), group=group)
    except RuntimeError as error:
        return str(error)
    return "no timeout"


def test_a_gloo_timeout_says_what_the_pages_quote() -> None:
    message = run_distributed(_timed_out, 2, timeout=60)[0]
    assert re.search(r"Timed out waiting 1000ms for recv operation to complete", message)
    for page in PAGES:
        text = " ".join(page.read_text().split())
        assert "Timed out waiting 1800000ms for recv operation to complete" in text
