"""The demo's checkpoints on two gloo ranks: complete or absent, and a resume changes nothing.

A save cut short leaves a ``.partial`` directory and no metadata: the next run
resumes from the checkpoint before it, removes the remains (even those of a step it
does not reach), and ends with the uninterrupted run's final line. Checkpointing itself
does not touch the numbers.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
from commands import run_command

from torchcontract.demo import Settings, ShardedOutcome, main, train_sharded
from torchcontract.testing import run_distributed

STEPS = 4


def _train(checkpoints: Path | None) -> list[ShardedOutcome]:
    settings = Settings(
        steps=STEPS,
        checkpoint_dir=None if checkpoints is None else str(checkpoints),
        checkpoint_every=2,
    )
    return run_distributed(train_sharded, 2, timeout=120.0, args=(settings,))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[ShardedOutcome]]:
    checkpoints = tmp_path_factory.mktemp("uninterrupted")
    return checkpoints, _train(checkpoints)


def test_a_run_saves_every_k_steps_complete_checkpoints(
    uninterrupted: tuple[Path, list[ShardedOutcome]],
) -> None:
    checkpoints, _ = uninterrupted
    saved = sorted(path.name for path in (checkpoints / "fully_shard").iterdir())
    assert saved == ["step-000002", "step-000004"]
    for name in saved:
        written = {path.name for path in (checkpoints / "fully_shard" / name).iterdir()}
        assert written == {".metadata", "__0_0.distcp", "__1_0.distcp"}


def test_checkpointing_leaves_the_numbers_alone(
    uninterrupted: tuple[Path, list[ShardedOutcome]],
) -> None:
    _, outcomes = uninterrupted
    assert [outcome.final_line for outcome in _train(None)] == [
        outcome.final_line for outcome in outcomes
    ]


def test_a_save_cut_short_is_ignored_and_the_previous_checkpoint_resumed(
    uninterrupted: tuple[Path, list[ShardedOutcome]], tmp_path: Path
) -> None:
    source, outcomes = uninterrupted
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    phase = tmp_path / "fully_shard"
    # What a worker killed mid-save leaves: its peers' files, no metadata, not published.
    cut = phase / "step-000004.partial"
    (phase / "step-000004").rename(cut)
    (cut / ".metadata").unlink()
    (cut / "__1_0.distcp").unlink()
    resumed = _train(tmp_path)
    assert [outcome.resumed_from for outcome in resumed] == [2, 2]
    assert [outcome.final_line for outcome in resumed] == [
        outcome.final_line for outcome in outcomes
    ]
    assert sorted(path.name for path in phase.iterdir()) == ["step-000002", "step-000004"]


def test_a_rerun_that_stops_before_a_cut_save_still_removes_its_remains(
    uninterrupted: tuple[Path, list[ShardedOutcome]], tmp_path: Path
) -> None:
    source, outcomes = uninterrupted
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    phase = tmp_path / "fully_shard"
    # A save of step 6 cut short, by a run of more steps than this rerun's.
    cut = phase / "step-000006.partial"
    shutil.copytree(phase / "step-000004", cut)
    (cut / ".metadata").unlink()
    resumed = _train(tmp_path)
    assert [outcome.resumed_from for outcome in resumed] == [STEPS, STEPS]
    assert [outcome.final_line for outcome in resumed] == [
        outcome.final_line for outcome in outcomes
    ]
    assert sorted(path.name for path in phase.iterdir()) == ["step-000002", "step-000004"]
    for name in ("step-000002", "step-000004"):
        written = {path.name for path in (phase / name).iterdir()}
        assert written == {".metadata", "__0_0.distcp", "__1_0.distcp"}


def test_a_checkpoint_of_another_world_size_is_refused(
    uninterrupted: tuple[Path, list[ShardedOutcome]], tmp_path: Path
) -> None:
    source, _ = uninterrupted
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    settings = Settings(steps=STEPS, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    with pytest.raises(ValueError, match="step-000004 was saved by 2 ranks, this run has 1"):
        run_distributed(train_sharded, 1, timeout=120.0, args=(settings,))


def test_help_lists_the_checkpoint_options() -> None:
    done = run_command([sys.executable, "-m", "torchcontract.demo", "--help"], timeout=60)
    assert done.returncode == 0, done.stderr
    for option in (
        "--checkpoint-dir DIR",
        "--checkpoint-every K",
        "--pause-after-checkpoint STEP",
        "--hsdp",
        "--steps",
    ):
        assert option in done.stdout


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--checkpoint-every", "0"], "--nproc, --steps and --checkpoint-every must be at least 1"),
        (["--pause-after-checkpoint", "6"], "--pause-after-checkpoint needs --checkpoint-dir"),
        (
            [
                "--checkpoint-dir",
                "unused",
                "--checkpoint-every",
                "4",
                "--pause-after-checkpoint",
                "6",
            ],
            "--pause-after-checkpoint 6: no checkpoint is saved at step 6; pass a multiple of "
            "--checkpoint-every (4) or --steps (40)",
        ),
    ],
)
def test_misused_options_are_refused_before_anything_starts(
    arguments: list[str], message: str, tmp_path: Path
) -> None:
    command = [sys.executable, "-m", "torchcontract.demo", *arguments]
    done = run_command(command, timeout=60, cwd=tmp_path)
    assert done.returncode == 2
    assert message in done.stderr
    assert not (tmp_path / "unused").exists()


def test_checkpoint_dir_is_refused_without_numpy_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # torch.distributed.checkpoint reads what the ranks exchange through numpy, which
    # torch does not install.
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *rest: None if name == "numpy" else find_spec(name, *rest),
    )
    with pytest.raises(SystemExit) as exited:
        main(["--checkpoint-dir", str(tmp_path / "unused")])
    assert exited.value.code == 2
    assert (
        "--checkpoint-dir saves with torch.distributed.checkpoint, which needs numpy (torch does "
        "not install it): pip install numpy"
    ) in capsys.readouterr().err
    assert not (tmp_path / "unused").exists()
