"""Write what a pytest run counted to docs/generated/<name>.md, for the pages to include.

    python tools/record_run.py fuzz .fuzz.xml
    python tools/record_run.py test .unit.xml --started 1764670000

reads pytest's JUnit XML report (``--junitxml``) and writes one sentence: when, on
which torch and how many cores under what load, how many tests passed, failed, errored
and were skipped, and how long the run took. The documentation includes the file
(pymdownx.snippets), so no count there is written by hand. With ``--started`` (the
Unix time a command began, as ``date +%s`` prints it) the sentence also gives the
whole command's time, and for ``test`` the README's own copy of the sentence, between
its markers, is replaced too (the README is read where nothing includes files). With
``--fresh`` too, the command began by creating ``.venv`` and installing into it (a fresh
clone), and the sentence says its time includes that.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "docs" / "generated"
README = ROOT / "README.md"
#: Where ``make test``'s sentence goes in the README: between these two lines.
README_START: str = "<!-- make test's last run: written by tools/record_run.py -->"
README_END: str = "<!-- end of make test's last run -->"


def summary(report: Path, started: float | None = None, *, fresh: bool = False) -> str:
    """The sentence for the run in ``report``; ``started``: when the whole command began;
    ``fresh``: it began by creating the venv."""
    suite = ElementTree.parse(report).getroot()
    if suite.tag == "testsuites":
        suite = suite[0]
    total, failed, errors, skipped = (
        int(suite.get(key, "0")) for key in ("tests", "failures", "errors", "skipped")
    )
    passed = total - failed - errors - skipped
    load = " / ".join(f"{value:.1f}" for value in os.getloadavg())
    pytest_minutes = float(suite.get("time", "0")) / 60
    took = f"in {pytest_minutes:.1f} minutes"
    if started is not None:
        took = (
            f"in {(time.time() - started) / 60:.1f} minutes in all"
            + (" (on a fresh clone: creating .venv and installing included)" if fresh else "")
            + f", {pytest_minutes:.1f} of them in pytest"
        )
    return (
        f"Written by the last run on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, torch "
        f"{metadata.version('torch')}, {os.cpu_count()} cores, load average {load} "
        f"(1 / 5 / 15 min) at the end: {passed:,} passed, {failed:,} failed, {errors:,} "
        f"errors, {skipped:,} skipped, {took}."
    )


def replace_region(text: str, sentence: str) -> str:
    """``text`` with the lines between the README's markers replaced by ``sentence``."""
    if README_START not in text or README_END not in text:
        return text
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    return f"{head}{README_START}\n{sentence}\n{README_END}{tail}"


def main(argv: list[str]) -> None:
    """``argv``: the name of the file to write, the JUnit XML report, optionally
    ``--started T``, then optionally ``--fresh``."""
    name, report, *rest = argv
    started = float(rest[1]) if rest[:1] == ["--started"] else None
    sentence = summary(Path(report), started, fresh=rest[2:] == ["--fresh"])
    GENERATED.mkdir(exist_ok=True)
    (GENERATED / f"{name}.md").write_text(sentence + "\n")
    if name == "test" and README.is_file():
        README.write_text(replace_region(README.read_text(), sentence))


if __name__ == "__main__":
    main(sys.argv[1:])
