"""Behavioural mutants of the reference APIs and the testing helpers: `make mutate-apis`.

mutmut's operator swaps over ``apis/`` and ``testing`` would make thousands of
mutants, each needing ranks started: more than a 2-core machine runs in a day. So
this is a fixed list of bugs a developer could plausibly write, each a snippet of
the source and its replacement, with the test files that should catch it. Each is
applied alone to a temporary copy of ``src/`` and ``tests/`` (never the work tree),
the tests run there as CI runs them (``pytest -x``, the copy first on the path, ranks
included), and the mutant is *killed* if they fail or time out. Each original
snippet must occur exactly once in its file, else the tool fails before running
anything: a mutant that no longer applies is a list to update, not a pass.

Usage: ``python tools/api_mutants.py [--only NAME ...] [--output PATH]``; the
table goes to ``tests/mutation/apis.md`` and to stdout. Exit status 1 if a mutant
survived or did not apply.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parent.parent
PACKAGE: Final = "src/torchcontract"
#: Seconds a mutant's tests may run; a hang (a collective never matched) is a kill.
TIMEOUT: Final = 420


@dataclass(frozen=True)
class Mutant:
    """One injected bug: ``original`` replaced by ``replacement`` in ``path``, in the package."""

    name: str
    path: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    bug: str


FS_MEMORY: Final = "tests/distributed/test_fully_shard_memory_gloo.py"
FS_PARITY: Final = "tests/distributed/test_fully_shard_gloo.py"
COLLECTIVES: Final = "tests/distributed/test_collectives_gloo.py"
REAL_USE: Final = "tests/distributed/test_replicate_real_use_gloo.py"
REPLICATE: Final = "tests/distributed/test_replicate_gloo.py"
REPLICATE_PARITY: Final = "tests/distributed/test_replicate_parity_gloo.py"
REPLICATE_KEYWORDS: Final = "tests/distributed/test_replicate_keywords_gloo.py"
REPLICATE_BUCKETS: Final = "tests/test_replicate_buckets.py"
FAILED_BACKWARD: Final = "tests/test_replicate_failed_backward.py"
HOOK_BUCKETS: Final = "tests/distributed/test_replicate_hook_buckets_gloo.py"
TESTING: Final = "tests/test_testing.py"
GUARANTEES: Final = "tests/test_testing_guarantees.py"

MUTANTS: Final[tuple[Mutant, ...]] = (
    # ----------------------------------------------------------------- fully_shard
    Mutant(
        "fully_shard_reshard_keeps_storage",
        "apis/fully_shard/_sharding.py",
        "            self._gathered.untyped_storage().resize_(0)",
        "            pass",
        (FS_MEMORY,),
        "reshard registers the shards again but never frees the unsharded storage",
    ),
    Mutant(
        "fully_shard_keep_ignored",
        "apis/fully_shard/_group.py",
        "            return not self.is_root\n        return self.reshard_after_forward\n",
        "            return not self.is_root\n        return True\n",
        (FS_MEMORY,),
        "reshard_after_forward=False ignored: every backward gathers again",
    ),
    Mutant(
        "fully_shard_root_reshards",
        "apis/fully_shard/_group.py",
        "            return not self.is_root\n",
        "            return True\n",
        (FS_MEMORY,),
        "the root reshards after forward by default, to gather again at once in backward",
    ),
    Mutant(
        "fully_shard_true_keeps_the_root",
        "apis/fully_shard/_group.py",
        "if self.reshard_after_forward is None:",
        "if self.reshard_after_forward is not False:",
        (FS_MEMORY,),
        "an explicit reshard_after_forward=True keeps the root unsharded (FSDP2 frees it)",
    ),
    Mutant(
        "fully_shard_int_world_size_keeps",
        "apis/fully_shard/_arguments.py",
        "        return False\n    return True\n\n\ndef post_forward_size_of",
        "        return False\n    return False\n\n\ndef post_forward_size_of",
        (FS_MEMORY,),
        "reshard_after_forward as an int above 1 keeps the parameters instead of freeing them",
    ),
    Mutant(
        "fully_shard_no_reset_after_failed_backward",
        "apis/fully_shard/_group.py",
        "        if self.callback_queued:\n            self.callback_queued = False",
        "        if False:\n            self.callback_queued = False",
        (FS_MEMORY,),
        "the root's forward does not reset the iteration after a backward that raised",
    ),
    Mutant(
        "reduce_scatter_divides_twice",
        "apis/_torch.py",
        "    output.div_(group.size())",
        "    output.div_(group.size()).div_(group.size())",
        (FS_MEMORY,),
        "the reduce-scatter divides by the world size twice",
    ),
    Mutant(
        "reduce_scatter_sums",
        "apis/_torch.py",
        "    output.div_(group.size())",
        "    pass",
        (FS_MEMORY,),
        "the reduce-scatter sums instead of averaging",
    ),
    Mutant(
        "fully_shard_last_shard_short",
        "apis/fully_shard/_sharding.py",
        "min(self.chunk_rows, self.rows - self.rank * self.chunk_rows)",
        "min(self.chunk_rows, self.rows - self.rank * self.chunk_rows - 1)",
        (FS_MEMORY,),
        "the last shard is one row short",
    ),
    Mutant(
        "fully_shard_reduces_in_param_dtype",
        "apis/fully_shard/_collectives.py",
        "dtypes = [reduce_dtype or grad.dtype for grad in grads]",
        "dtypes = [grad.dtype for grad in grads]",
        (FS_PARITY,),
        "gradients reduced in the parameter dtype instead of reduce_dtype",
    ),
    Mutant(
        "fully_shard_no_sync_ignored",
        "apis/fully_shard/_group.py",
        "        if not record.sync_gradients:\n            for parameter in self.parameters:",
        "        if False:\n            for parameter in self.parameters:",
        (FS_PARITY,),
        "no_sync ignored by fully_shard",
    ),
    Mutant(
        "fully_shard_load_not_adopted",
        "apis/fully_shard/_sharding.py",
        "if isinstance(current, DTensor) and current.shape == self.layout.shape:",
        "if False:",
        (FS_PARITY,),
        "load_state_dict(assign=True) does not adopt the new shards",
    ),
    Mutant(
        "fully_shard_dp_mesh_dims_order",
        "apis/fully_shard/_spmd.py",
        "concatenate_meshes([_flat(mesh, replicate), shard_mesh])",
        "concatenate_meshes([shard_mesh, _flat(mesh, replicate)])",
        ("tests/distributed/test_fully_shard_spmd_gloo.py",),
        "dp_mesh_dims(shard=..., replicate=...) builds the HSDP mesh in the wrong order",
    ),
    # ----------------------------------------------------------------- replicate
    Mutant(
        "replicate_rebuilt_buckets_reversed",
        "apis/replicate/_rebuild.py",
        "    return result\n",
        "    return result[::-1]\n",
        (COLLECTIVES,),
        "the rebuilt buckets launch in reverse order",
    ),
    Mutant(
        "replicate_unused_rebuilt_last_defined_first",
        "apis/replicate/_reducer.py",
        "*(index for index in range(len(self._names)) if index not in arrived)",
        "*(index for index in reversed(range(len(self._names))) if index not in arrived)",
        (HOOK_BUCKETS,),
        "a rebuild appends never-used parameters last-defined first (DDP: in definition order)",
    ),
    Mutant(
        "replicate_buffers_copied_at_apply_regardless",
        "apis/replicate/_keywords.py",
        "    return BufferSync(forward=synced, at_apply=synced)\n",
        "    return BufferSync(forward=synced, at_apply=True)\n",
        (REPLICATE_KEYWORDS,),
        "broadcast_buffers=False still copies rank 0's buffers at apply (DDP does not)",
    ),
    Mutant(
        "replicate_output_device_unchecked",
        "apis/replicate/_devices.py",
        "        if listed or output_device:\n",
        "        if listed:\n",
        ("tests/test_replicate_ddp_keywords.py",),
        "output_device naming a device on a CPU module is taken (DDP: ValueError)",
    ),
    Mutant(
        "replicate_broadcast_buffers_ignored",
        "apis/replicate/_forward.py",
        "        and record.broadcast_buffers\n",
        "        and True\n",
        (COLLECTIVES,),
        "broadcast_buffers=False ignored",
    ),
    Mutant(
        "replicate_small_bucket_uncapped",
        "apis/replicate/_rebuild.py",
        "    if default_cap:\n        return (FIRST_BUCKET_BYTES, cap_bytes)\n",
        "",
        (HOOK_BUCKETS,),
        "under the default cap, no bucket is capped at 1 MiB (with a hook too)",
    ),
    Mutant(
        "replicate_given_cap_overridden",
        "apis/replicate/_rebuild.py",
        "    return (cap_bytes,)\n",
        "    return (max(cap_bytes, 4 * FIRST_BUCKET_BYTES),)\n",
        (HOOK_BUCKETS,),
        "a bucket_cap_mb given is overridden by a rule of ours",
    ),
    Mutant(
        "replicate_static_graph_rebuilds_early",
        "apis/replicate/_reducer.py",
        "self._backwards_before_rebuild = 1 if static_graph else 0",
        "self._backwards_before_rebuild = 0",
        (HOOK_BUCKETS,),
        "static_graph=True rebuilds the buckets one backward early (a hook sees other buckets)",
    ),
    Mutant(
        "replicate_finds_unused_by_default",
        "apis/replicate/_api.py",
        "    find_unused_parameters: bool = False,\n",
        "    find_unused_parameters: bool = True,\n",
        (REPLICATE_KEYWORDS,),
        "find_unused_parameters defaults to True, not DDP's False",
    ),
    Mutant(
        "replicate_views_give_unused_zeros",
        "apis/replicate/_bucket_views.py",
        "    for index, view in zip(bucket, views, strict=True):\n"
        "        if not used[index]:\n            continue\n",
        "    for index, view in zip(bucket, views, strict=True):\n",
        (REPLICATE_KEYWORDS,),
        "with gradient_as_bucket_view, a parameter no rank used gets a zero gradient",
    ),
    Mutant(
        "replicate_no_reset_after_failed_backward",
        "apis/replicate/_reducer.py",
        "            self._reset_backward()  # raised before any gradient arrived: no trace\n",
        "            pass\n",
        (REPLICATE_BUCKETS, FAILED_BACKWARD),
        "the reducer is not reset after a synchronizing backward that failed harmlessly",
    ),
    Mutant(
        "replicate_trains_on_after_failed_backward",
        "apis/replicate/_reducer.py",
        "        if self.unfinished is None and self._failed_midway():\n"
        "            self.unfinished = unfinished_backward_error(self.where)\n"
        "        if self.unfinished is not None:\n            raise self.unfinished\n",
        "        if self.unfinished is not None:\n            raise self.unfinished\n",
        (REAL_USE, FAILED_BACKWARD),
        "a forward after a backward that raised midway does not raise",
    ),
    Mutant(
        "replicate_no_sync_ignored",
        "apis/replicate/_forward.py",
        "synchronizing = torch.is_grad_enabled() and record.sync_gradients",
        "synchronizing = torch.is_grad_enabled()",
        (COLLECTIVES,),
        "a forward under no_sync arms its outputs: its backward synchronizes",
    ),
    Mutant(
        "replicate_rank_local_broadcasts",
        "apis/replicate/_forward.py",
        "    if record.rank_local:\n        return\n    if not reducer.took_over_in_backward:",
        "    if not reducer.took_over_in_backward:",
        (COLLECTIVES,),
        "a rank-local forward broadcasts buffers (and hangs when the other rank waits)",
    ),
    Mutant(
        "replicate_broadcast_from_last_rank",
        "apis/replicate/_forward.py",
        "if reducer.join_config.enable else 0",
        "if reducer.join_config.enable else reducer.group.size() - 1",
        (REPLICATE_PARITY,),
        "buffers broadcast before a forward from the last rank instead of the first",
    ),
    Mutant(
        "replicate_unused_given_zeros",
        "apis/replicate/_bucket_views.py",
        "    for index, average in zip(bucket, views, strict=True):\n"
        "        if not used[index]:\n            continue\n",
        "    for index, average in zip(bucket, views, strict=True):\n",
        (REPLICATE,),
        "a parameter no rank used is given the (zero) average",
    ),
    Mutant(
        "replicate_sums",
        "apis/replicate/_reducer.py",
        "else 1.0 / self._divisor()",
        "else 1.0",
        (REPLICATE_PARITY,),
        "gradients summed over ranks instead of averaged",
    ),
    # ----------------------------------------------------------------- the demo
    Mutant(
        "demo_keeps_partial_checkpoints",
        "demo/_checkpoints.py",
        "                shutil.rmtree(partial)\n",
        "                pass\n",
        ("tests/distributed/test_demo_checkpoints_gloo.py",),
        "a rerun leaves the .partial directory of a save cut short",
    ),
    # ----------------------------------------------------------------- checkpoint
    Mutant(
        "checkpoint_rng_not_restored",
        "apis/checkpoint.py",
        "                torch.set_rng_state(self.cpu_rng_state)\n",
        "                pass\n",
        ("tests/test_apis_checkpoint.py",),
        "the reentrant recomputation does not restore the RNG state (dropout differs)",
    ),
    # ----------------------------------------------------------------- testing
    Mutant(
        "run_distributed_no_grace",
        "testing/_collect.py",
        "            deadline = min(deadline, time.monotonic() + wait_more)\n",
        "",
        (GUARANTEES,),
        "after a rank failed, the others get the whole timeout instead of a grace period",
    ),
    Mutant(
        "run_distributed_dist_error_as_cause",
        "testing/_collect.py",
        "    if isinstance(error, dist.DistError):\n        return True\n",
        "",
        ("tests/test_testing_root_cause.py",),
        "a peer's DistError without connection words is taken for the root cause",
    ),
    Mutant(
        "run_distributed_swallows_exception",
        "testing/_collect.py",
        "            if ok:\n                results[rank] = payload\n                continue\n",
        "            if ok or isinstance(payload, Failure):\n"
        "                results[rank] = payload\n                continue\n",
        (TESTING,),
        "a rank's exception is returned as its result",
    ),
    Mutant(
        "run_distributed_timeout_not_enforced",
        "testing/_collect.py",
        "        if remaining <= 0:\n            if failures:",
        "        if remaining <= 0 and False:\n            if failures:",
        (TESTING,),
        "run_distributed's timeout is not enforced",
    ),
    Mutant(
        "invariants_miss_an_added_gradient",
        "testing/_compare.py",
        "unmatched = tuple(sorted(mine.keys() ^ theirs.keys()))",
        "unmatched = tuple(sorted(theirs.keys() - mine.keys()))",
        (GUARANTEES,),
        "check_api_invariants misses a gradient the API added",
    ),
    Mutant(
        "invariants_miss_a_dropped_gradient",
        "testing/_compare.py",
        "unmatched = tuple(sorted(mine.keys() ^ theirs.keys()))",
        "unmatched = tuple(sorted(mine.keys() - theirs.keys()))",
        (GUARANTEES,),
        "check_api_invariants passes an API that drops a gradient",
    ),
    Mutant(
        "invariants_ignore_gradients",
        "testing/_invariants.py",
        "if case.same_numerics and worst_gradient > case.tolerance:",
        "if False:",
        (GUARANTEES,),
        "check_api_invariants passes an API that changes gradients but not outputs",
    ),
)


def _apply(mutant: Mutant, source: Path) -> None:
    """Write ``mutant`` into the copy of the package at ``source``."""
    path = source / mutant.path
    text = path.read_text()
    path.write_text(text.replace(mutant.original, mutant.replacement, 1))


def check_applicable(mutants: Sequence[Mutant]) -> list[str]:
    """The problems: an original snippet found other than exactly once, a test file missing."""
    problems: list[str] = []
    for mutant in mutants:
        path = ROOT / PACKAGE / mutant.path
        count = path.read_text().count(mutant.original) if path.exists() else 0
        if count != 1:
            problems.append(f"{mutant.name}: original found {count} times in {mutant.path}")
        problems.extend(
            f"{mutant.name}: no test file {test}"
            for test in mutant.tests
            if not (ROOT / test).exists()
        )
    return problems


def _copy_tree(destination: Path) -> None:
    for part in ("src", "tests", "examples"):
        shutil.copytree(
            ROOT / part,
            destination / part,
            ignore=shutil.ignore_patterns("__pycache__", ".hypothesis"),
        )
    shutil.copy(ROOT / "pyproject.toml", destination / "pyproject.toml")


def run_tests(tests: Sequence[str], copy: Path) -> tuple[str, float]:
    """Run ``tests`` in ``copy`` with its package first on the path: the outcome and seconds."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(copy / "src"), environment.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    environment["PYTHONDONTWRITEBYTECODE"] = "1"
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    started = time.monotonic()
    try:
        completed = subprocess.run(
            command,
            cwd=copy,
            env=environment,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - started
    seconds = time.monotonic() - started
    if completed.returncode == 0:
        return "passed", seconds
    if completed.returncode == 1:
        return "failed", seconds
    return f"error {completed.returncode}: {completed.stdout[-300:]}", seconds


def _imports_the_copy(copy: Path) -> bool:
    """Whether a process started as the tests are imports the package from the copy."""
    environment = dict(os.environ, PYTHONPATH=str(copy / "src"))
    found = subprocess.run(
        [sys.executable, "-c", "import torchcontract; print(torchcontract.__file__)"],
        cwd=copy,
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return found.strip().startswith(str(copy))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="mutant names to run")
    parser.add_argument("--output", default=str(ROOT / "tests/mutation/apis.md"))
    options = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if options.only is None or m.name in options.only]
    problems = check_applicable(MUTANTS)
    if problems:
        print("api_mutants: mutants that do not apply:\n  " + "\n  ".join(problems))
        return 1
    rows: list[tuple[Mutant, str, float]] = []
    with tempfile.TemporaryDirectory(prefix="api_mutants_") as scratch:
        # The tests must pass on the unmutated copy, or a failure would prove nothing.
        baseline = Path(scratch, "baseline")
        _copy_tree(baseline)
        if not _imports_the_copy(baseline):
            print("api_mutants: the tests would not import the copy; is PYTHONPATH honoured?")
            return 1
        files = sorted({test for mutant in chosen for test in mutant.tests})
        outcome, seconds = run_tests(files, baseline)
        print(f"baseline ({len(files)} files): {outcome} ({seconds:.0f} s)", flush=True)
        if outcome != "passed":
            print("api_mutants: the tests fail without a mutant; fix them first")
            return 1
        shutil.rmtree(baseline, ignore_errors=True)
        for mutant in chosen:
            copy = Path(scratch, mutant.name)
            _copy_tree(copy)
            _apply(mutant, copy / PACKAGE)
            outcome, seconds = run_tests(mutant.tests, copy)
            verdict = "survived" if outcome == "passed" else "killed"
            rows.append((mutant, f"{verdict} ({outcome})", seconds))
            print(f"{mutant.name}: {verdict} ({outcome}, {seconds:.0f} s)", flush=True)
            shutil.rmtree(copy, ignore_errors=True)
    killed = sum(1 for _, verdict, _ in rows if verdict.startswith("killed"))
    table = [
        "# Behavioural mutants of the reference APIs and the testing helpers",
        "",
        "Written by `make mutate-apis` (`tools/api_mutants.py`, where each mutant's snippet",
        "and replacement are listed). Each mutant is applied alone to a temporary copy of",
        "the source; its test files run there with `pytest -x`; a failure or a",
        f"{TIMEOUT} s timeout kills it. The same files pass first on an unmutated copy.",
        "",
        f"**{killed} of {len(rows)} killed.**",
        "",
        "| mutant | bug | tests | result | seconds |",
        "|---|---|---|---|---|",
    ]
    for mutant, verdict, seconds in rows:
        tests = ", ".join(f"`{Path(test).name}`" for test in mutant.tests)
        table.append(f"| `{mutant.name}` | {mutant.bug} | {tests} | {verdict} | {seconds:.0f} |")
    text = "\n".join(table) + "\n"
    if options.only is None:
        Path(options.output).write_text(text)
    print(text)
    return 0 if killed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
