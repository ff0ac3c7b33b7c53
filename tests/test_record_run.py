"""`tools/record_run.py` writes what a pytest run counted, for the documentation to include."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType

from commands import run_command
from pages import ROOT


def _load() -> ModuleType:
    """tools/record_run.py, imported from its file (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("record_run", ROOT / "tools" / "record_run.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sentence_counts_what_the_junit_report_holds(tmp_path: Path) -> None:
    tests = tmp_path / "test_sample.py"
    tests.write_text(
        "import pytest\n"
        "def test_one(): pass\n"
        "def test_two(): pass\n"
        "def test_three(): assert False\n"
        "@pytest.mark.skip(reason='shown')\n"
        "def test_four(): pass\n"
    )
    report = tmp_path / "report.xml"
    command = (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=")
    run_command([*command, f"--junitxml={report}", str(tests)], timeout=120, cwd=tmp_path)
    sentence: str = _load().summary(report)
    assert "2 passed, 1 failed, 0 errors, 1 skipped" in sentence
    assert sentence.startswith("Written by the last run on ")
    assert " cores, load average " in sentence


def test_with_a_start_time_the_sentence_gives_the_whole_command_and_its_pytest_part(
    tmp_path: Path,
) -> None:
    report = tmp_path / "report.xml"
    report.write_text(
        '<testsuites><testsuite tests="3" failures="0" errors="0" skipped="1" '
        'time="120.0"></testsuite></testsuites>'
    )
    sentence: str = _load().summary(report, time.time() - 600)
    assert "2 passed, 0 failed, 0 errors, 1 skipped" in sentence
    assert sentence.endswith(" minutes in all, 2.0 of them in pytest.")


def test_a_fresh_clones_sentence_says_its_time_includes_creating_the_venv(tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    report.write_text('<testsuite tests="1" failures="0" errors="0" skipped="0" time="60.0"/>')
    sentence: str = _load().summary(report, time.time() - 300, fresh=True)
    assert sentence.endswith(
        " minutes in all (on a fresh clone: creating .venv and installing included), "
        "1.0 of them in pytest."
    )


def test_the_readme_region_between_its_markers_is_replaced_and_nothing_else() -> None:
    module = _load()
    start, end = module.README_START, module.README_END
    text = f"before\n{start}\nold line\n{end}\nafter\n"
    assert module.replace_region(text, "new line") == f"before\n{start}\nnew line\n{end}\nafter\n"
    assert module.replace_region("no markers\n", "new line") == "no markers\n"


def test_the_readme_holds_the_markers_make_test_writes_between() -> None:
    module = _load()
    text = (ROOT / "README.md").read_text()
    assert text.index(module.README_START) < text.index(module.README_END)
