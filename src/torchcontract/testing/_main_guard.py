"""Refuse a ``run_distributed`` call that each rank would make again: a script's unguarded one.

Ranks start by forkserver or spawn, and multiprocessing has each of them import the
script the program was started with again (as ``__mp_main__``) before it runs anything.
A call to ``run_distributed`` that importing the script reaches (one not under
``if __name__ == "__main__":``) would start ranks from a rank still starting: every
rank dies of multiprocessing's ``RuntimeError`` about its bootstrapping phase, and the
caller gets a ``RankFailedError`` saying only that the ranks exited. So the caller's
script is read first, and such a call refused before any rank starts.
"""

from __future__ import annotations

import ast
import os
import sys
import tokenize
import types

__all__ = ["UnguardedMainError", "check_main_guard"]


class UnguardedMainError(RuntimeError):
    """``run_distributed`` was called from a script outside ``if __name__ == "__main__":``.

    Each rank imports the script again as it starts (forkserver and spawn do), so the
    call must not run on import. Put it, or the call of the function making it, under
    ``if __name__ == "__main__":``, or call it from a test module.
    """


UnguardedMainError.__module__ = "torchcontract.testing"


def check_main_guard(start_method: str) -> None:
    """Raise ``UnguardedMainError`` if importing the main script again reaches this call.

    Only a main module that multiprocessing imports again in each rank is read: a
    script run by path or ``python -m package.module`` (not ``python -c``, an
    interactive session, or a package's ``__main__``). A script whose source cannot be
    read passes.
    """
    main = sys.modules.get("__main__")
    path = _reimported_path(main)
    if main is None or path is None:
        return
    frame = _top_level_frame(main)
    if frame is None:  # not called while the script's own code runs: a thread, atexit
        return
    line = frame.f_lineno
    try:
        with tokenize.open(path) as source:
            tree = ast.parse(source.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return
    if line is None or _guarded(tree, line):
        return
    raise UnguardedMainError(
        f"run_distributed: called from the top level of the script {path} (line {line}), "
        f'outside `if __name__ == "__main__":`; each rank ({start_method!r} start) imports '
        "the script again and would call run_distributed again. Put the call (or the call "
        'of the function that makes it) under `if __name__ == "__main__":`'
    )


def _reimported_path(main: types.ModuleType | None) -> str | None:
    """The file of the main module if each rank imports it again, as multiprocessing decides.

    As ``multiprocessing.spawn``: by module name under ``python -m`` (not a package's
    ``__main__``), else by the script's path (not IPython's launcher).
    """
    if main is None:
        return None
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None)
    if name is not None:
        if name == "__main__" or name.endswith(".__main__"):
            return None
        origin = getattr(spec, "origin", None)
        return origin if isinstance(origin, str) else None
    path = getattr(main, "__file__", None)
    if not isinstance(path, str) or os.path.splitext(os.path.basename(path))[0] == "ipython":
        return None
    return path


def _top_level_frame(main: types.ModuleType) -> types.FrameType | None:
    """The frame running the main module's own top-level code, if this call came from it."""
    frame: types.FrameType | None = sys._getframe(1)
    namespace = vars(main)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is namespace:
            return frame
        frame = frame.f_back
    return None


def _guarded(tree: ast.Module, line: int) -> bool:
    """Whether ``line`` is in the body of an ``if`` that tests ``__name__``."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        first, last = node.body[0].lineno, node.body[-1].end_lineno or node.body[-1].lineno
        tests_name = any(
            isinstance(part, ast.Name) and part.id == "__name__" for part in ast.walk(node.test)
        )
        if tests_name and first <= line <= last:
            return True
    return False
