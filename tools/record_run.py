"""Write what a pytest run counted to docs/generated/<name>.md, for the pages to include.

    python tools/record_run.py fuzz .fuzz.xml

reads pytest's JUnit XML report (``--junitxml``) and writes one sentence: when, on
which torch and how many cores under what load, how many tests passed, failed, errored
and were skipped, and how long the run took. The documentation includes the file
(pymdownx.snippets), so no count there is written by hand.
"""

from __future__ import annotations

import os
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from xml.etree import ElementTree

GENERATED = Path(__file__).resolve().parent.parent / "docs" / "generated"


def summary(report: Path) -> str:
    """The sentence for the run in ``report``."""
    suite = ElementTree.parse(report).getroot()
    if suite.tag == "testsuites":
        suite = suite[0]
    total, failed, errors, skipped = (
        int(suite.get(key, "0")) for key in ("tests", "failures", "errors", "skipped")
    )
    passed = total - failed - errors - skipped
    load = " / ".join(f"{value:.1f}" for value in os.getloadavg())
    return (
        f"Written by the last run on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, torch "
        f"{metadata.version('torch')}, {os.cpu_count()} cores, load average {load} "
        f"(1 / 5 / 15 min) at the end: {passed:,} passed, {failed:,} failed, {errors:,} "
        f"errors, {skipped:,} skipped, in {float(suite.get('time', '0')) / 60:.1f} minutes."
    )


def main(argv: list[str]) -> None:
    """``argv``: the name of the file to write and the JUnit XML report to read."""
    name, report = argv
    GENERATED.mkdir(exist_ok=True)
    (GENERATED / f"{name}.md").write_text(summary(Path(report)) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
