"""The version says what it is: the changelog's newest section is ``torchcontract.__version__``.

One rule (CHANGELOG.md says it): while the newest section's changes are unreleased, it is
dated ``unreleased`` and the version is a ``.devN`` version of the next release; once
released, the section carries the release's number and date.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path

from packaging.version import Version

import torchcontract

CHANGELOG = Path(__file__).resolve().parent.parent / "CHANGELOG.md"


def _sections() -> list[tuple[str, str]]:
    """Each version section of the changelog as (version, date), newest first."""
    headings = re.findall(r"^## (.*)$", CHANGELOG.read_text(), flags=re.M)
    sections = []
    for heading in headings:
        match = re.fullmatch(r"(\S+) - (unreleased|\d{4}-\d{2}-\d{2})", heading)
        assert match is not None, f"{heading!r}: write a section as '## VERSION - DATE'"
        sections.append((match[1], match[2]))
    return sections


def test_the_changelogs_newest_section_is_the_package_version() -> None:
    newest, _ = _sections()[0]
    assert newest == torchcontract.__version__


def test_the_package_version_is_a_normalized_pep_440_version() -> None:
    assert str(Version(torchcontract.__version__)) == torchcontract.__version__


def test_only_the_newest_section_is_unreleased_and_only_it_a_dev_version() -> None:
    (newest, newest_date), *released = _sections()
    assert (newest_date == "unreleased") == Version(newest).is_devrelease
    for version, date in released:
        assert not Version(version).is_devrelease
        datetime.date.fromisoformat(date)  # a real date


def test_the_sections_go_from_newest_to_oldest() -> None:
    versions = [Version(version) for version, _ in _sections()]
    assert versions == sorted(versions, reverse=True)
    assert len(set(versions)) == len(versions)
