"""`make help` lists every target of the Makefile, each with its one line."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from commands import run_command
from pages import ROOT


def _targets() -> list[str]:
    """The Makefile's own targets (not the venv's stamp file), in order."""
    text = (ROOT / "Makefile").read_text()
    return re.findall(r"^([a-z][a-z-]*):", text, flags=re.M)


def test_make_help_lists_every_target_with_a_line() -> None:
    done = run_command(("make", "--no-print-directory", "help"), timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    listed = dict(re.findall(r"^  make (\S+) +(\S.*)$", done.stdout, flags=re.M))
    targets = _targets()
    assert {"help", "test", "docs-serve", "test-gpu", "mutate-apis"} <= set(targets)
    assert list(listed) == targets


def test_every_target_is_phony() -> None:
    text = (ROOT / "Makefile").read_text()
    declared = re.search(r"^\.PHONY:((?:.*\\\n)*.*)$", text, flags=re.M)
    assert declared is not None
    assert set(declared[1].replace("\\", " ").split()) == set(_targets())


def test_every_path_make_help_says_a_target_writes_exists() -> None:
    # `make compat` writes docs/generated/compat/, not a file next to it.
    done = run_command(("make", "--no-print-directory", "help"), timeout=60, cwd=ROOT)
    written = re.findall(r"writes ([\w./-]+/[\w./-]*)", done.stdout)
    assert "docs/generated/compat/" in written
    assert [path for path in written if not (ROOT / path).exists()] == []


def test_make_test_gpu_runs_every_gpu_marked_test_file() -> None:
    text = (ROOT / "Makefile").read_text()
    declared = re.search(r"^GPU_TESTS :=((?:.*\\\n)*.*)$", text, flags=re.M)
    assert declared is not None
    listed = set(declared[1].replace("\\", " ").split())
    marked = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"^\s*@?pytest\.mark\.gpu\b", path.read_text(), flags=re.M)
    }
    assert listed == marked


#: What a GPU machine lacks: every package the test extras install beside pytest.
_NOT_ON_A_GPU_MACHINE = (
    "hypothesis",
    "xdist",
    "pytest_timeout",
    "pytest_benchmark",
    "transformers",
    "torchft",
    "torchao",
)

# Each one None in sys.modules: importing it fails as a missing package's import does.
_BLOCKING_PYTHON = """\
import runpy, sys
sys.modules.update(dict.fromkeys({blocked!r}))
sys.argv = [sys.argv[0], *sys.argv[3:]]  # the arguments after "-m pytest"
runpy.run_module("pytest", run_name="__main__", alter_sys=True)
"""


def test_make_test_gpu_runs_where_only_torch_attrs_and_pytest_are(tmp_path: Path) -> None:
    """`make test-gpu` on a machine without the test extras: every file loads, and skips here."""
    bootstrap = tmp_path / "bootstrap.py"
    bootstrap.write_text(_BLOCKING_PYTHON.format(blocked=_NOT_ON_A_GPU_MACHINE))
    python = tmp_path / "python3"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {bootstrap} "$@"\n')
    python.chmod(0o755)
    done = run_command(
        ("make", "--no-print-directory", "test-gpu", f"TORCHCONTRACT_PYTHON={python}"),
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"\b\d+ skipped\b", done.stdout), done.stdout[-3000:]
    assert not re.search(r"\b\d+ errors?\b", done.stdout), done.stdout[-3000:]
