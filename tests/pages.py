"""The README and the documentation pages as the tests read them: code blocks, and running them.

One runner for every page: a page's Python blocks, joined in order, run as one script
in a fresh ``__main__`` (so pickling and qualified names behave as in a script), and
what they print is returned.
"""

from __future__ import annotations

import contextlib
import io
import linecache
import os
import re
import sys
import types
from pathlib import Path

import torch.distributed as dist
from commands import run_command

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def pages() -> list[Path]:
    """The README, then every page of the documentation site (not what commands write there)."""
    return [README, *sorted(path for path in DOCS.rglob("*.md") if "generated" not in path.parts)]


def code_blocks(page: Path, language: str) -> list[str]:
    """The blocks of ``page`` fenced as ``language`` (```` ```python ````), in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", page.read_text(), flags=re.DOTALL | re.M)


def run_page(page: Path) -> str:
    """Run the Python blocks of ``page`` as one script; return what it printed.

    A page that starts a process group and fails before taking it down leaves none
    behind for the next page.
    """
    script = "\n".join(code_blocks(page, "python"))
    module = types.ModuleType("__main__")
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = module
    out = io.StringIO()
    # The script is the page's blocks joined: its line numbers are not the page's.
    # torch.compile reads a function's source through linecache, so give it the script's;
    # it stays there, so that a failure's traceback shows the line.
    filename = f"<code of {page.relative_to(ROOT)}>"
    linecache.cache[filename] = (len(script), None, script.splitlines(keepends=True), filename)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(script, filename, "exec"), module.__dict__)
    finally:
        sys.modules["__main__"] = saved
        if dist.is_initialized():
            dist.destroy_process_group()
    return out.getvalue()


def run_shown_torchrun(page: Path, script: str, *, timeout: float) -> list[float]:
    """Run the one ``torchrun`` command of ``page`` that names ``script``, as the page shows it
    (from the repository's root); return the losses it printed. Fails the test if the page
    shows no such command or several, or the command fails."""
    shown = [block for block in code_blocks(page, "bash") if script in block]
    assert len(shown) == 1, f"{page.name} shows {len(shown)} commands running {script}"
    program, *arguments = shown[0].split()
    assert program == "torchrun"
    done = run_command(
        [sys.executable, "-m", "torch.distributed.run", *arguments],
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [float(line.split()[-1]) for line in done.stdout.splitlines() if "loss" in line]
