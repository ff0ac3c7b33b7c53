"""The built documentation site: strict, offline, every table a table, links that work.

The site is built once for the module (``mkdocs build --strict`` into a temporary
directory, as ``make docs`` builds it) and every test reads the HTML it wrote.
"""

from __future__ import annotations

import html
import os
import re
import sys
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
from commands import run_command
from pages import DOCS, ROOT

#: Where the site keeps the scripts it serves itself, with their versions and licenses.
VENDOR = DOCS / "javascripts" / "vendor"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built strictly into a temporary directory; the build must warn of nothing."""
    built = tmp_path_factory.mktemp("site") / "site"
    done = run_command(
        (sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(built)),
        timeout=240,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WARNING" not in done.stderr
    return built


def _pages(site: Path) -> Iterator[Path]:
    return (page for page in sorted(site.rglob("*.html")))


class _Loads(HTMLParser):
    """What a browser fetches on its own while opening a page: scripts, style sheets,
    fonts, icons, images, frames and media (links a reader may follow are not)."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: list[str] = []
        self.diagrams = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag in {"script", "img", "iframe", "source", "video", "audio", "embed"}:
            self.loaded.append(attributes.get("src") or "")
        elif tag == "link" and attributes.get("rel") != "canonical":
            self.loaded.append(attributes.get("href") or "")
        elif tag == "object":
            self.loaded.append(attributes.get("data") or "")
        if "mermaid" in (attributes.get("class") or "").split():
            self.diagrams += 1


def _loads(page: Path) -> _Loads:
    parser = _Loads()
    parser.feed(page.read_text())
    return parser


REMOTE = re.compile(r"^(?:[a-z][a-z0-9+.-]*:)?//", re.I)
#: What CSS fetches: ``@import`` and ``url(...)`` of another host.
REMOTE_IN_CSS = re.compile(r"""@import\s+(?:url\()?["']?(?:https?:)?//|url\(["']?(?:https?:)?//""")


def test_no_page_loads_anything_from_the_network(site: Path) -> None:
    remote = {
        str(page.relative_to(site)): found
        for page in _pages(site)
        if (found := [url for url in _loads(page).loaded if REMOTE.match(url)])
    }
    assert remote == {}
    styles = [
        str(path.relative_to(site))
        for path in site.rglob("*.css")
        if REMOTE_IN_CSS.search(path.read_text())
    ]
    assert styles == []


def test_no_web_fonts_are_asked_for() -> None:
    # mkdocs-material links Google Fonts unless the theme's font is false.
    config = (ROOT / "mkdocs.yml").read_text()
    theme = config[config.index("\ntheme:") : config.index("\nnav:")]
    assert re.search(r"^  font: false$", theme, flags=re.M)


def test_every_page_with_a_diagram_loads_the_copy_of_mermaid_the_site_serves(site: Path) -> None:
    copies = sorted(VENDOR.glob("mermaid-*.min.js"))
    assert len(copies) == 1, "one pinned copy of mermaid.js"
    (copy,) = copies
    version = copy.name.removeprefix("mermaid-").removesuffix(".min.js")
    about = (VENDOR / "README.txt").read_text()
    assert f"mermaid {version}" in about
    assert "MIT" in about
    assert (VENDOR / "mermaid-LICENSE.txt").read_text().startswith("The MIT License")
    with_diagrams = 0
    for page in _pages(site):
        found = _loads(page)
        if not found.diagrams:
            continue
        with_diagrams += 1
        scripts = [url for url in found.loaded if url.endswith(copy.name)]
        assert scripts, f"{page.relative_to(site)} draws diagrams without the local mermaid"
        assert (page.parent / scripts[0]).resolve().read_bytes() == copy.read_bytes()
    assert with_diagrams >= 2  # how-it-works and choosing draw diagrams


def test_every_markdown_table_renders_as_a_table(site: Path) -> None:
    # A row the table did not take shows as a paragraph of pipes.
    literal = {
        str(page.relative_to(site)): rows
        for page in _pages(site)
        if (rows := re.findall(r"<p>\s*(\|[^<]*\|)\s*</p>", page.read_text()))
    }
    assert literal == {}


def test_the_supported_versions_table_has_a_row_per_release_run(site: Path) -> None:
    page = (site / "supported-versions.html").read_text()
    rows = sorted((DOCS / "generated" / "compat").glob("torch-*[0-9].md"))
    assert rows
    for row in rows:
        release = row.stem.removeprefix("torch-")
        assert f"<td>{release}</td>" in page, f"torch {release}'s row is not in the table"


def test_search_has_an_index_of_every_page(site: Path) -> None:
    # mkdocs serve gives the search its index; a page opened from the disk cannot fetch it.
    index = (site / "search" / "search_index.json").read_text()
    for page in ("getting-started.html", "running-on-gpus.html", "troubleshooting.html"):
        assert f'"location":"{page}' in index.replace(" ", "")


def _text_of(page: Path) -> str:
    """The visible text of a page's article (not the navigation), tags and entities undone."""
    document = page.read_text()
    article = document[document.index("<article") : document.index("</article>")]
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", "", article)))


def test_the_reference_names_nothing_private(site: Path) -> None:
    """No ``_Name`` in the API reference: no private type variable, sentinel or helper."""
    found = {
        page.name: sorted(set(re.findall(r"(?<![\w.])_[A-Za-z]\w*", _text_of(page))))
        for page in sorted((site / "reference").glob("*.html"))
    }
    assert set(found) == {"torchcontract.html", "apis.html", "testing.html", "demo.html"}
    assert {name: names for name, names in found.items() if names} == {}
    reference = _text_of(site / "reference" / "apis.html")
    assert "mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy()" in reference
    assert "-> Module | list[Module]" in reference  # fully_shard returns what it was given
    links = (site / "reference" / "torchcontract.html").read_text()
    for target in (
        "https://docs.python.org/3/library/typing.html#typing.Any",
        "https://docs.pytorch.org/docs/stable/generated/torch.nn.Module.html#torch.nn.Module",
        "https://www.attrs.org/en/stable/api.html#attrs.evolve",
    ):
        assert f'href="{target}"' in links


#: torchcontract's objects a signature of the reference names without an entry of their own,
#: each with why. ``CommHook`` (``ReplicateModule.register_comm_hook``'s hook type) is not yet
#: exported from ``torchcontract.apis.replicate``.
UNDOCUMENTED_IN_SIGNATURES = {"torchcontract.apis.replicate._comm_hook.CommHook"}


def test_every_name_of_ours_a_signature_shows_has_an_entry(site: Path) -> None:
    """A type, default or base the reference shows links to its own entry: none is private.

    mkdocstrings links every name in a signature or an attribute's annotation to its entry;
    a name it finds no entry for (a private class, protocol or constant, as a constructor's
    ``cell: Cell[Any]`` or an attribute typed by a private protocol was) is left as plain
    text titled with its path.
    """
    unlinked = {
        page.name: sorted(
            set(re.findall(r'<span title="(torchcontract\.[\w.]+)">', page.read_text()))
        )
        for page in sorted((site / "reference").glob("*.html"))
    }
    left = {
        name: [path for path in paths if path not in UNDOCUMENTED_IN_SIGNATURES]
        for name, paths in unlinked.items()
    }
    assert {name: paths for name, paths in left.items() if paths} == {}
    # An exception that no longer applies is dropped from the list.
    assert {path for paths in unlinked.values() for path in paths} >= UNDOCUMENTED_IN_SIGNATURES
    reference = _text_of(site / "reference" / "apis.html")
    assert "set_custom_all_gather(comm: AllGatherComm)" in reference
    assert "set_custom_reduce_scatter(comm: ReduceScatterComm)" in reference


def test_each_returns_or_yields_section_renders_as_one_item(site: Path) -> None:
    """A description that runs over several lines stays one item (continuation indented).

    Google style reads a ``Returns:`` line at the section's indent as a new item, so a
    description whose second line is not indented further renders as two returned values,
    each with the return type. No function of the reference returns several.
    """
    sections = [
        (page.name, items)
        for page in sorted((site / "reference").glob("*.html"))
        for items in re.findall(
            r'<span class="doc-section-title">(?:Returns|Yields):</span></p>\s*<ul>(.*?)</ul>',
            page.read_text(),
            flags=re.S,
        )
    ]
    assert len(sections) >= 15
    split = {
        f"{name}: {' '.join(html.unescape(re.sub(r'<[^>]+>', ' ', items)).split())[:80]}"
        for name, items in sections
        if items.count("<li") != 1
    }
    assert split == set()


def test_links_between_pages_work_from_the_disk(site: Path) -> None:
    """Every link between pages names an .html file that exists (site/ opened via file://)."""
    for page in _pages(site):
        if page.name == "404.html":  # a server's page for any path: its links are absolute
            continue
        for link in re.findall(r'<a [^>]*href="([^"#:]*)(?:#[^"]*)?"', page.read_text()):
            if link and not link.endswith((".css", ".js", ".png", ".xml", ".gz", ".inv", ".txt")):
                assert link.endswith(".html"), f"{page.relative_to(site)} links to {link}"
                assert (page.parent / link).resolve().is_file(), f"{page.name}: {link}"


def test_every_include_was_resolved(site: Path) -> None:
    left = [str(page.relative_to(site)) for page in _pages(site) if "--8&lt;--" in page.read_text()]
    assert left == []
