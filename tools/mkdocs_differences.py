"""mkdocs hook: a page's ``<!-- differences: fully_shard -->`` marker becomes its table.

The tables come from ``tests/differences.py``, the one source of every difference from
FSDP2 and DDP and of each feature's minimum torch, which ``tests/test_differences.py``
checks against the code. A marker the source does not know fails the build.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from differences import render

#: A marker on a line of its own, e.g. ``<!-- keywords: replicate -->``.
MARKER = re.compile(r"^<!-- ((?:differences|keywords): \w+|minimum torch) -->$", re.M)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """``markdown`` with each marker replaced by the table it names."""
    return MARKER.sub(lambda match: render(match.group(1)), markdown)
