"""The README and the documentation pages run as written, and the site is complete.

Every Python block of a page runs (the page's blocks in order, as one script); every
``text`` block of a page shows what its code prints. Every public name has an entry
in the API reference; every test the guarantees table names exists. The built site
is ``tests/test_site.py``'s.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import tomllib
import types
from pathlib import Path

import pytest
from pages import DOCS, README, ROOT, code_blocks, pages, run_page

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
    if "import torchft" in page.read_text() and importlib.util.find_spec("torchft") is None:
        pytest.skip("torchft is not installed: requirements-torchft.txt pins it")
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


def _readme_links() -> list[str]:
    """Every link target of the README, inline (``](...)``) or as a reference (``[x]: ...``)."""
    text = (ROOT / "README.md").read_text()
    inline = re.findall(r"\]\(([^)\s]+)\)", text)
    defined = re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, flags=re.M)
    return inline + defined


def test_the_readme_links_name_files_of_this_checkout() -> None:
    # Relative: the project has no public address to link to.
    links = _readme_links()
    assert [link for link in links if "://" in link or link.startswith("/")] == []
    files = [link.split("#")[0] for link in links]
    assert "docs/getting-started.md" in files
    assert "docs/reference/torchcontract.md" in files
    assert "LICENSE" in files
    assert [name for name in files if not (ROOT / name).is_file()] == []


def test_the_package_metadata_names_no_project_address() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "urls" not in project


def test_the_pages_state_the_dependency_floors_the_package_declares() -> None:
    # typing-extensions >= 4.10: TypeIs, and TypeVar(default=...).
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "typing-extensions>=4.10" in declared
    for page in (README, DOCS / "getting-started.md"):
        (sentence,) = re.findall(r"asks only for (.*?)\.\s", page.read_text())
        assert re.findall(r"`([\w-]+>=[\d.]+)`", sentence) == declared, page.name


#: Files commands write for the pages to include: figures there are generated.
GENERATED = [
    ROOT / "benchmarks" / "results" / "RESULTS.md",
    ROOT / "benchmarks" / "results" / "training-steps.md",
    *sorted((DOCS / "generated").glob("*.md")),
]
#: A test count as a page would write it ("1,204 passed", "914 tests").
TEST_COUNT = re.compile(r"\b\d[\d,]* (?:tests? )?(?:passed|failed|skipped)\b|\b\d[\d,]* tests\b")
#: A time as the benchmark tables write it ("52.2 ms", "8.91 µs", "1.68 s").
TIME = re.compile(r"(?<![\d.])\d+(?:\.\d+)? (?:ns|µs|ms|s)\b")


def _handwritten(page: Path) -> str:
    """``page``'s own text: without the regions commands write (``make bench`` into the
    performance page, ``make test`` into the README)."""
    text = page.read_text()
    for start, end in (
        ("<!-- benchmark results: written by make bench -->", "<!-- end of benchmark results -->"),
        (
            "<!-- make test's last run: written by tools/record_run.py -->",
            "<!-- end of make test's last run -->",
        ),
    ):
        if start in text:
            text = text[: text.index(start)] + text[text.index(end) :]
    return text


def _table_pairs(path: Path) -> set[tuple[str, str]]:
    """The (torchcontract, torch) times of each row of a table ``make bench`` writes."""
    pairs = set()
    for line in path.read_text().splitlines():
        times = TIME.findall(line)
        if line.startswith("|") and len(times) >= 2:
            pairs.add((times[0], times[1]))
    return pairs


@pytest.mark.parametrize("page", pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_no_page_writes_a_generated_number_by_hand(page: Path) -> None:
    text = _handwritten(page)
    assert TEST_COUNT.findall(text) == [], "include docs/generated/ instead"
    # A row of the benchmark tables, both libraries' figures: a page includes the table.
    written = set(TIME.findall(text))
    copied = sorted(
        pair
        for path in GENERATED
        for pair in _table_pairs(path)
        if path.parent.name == "results" and set(pair) <= written
    )
    assert copied == [], f"include the table that `make bench` writes instead of {copied}"


def test_the_pages_include_the_generated_figures() -> None:
    steps = '--8<-- "benchmarks/results/training-steps.md"'
    assert steps in (DOCS / "verification.md").read_text()
    assert steps in (DOCS / "performance.md").read_text()
    assert '--8<-- "docs/generated/fuzz.md"' in (DOCS / "development.md").read_text()
    assert '--8<-- "docs/generated/test.md"' in (DOCS / "development.md").read_text()
    assert '--8<-- "docs/generated/slow.md"' in (DOCS / "development.md").read_text()


#: The two pages that explain the exceptions: users' (with the symptoms) and API authors'.
ERROR_PAGES = ("troubleshooting.md", "api-errors.md")


def test_the_error_pages_explain_every_exception_the_library_raises_once() -> None:
    headings = [
        heading
        for name in ERROR_PAGES
        for heading in re.findall(r"^## (\w+)$", (DOCS / name).read_text(), flags=re.M)
    ]
    exceptions = {
        name
        for module in PUBLIC_MODULES
        for name in module.__all__
        if isinstance(getattr(module, name), type)
        and issubclass(getattr(module, name), BaseException)
    }
    assert len(exceptions) >= 18
    assert sorted(headings) == sorted(exceptions)


def test_the_users_troubleshooting_explains_the_errors_of_fully_shard_and_replicate() -> None:
    page = (DOCS / "troubleshooting.md").read_text()
    for name in ("NoProcessGroupError", "AlreadyManagedError", "UnusedParameterError"):
        assert f"## {name}\n" in page
    assert "## AlreadyAppliedError" not in page  # an API author's


@pytest.mark.parametrize("name", [*ERROR_PAGES, "running-on-gpus.md"])
def test_a_guide_reads_in_one_sitting(name: str) -> None:
    assert len((DOCS / name).read_text().split()) < 2_000


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
    importlib.import_module("torchcontract.demo"),
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
    page = (DOCS / "verification.md").read_text()
    start = page.index("## The contract's guarantees")
    table = page[start : page.index("\n## ", start + 1)]
    named = set(re.findall(r"`(test_\w+)`", table)) - {"test_docs"}
    files = set(re.findall(r"`((?:\w+/)?test_\w+\.py|typing/\w+\.py)`", table))
    sources = "\n".join(path.read_text() for path in (ROOT / "tests").rglob("*.py"))
    assert named, "the guarantees table names no test"
    missing = sorted(name for name in named if f"def {name}(" not in sources)
    assert not missing
    assert not [name for name in files if not (ROOT / "tests" / name).is_file()]


def test_the_signature_the_replicate_page_shows_is_replicates() -> None:
    page = (DOCS / "replicate.md").read_text()
    (shown,) = re.findall(r"^replicate\(module, .*?\)$", page, flags=re.M | re.S)
    keywords = dict(re.findall(r"(\w+)=([^,\s)]+)", shown))
    parameters = inspect.signature(torchcontract.apis.replicate).parameters
    assert keywords == {
        name: repr(parameter.default) for name, parameter in parameters.items() if name != "module"
    }


#: The README's rows that cite a TODO in torch's contract, with the TODO's words.
TORCH_TODOS = {"incompatible APIs": "verify that installed distributed paradigms are compatible"}


def test_the_readme_cites_only_todos_torchs_contract_still_has() -> None:
    import torch.distributed._composable.contract as torch_contract

    rows = [line for line in README.read_text().splitlines() if "TODO in the source" in line]
    assert sorted(row.split("|")[1].strip() for row in rows) == sorted(TORCH_TODOS)
    source = inspect.getsource(torch_contract)
    assert [words for words in TORCH_TODOS.values() if words not in source] == []


def test_a_page_offering_cpu_offload_says_a_gpu_mesh_refuses_it() -> None:
    # Each paragraph, list item or table row that names it says it is refused there.
    silent = {
        str(page.relative_to(ROOT)): part.strip()[:80]
        for page in pages()
        for part in re.split(r"\n\s*\n|\n\s*- |\n\|", page.read_text())
        if "CPUOffloadPolicy" in part and not re.search(r"refus|NotImplementedError", part)
    }
    assert silent == {}


def test_the_performance_page_writes_no_time_of_its_own() -> None:
    # Every time there comes from `make bench`: a figure measured by hand goes stale.
    assert TIME.findall(_handwritten(DOCS / "performance.md")) == []


#: The pages that give evidence: test names and file names belong there, not in guides.
EVIDENCE = {
    "docs/verification.md",
    "docs/performance.md",
    "docs/development.md",
    "docs/supported-versions.md",
}


def test_no_guide_names_a_test_of_the_project() -> None:
    sources = {path.relative_to(ROOT / "tests"): path.read_text() for path in _test_files()}
    names = {name for text in sources.values() for name in re.findall(r"def (test_\w+)", text)}
    named = {
        str(page.relative_to(ROOT)): found
        for page in pages()
        if str(page.relative_to(ROOT)) not in EVIDENCE
        and (
            found := sorted(
                {word for word in re.findall(r"\btest_\w+", page.read_text()) if word in names}
                | {
                    word
                    for word in re.findall(r"[\w/]*test_\w+\.py", page.read_text())
                    if any(str(path).endswith(word.removeprefix("tests/")) for path in sources)
                }
            )
        )
    }
    assert named == {}


def _test_files() -> list[Path]:
    return sorted((ROOT / "tests").rglob("*.py"))


def test_what_was_shown_on_gpus_is_written_in_one_place() -> None:
    # docs/generated/gpu-status.md: pages include it or link to it, never copy its figures.
    status = (DOCS / "generated" / "gpu-status.md").read_text()
    figures = set(re.findall(r"\b\d+\.\d+\b", status))
    assert figures
    copied = {
        str(page.relative_to(ROOT)): sorted(figures & set(re.findall(r"\b\d+\.\d+\b", text)))
        for page in pages()
        if figures & set(re.findall(r"\b\d+\.\d+\b", text := page.read_text()))
    }
    assert copied == {}
    include = '--8<-- "docs/generated/gpu-status.md"'
    including = [page.name for page in pages() if include in page.read_text()]
    assert including == ["running-on-gpus.md"]
