"""The README and the documentation pages run as written, and the site is complete.

Every Python block of a page runs (the page's blocks in order, as one script); every
``text`` block of a page shows what its code prints. Every public name has an entry
in the API reference; every test the guarantees table names exists; the site builds
with ``mkdocs build --strict`` and asks the network for nothing.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import tomllib
import types
from pathlib import Path

import pytest
from commands import run_command
from pages import DOCS, ROOT, code_blocks, pages, run_page

import torchcontract
import torchcontract.apis
import torchcontract.testing

#: What a page prints, beyond its ``text`` blocks: the messages its examples show.
PRINTS: dict[str, tuple[str, ...]] = {
    "README.md": (
        "__main__.scale is already applied to Linear",
        "only after: ['extra']",
    ),
    "docs/writing-an-api.md": (
        "__main__.shard cannot be combined with __main__.offload",
        "__main__.needs_linear: Sequential is not an nn.Linear",
    ),
    "docs/getting-started.md": (
        "__main__.scale is already applied to Linear",
        "__main__.scale is not applied to Linear",
        "only after: ['extra']",
        "__main__.shard cannot be combined with __main__.offload",
    ),
}

RUNNABLE = [page for page in pages() if code_blocks(page, "python")]


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda page: str(page.relative_to(ROOT)))
def test_page_runs_as_written_and_prints_what_it_shows(page: Path) -> None:
    printed = run_page(page)
    for expected in PRINTS.get(str(page.relative_to(ROOT)), ()):
        assert expected in printed
    for shown in code_blocks(page, "text"):
        assert shown in printed


def test_the_pages_that_show_code_are_run() -> None:
    names = {str(page.relative_to(ROOT)) for page in RUNNABLE}
    assert set(PRINTS) <= names
    assert {
        "docs/getting-started.md",
        "docs/writing-an-api.md",
        "docs/replicate.md",
        "docs/checkpoint.md",
        "docs/fully-shard.md",
    } <= names


#: Where the README's links point: absolute, so they work where PyPI renders the README.
REPOSITORY = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]


def _readme_links() -> list[str]:
    """Every link target of the README, inline (``](...)``) or as a reference (``[x]: ...``)."""
    text = (ROOT / "README.md").read_text()
    inline = re.findall(r"\]\(([^)\s]+)\)", text)
    defined = re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, flags=re.M)
    return inline + defined


def test_the_readme_links_into_the_site_with_absolute_links() -> None:
    links = _readme_links()
    assert [link for link in links if not link.startswith("https://")] == []
    prefix = f"{REPOSITORY}/blob/main/"
    files = [link.removeprefix(prefix).split("#")[0] for link in links if link.startswith(prefix)]
    assert "docs/getting-started.md" in files
    assert "docs/reference/torchcontract.md" in files
    assert "LICENSE" in files
    assert [name for name in files if not (ROOT / name).is_file()] == []


def _reference_entries() -> dict[str, object]:
    """The objects the API reference documents, by the path each ``:::`` entry names."""
    text = "\n".join(page.read_text() for page in sorted((DOCS / "reference").glob("*.md")))
    entries: dict[str, object] = {}
    for path in re.findall(r"^::: (\S+)$", text, flags=re.M):
        module, _, name = path.rpartition(".")
        entries[path] = getattr(importlib.import_module(module), name)
    return entries


#: The packages whose ``__all__`` is public (``torchcontract.apis.fully_shard`` is also
#: the name of the API, so the packages of the APIs are imported by name).
PUBLIC_MODULES = [
    torchcontract,
    torchcontract.apis,
    torchcontract.testing,
    importlib.import_module("torchcontract.apis.fully_shard"),
    importlib.import_module("torchcontract.apis.replicate"),
]


@pytest.mark.parametrize("module", PUBLIC_MODULES, ids=lambda module: module.__name__)
def test_every_public_name_has_a_reference_entry(module: types.ModuleType) -> None:
    # An entry may name the object where it is defined (``torchcontract.apis.replicate``
    # is also a package, so its entry is ``torchcontract.apis.replicate.replicate``).
    documented = {id(value) for value in _reference_entries().values()}
    names: list[str] = module.__all__
    missing = [name for name in names if id(getattr(module, name)) not in documented]
    assert not missing, f"add ::: {module.__name__}.<name> to docs/reference/ for {missing}"


def test_reference_entries_are_public_names() -> None:
    public = {id(getattr(module, name)) for module in PUBLIC_MODULES for name in module.__all__}
    assert [path for path, value in _reference_entries().items() if id(value) not in public] == []


def test_every_test_the_guarantees_table_names_exists() -> None:
    page = (DOCS / "semantics.md").read_text()
    table = page[page.index("## Guarantees") : page.index("## What is not promised")]
    named = set(re.findall(r"`(test_\w+)`", table)) - {"test_docs"}
    files = set(re.findall(r"`((?:\w+/)?test_\w+\.py|typing/\w+\.py)`", table))
    sources = "\n".join(path.read_text() for path in (ROOT / "tests").rglob("*.py"))
    assert named, "the guarantees table names no test"
    missing = sorted(name for name in named if f"def {name}(" not in sources)
    assert not missing
    assert not [name for name in files if not (ROOT / "tests" / name).is_file()]


def test_site_builds_strictly_and_fetches_nothing(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = run_command(
        (sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)),
        timeout=240,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WARNING" not in done.stderr
    # What a browser fetches on its own (links a reader may follow are fine): scripts,
    # style sheets, fonts, images, frames, and what CSS imports.
    remote = re.compile(
        r"""<(?:link|script|img|iframe|source)\b[^>]*\b(?:src|href)=["'](?:https?:)?//"""
        r"""|@import\s+(?:url\()?["']?(?:https?:)?//|url\(["']?(?:https?:)?//"""
    )
    fetched = [
        str(path.relative_to(site))
        for path in site.rglob("*")
        if path.suffix in {".html", ".css"} and remote.search(path.read_text())
    ]
    assert not fetched, f"pages that load something from the network: {fetched}"
