"""Write one torch release's `make compat` result where docs/supported-versions.md includes it.

Usage: ``python tools/compat_results.py VERSION LOG EXIT_CODE DIRECTORY``. Reads pytest's
log (run with ``-ra``, as pyproject.toml sets) and writes ``torch-VERSION.md``, one table
row (release, date, commit, passed, skipped, failed, the machine's cores and load), and
``torch-VERSION-skips.md``, each distinct skip reason with its count, most frequent first.
Then writes ``table.md``, the whole table of every release's last row (the page includes
that one file: a table whose rows came from several includes would end at the first).
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

_COUNT = re.compile(r"(\d+) (passed|skipped|failed|errors?|deselected)")
_SKIPPED = re.compile(r"^SKIPPED \[(\d+)\] [^:]+:\d+: (.*)$")


def counts(log: str) -> dict[str, int]:
    """passed, skipped and failed (errors counted as failures) from pytest's last line."""
    summary = [line for line in log.splitlines() if re.search(r" in [\d.]+s", line)]
    found = {"passed": 0, "skipped": 0, "failed": 0}
    for number, kind in _COUNT.findall(summary[-1] if summary else ""):
        key = "failed" if kind.startswith("error") else kind
        if key in found:
            found[key] += int(number)
    return found


def skip_reasons(log: str) -> Counter[str]:
    reasons: Counter[str] = Counter()
    for line in log.splitlines():
        match = _SKIPPED.match(line)
        if match:
            reasons[match.group(2).strip()] += int(match.group(1))
    return reasons


#: The header of the table every release's row goes in.
HEADER = (
    "| torch | date | commit | passed | skipped | failed | machine |\n"
    "|---|---|---|---:|---:|---:|---|\n"
)


def release(path: Path) -> tuple[int, ...]:
    """The release a row file is for, as numbers (``torch-2.14.1.md``: 2, 14, 1)."""
    return tuple(int(part) for part in path.stem.removeprefix("torch-").split("."))


def write_table(directory: Path) -> None:
    """``table.md``: the header, then each release's row, oldest release first."""
    rows = sorted(directory.glob("torch-*[0-9].md"), key=release)
    (directory / "table.md").write_text(HEADER + "".join(row.read_text() for row in rows))


def main(version: str, log_path: str, code: str, directory: str) -> None:
    log = Path(log_path).read_text(errors="replace")
    found = counts(log)
    load = os.getloadavg()[0]
    note = "" if code == "0" else f" (exit {code})"
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    row = (
        f"| {version} | {datetime.date.today().isoformat()} | {commit or 'unknown'} | "
        f"{found['passed']:,} | "
        f"{found['skipped']:,} | {found['failed']:,}{note} | {os.cpu_count()} cores, "
        f"load {load:.1f} |\n"
    )
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"torch-{version}.md").write_text(row)
    reasons = skip_reasons(log)
    lines = [f"- {count:,}: {reason}\n" for reason, count in reasons.most_common()]
    (out / f"torch-{version}-skips.md").write_text("".join(lines) or "- none\n")
    write_table(out)


if __name__ == "__main__":
    main(*sys.argv[1:5])
