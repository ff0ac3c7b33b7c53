"""The built wheel, installed alone in a fresh environment, works as the documentation says.

Builds the sdist and, from it, the wheel of this checkout; both carry the license, and
the wheel's version is ``torchcontract.__version__``. Then it installs the wheel (not
editable) with its declared dependencies alone into a new virtual environment, and there,
from a directory outside the checkout, runs the tours of the README and of the
documentation and the demo (2 gloo processes, 1 step), then installs mypy and type-checks a
small strictly typed user file. A module left out of the wheel, a missing ``py.typed``, or
a package the code needs but the wheel does not declare (numpy, which torch does not
install, and which the development environment holds) fails here.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest
from commands import run_command
from pages import DOCS, README, code_blocks

import torchcontract

ROOT = Path(__file__).resolve().parent.parent

USER_FILE = textwrap.dedent(
    """
    from __future__ import annotations

    from typing import assert_type

    import attrs
    from torch import nn

    from torchcontract import Application, contract
    from torchcontract.apis import ReplicateState, checkpoint, replicate


    @attrs.frozen
    class Counter:
        calls: int = 0


    @contract(Counter)
    def counted(module: nn.Module, *, start: int = 0) -> None:
        counted.set_state(module, Counter(start))


    model = nn.Linear(2, 2)
    assert_type(counted(model, start=1), nn.Linear)  # the caller's class, kept
    assert_type(counted.state(model), Counter)
    assert_type(counted.application(model), Application[Counter])
    assert_type(replicate.get_state(model), ReplicateState | None)
    checkpoint(model, use_reentrant=False)
    """
)


def _run(*command: str | Path, cwd: Path) -> str:
    # Without PYTHONPATH: the fresh environment must not see this checkout's sources.
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    done = run_command(
        command, timeout=240, cwd=cwd, env={**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    )
    assert done.returncode == 0, (
        f"{command[:3]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


@pytest.mark.timeout(600)
def test_built_wheel_runs_the_tour_and_type_checks_in_a_fresh_environment(
    tmp_path: Path,
) -> None:
    # Built from a copy of what the wheel is made of, so the checkout gets no build files.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "MANIFEST.in"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info", "*.so")
    )
    dist = tmp_path / "dist"
    _run(
        sys.executable,
        "-m",
        "build",
        "--no-isolation",
        "--outdir",
        dist,
        source,
        cwd=tmp_path,
    )
    (wheel,) = dist.glob("torchcontract-*.whl")
    (sdist,) = dist.glob("torchcontract-*.tar.gz")
    version = torchcontract.__version__
    assert wheel.name.startswith(f"torchcontract-{version}-")
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.startswith("BSD 3-Clause License")
    with zipfile.ZipFile(wheel) as archive:
        licensed = archive.read(f"torchcontract-{version}.dist-info/licenses/LICENSE")
        metadata = archive.read(f"torchcontract-{version}.dist-info/METADATA").decode()
        members = archive.namelist()
    # The C walk, built for this interpreter, and its stub for type checkers.
    assert [name for name in members if name.startswith("torchcontract/_walk_native")] == [
        f"torchcontract/_walk_native{sysconfig.get_config_var('EXT_SUFFIX')}",
        "torchcontract/_walk_native.pyi",
    ]
    assert licensed.decode() == license_text
    assert "License-Expression: BSD-3-Clause" in metadata
    with tarfile.open(sdist) as archive:
        names = set(archive.getnames())
    assert {
        f"torchcontract-{version}/LICENSE",
        f"torchcontract-{version}/CHANGELOG.md",
        f"torchcontract-{version}/src/torchcontract/_walk_native.c",
    } <= names
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    mypy_version = _run(sys.executable, "-m", "mypy", "--version", cwd=tmp_path).split()[1]
    # The development pin, whose wheel lies on this machine (a run against another torch
    # release still checks the wheel, not that release).
    (torch_pin,) = (
        line.strip()
        for line in (ROOT / "requirements-dev.txt").read_text().splitlines()
        if line.startswith("torch==")
    )
    _run(python, "-m", "pip", "install", "-q", wheel, torch_pin, cwd=tmp_path)
    frozen = _run(python, "-m", "pip", "list", "--format=freeze", cwd=tmp_path)
    installed = {line.split("==")[0].lower() for line in frozen.split()}
    declares_numpy = "Requires-Dist: numpy" in metadata
    assert ("numpy" in installed) == declares_numpy, sorted(installed)
    work = tmp_path / "user"
    work.mkdir()
    located = _run(python, "-c", "import torchcontract; print(torchcontract.__file__)", cwd=work)
    assert str(venv) in located  # the installed wheel, not this checkout
    built = "from torchcontract import _fqn; print(_fqn._native_walk is not None)"
    assert _run(python, "-c", built, cwd=work).strip() == "True"
    for name, page in (("readme", README), ("tour", DOCS / "getting-started.md")):
        (work / f"{name}.py").write_text("\n".join(code_blocks(page, "python")))
        printed = _run(python, f"{name}.py", cwd=work)
        assert "__main__.scale is already applied to Linear" in printed
    printed = _run(python, "-m", "torchcontract.demo", "--steps", "1", cwd=work)
    assert printed.count("final (") == 2  # once per phase, by rank 0
    assert "both phases end with the same parameters" in printed
    assert "gradients matched DistributedDataParallel's on the first step: yes" in printed
    assert "first-step losses matched PyTorch's fully_shard: yes" in printed
    _run(python, "-m", "pip", "install", "-q", f"mypy=={mypy_version}", cwd=tmp_path)
    (work / "user.py").write_text(USER_FILE)
    _run(python, "-m", "mypy", "--strict", "user.py", cwd=work)
