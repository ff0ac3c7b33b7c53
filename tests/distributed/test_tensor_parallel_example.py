"""The tensor-parallel example docs/fully-shard.md shows runs as the page shows it.

``examples/tensor_parallel.py`` under ``torchrun``, 4 gloo processes on 127.0.0.1: the
placements it asserts hold on every rank and its loss goes down.
"""

from __future__ import annotations

import pytest
from pages import DOCS, run_shown_torchrun


@pytest.mark.slow
def test_the_pages_tensor_parallel_example_trains() -> None:
    losses = run_shown_torchrun(
        DOCS / "fully-shard.md", "examples/tensor_parallel.py", timeout=240.0
    )
    assert len(losses) == 3
    assert losses[-1] < losses[0]
