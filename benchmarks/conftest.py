"""Collect ``bench_*.py`` here, and only here: ``make test`` runs pytest over tests/ alone."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

# The benchmark tensors are tiny: a second intra-op thread only adds spin-waiting,
# which on a shared machine swamps the forward+backward benchmark.
torch.set_num_threads(1)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    """Collect every ``bench_*.py`` file under benchmarks/ as a test module.

    A file named on the command line is collected by pytest itself already.
    """
    if (
        file_path.suffix == ".py"
        and file_path.name.startswith("bench_")
        and not parent.session.isinitpath(file_path)
    ):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_benchmark_update_machine_info(
    config: pytest.Config, machine_info: dict[str, Any]
) -> None:
    """Record the cores and the load when the run started: the tables say what they ran on."""
    machine_info["cpu_count"] = os.cpu_count()
    machine_info["load_average"] = list(os.getloadavg())
