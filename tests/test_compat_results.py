"""`make compat`'s results: what tools/compat_results.py writes, and the page that includes it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "generated" / "compat"

LOG = """\
........s.....F
=========================== short test summary info ============================
SKIPPED [5] tests/distributed/test_a.py:40: needs torch's own fully_shard on CPU
SKIPPED [2] tests/distributed/test_b.py:12: needs torch's own fully_shard on CPU
SKIPPED [1] tests/test_c.py:7: needs a GPU
FAILED tests/test_d.py::test_x - AssertionError
1 failed, 1,204 passed, 8 skipped, 1 error in 301.52s (0:05:01)
"""


def test_a_log_becomes_a_table_row_and_the_skip_reasons_with_counts(tmp_path: Path) -> None:
    log = tmp_path / "torch.log"
    log.write_text(LOG.replace("1,204", "1204"))
    script = ROOT / "tools" / "compat_results.py"
    subprocess.run([sys.executable, script, "9.9.9", log, "1", tmp_path], check=True)
    row = (tmp_path / "torch-9.9.9.md").read_text()
    date, machine = r"\d{4}-\d\d-\d\d", r"\d+ cores, load [\d.]+"
    assert re.fullmatch(
        rf"\| 9\.9\.9 \| {date} \| [0-9a-f]+ \| 1,204 \| 8 \| 2 \(exit 1\) \| {machine} \|\n", row
    )
    assert (tmp_path / "torch-9.9.9-skips.md").read_text() == (
        "- 7: needs torch's own fully_shard on CPU\n- 1: needs a GPU\n"
    )


def test_the_table_holds_every_release_row_oldest_first(tmp_path: Path) -> None:
    log = tmp_path / "torch.log"
    log.write_text(LOG)
    script = ROOT / "tools" / "compat_results.py"
    for version in ("2.14.1", "2.6.0"):
        subprocess.run([sys.executable, script, version, log, "0", tmp_path], check=True)
    lines = (tmp_path / "table.md").read_text().splitlines()
    assert lines[0].startswith("| torch | date | commit |")
    assert [line.split()[1] for line in lines[2:]] == ["2.6.0", "2.14.1"]


def test_the_supported_versions_page_includes_every_release_compat_runs() -> None:
    """Each default release of tools/compat.sh has its row and skips on the page, and files."""
    script = (ROOT / "tools" / "compat.sh").read_text()
    match = re.search(r'COMPAT_TORCH:-"([^"]+)"', script)
    assert match is not None
    page = (ROOT / "docs" / "supported-versions.md").read_text()
    for version in match.group(1).split():
        assert f'--8<-- "docs/generated/compat/torch-{version}-skips.md"' in page
        assert (RESULTS / f"torch-{version}-skips.md").is_file()
        row = (RESULTS / f"torch-{version}.md").read_text()
        assert row.startswith(f"| {version} | ")
        assert row.count("\n") == 1
        assert row in (RESULTS / "table.md").read_text()
    # One include for the whole table: rows from two includes would not stay one table.
    assert page.count('--8<-- "docs/generated/compat/table.md"') == 1
    assert not re.search(r'--8<-- "docs/generated/compat/torch-[\d.]+\.md"', page)
