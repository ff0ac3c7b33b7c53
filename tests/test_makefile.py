"""`make help` lists every target of the Makefile, each with its one line."""

from __future__ import annotations

import re

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
