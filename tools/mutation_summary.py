"""Summarize the last `make mutate` run: killed, survived and timed out, per module.

Reads the result files mutmut leaves next to each mutated module under mutants/,
prints a Markdown table (what "Mutation testing" in docs/development.md holds) and
then every mutant that was not killed, by name, for tests/mutation/survivors.md.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from mutmut.stats import status_by_exit_code

MUTANTS = Path("mutants/src/torchcontract")
MODULES = ("_store.py", "_transaction.py", "_contract.py", "_fqn.py", "_registry.py")


def main() -> int:
    rows: list[tuple[str, Counter[str]]] = []
    others: list[tuple[str, str]] = []
    for module in MODULES:
        meta = MUTANTS / f"{module}.meta"
        if not meta.exists():
            print(f"{meta} is missing: run `make mutate` first", file=sys.stderr)
            return 1
        codes: dict[str, int | None] = json.loads(meta.read_text())["exit_code_by_key"]
        statuses = Counter(status_by_exit_code[code] for code in codes.values())
        rows.append((module, statuses))
        others += [
            (name, status_by_exit_code[code])
            for name, code in sorted(codes.items())
            if status_by_exit_code[code] not in ("killed", "not checked")
        ]
    total: Counter[str] = Counter()
    print("| module | mutants | checked | killed | survived | timed out | killed % of checked |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for module, statuses in [*rows, ("all", total)]:
        if module != "all":
            total.update(statuses)
        killed, survived, timeout = (statuses[s] for s in ("killed", "survived", "timeout"))
        checked = killed + survived + timeout
        score = f"{100 * killed / checked:.1f}" if checked else "-"
        print(
            f"| `{module}` | {sum(statuses.values())} | {checked} | {killed} | {survived} "
            f"| {timeout} | {score} |"
        )
    print()
    for name, status in others:
        print(f"{status}: {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
