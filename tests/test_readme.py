"""The README's API tour runs as written, and prints what it says it prints."""

from __future__ import annotations

import contextlib
import io
import linecache
import re
import sys
import types
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_tour_runs_and_prints_the_documented_tree() -> None:
    tour = "\n".join(_blocks("python"))
    module = types.ModuleType("__main__")
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = module  # so pickling and names behave as in a script
    out = io.StringIO()
    # The tour is the README's code blocks joined: its line numbers are not the README's.
    # torch.compile reads a function's source through linecache, so give it the tour's.
    filename = f"<tour of {README}>"
    linecache.cache[filename] = (len(tour), None, tour.splitlines(keepends=True), filename)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(tour, filename, "exec"), module.__dict__)
    finally:
        sys.modules["__main__"] = saved
        linecache.cache.pop(filename, None)
    printed = out.getvalue()
    assert "__main__.scale is already applied to Linear" in printed
    assert "__main__.scale is not applied to Linear" in printed
    assert "only after: ['extra']" in printed
    assert "__main__.shard cannot be combined with __main__.offload" in printed
    tree = _blocks("text")[0]
    assert tree in printed
