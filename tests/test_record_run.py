"""`tools/record_run.py` writes what a pytest run counted, for the documentation to include."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from commands import run_command
from pages import ROOT


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
    spec = importlib.util.spec_from_file_location("record_run", ROOT / "tools" / "record_run.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sentence: str = module.summary(report)
    assert "2 passed, 1 failed, 0 errors, 1 skipped" in sentence
    assert sentence.startswith("Written by the last run on ")
    assert " cores, load average " in sentence
