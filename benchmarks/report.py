"""``make bench``: run every ``bench_*.py``, then write and print the comparison.

Writes, under ``benchmarks/results/``: ``benchmarks.json`` (pytest-benchmark's raw
output), ``RESULTS.md`` (medians of both libraries side by side, the ratio
torchcontract / torch, growth from 64 to 512 blocks, bytes per module, and the
machine); ``docs/images/apply_scaling.png`` (apply time against module count,
log-log); ``training-steps.md`` (the training-step rows, ours without prefetch in a
note, which the performance and ``fully_shard`` pages both include); and the results
section of the documentation's performance page, ``docs/performance.md``.
``python -m benchmarks.report --no-run`` rebuilds all but the JSON from the last run's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, Final

import attrs

__all__ = ["main"]

HERE: Final = Path(__file__).resolve().parent
RESULTS: Final = HERE / "results"
RAW: Final = RESULTS / "benchmarks.json"
TABLE: Final = RESULTS / "RESULTS.md"
#: The training steps against PyTorch's APIs, included as written by the pages that quote them.
STEPS: Final = RESULTS / "training-steps.md"
#: How a page includes STEPS (pymdownx.snippets, from the repository's root).
STEPS_INCLUDE: Final = f'--8<-- "{STEPS.relative_to(HERE.parent)}"'
ROOT: Final = HERE.parent
PLOT: Final = ROOT / "docs" / "images" / "apply_scaling.png"
PAGE: Final = ROOT / "docs" / "performance.md"
#: The performance page carries the latest RESULTS.md between these two lines.
PAGE_START: Final = "<!-- benchmark results: written by make bench -->"
PAGE_END: Final = "<!-- end of benchmark results -->"

PLOT_CAPTION: Final = "Apply time against module count, log-log"
#: How RESULTS.md names the plot; the page shows the plot itself in its place.
PLOT_LINE: Final = f"Plot: `{PLOT.relative_to(ROOT)}` (apply time against module count, log-log)."

OURS: Final = "torchcontract"
TORCH: Final = "torch"

#: Targets, ratio torchcontract / torch, by workload and model size (None: no blocks).
RATIO_TARGETS: Final[dict[tuple[str, int | None], float]] = {
    ("apply to one nn.Linear", None): 0.5,
    ("root apply", 8): 0.3,
    ("root apply", 512): 0.15,
    ("FSDP pattern", 8): 0.35,
    ("FSDP pattern", 512): 0.3,
    ("state() lookup", 512): 0.5,
    ("update()", 512): 2.0,
}
#: fully_shard's training step on a fake 2-rank group (bench_fully_shard_overhead.py): the
#: CPU work a GPU waits on for a small model, in fp32 and bf16; target at most torch's.
OVERHEAD_WORKLOAD: Final = "fully_shard step, CPU work on a fake group ({})"
OVERHEAD_BLOCKS: Final = 8
RATIO_TARGETS.update(
    {(OVERHEAD_WORKLOAD.format(precision), OVERHEAD_BLOCKS): 1.0 for precision in ("fp32", "bf16")}
)
#: Targets of training steps, the in-rank ratio over alternating steps: replicate against
#: DDP, fully_shard against PyTorch's fully_shard; with prefetch, on a model whose
#: all-gathers weigh, at most torch's step.
ALTERNATING_TARGETS: Final = {"replicate": 1.0, "fully_shard": 1.2, "fully_shard prefetch": 1.0}
GROWTH_TARGET: Final = 9.0  # time at 512 blocks over time at 64 blocks, root apply
GROWTH_FROM, GROWTH_TO = 64, 512

#: fully_shard on every layer then the root of meta-device Llama-7B stacks, 64 fake ranks
#: (bench_fully_shard_scale.py). Targets: at most torch's time at every size, and growth
#: from 128 to 1,024 layers within 10% of the growth in modules.
SCALE_WORKLOAD: Final = "fully_shard per layer then root, meta Llama-7B layers, 64 fake ranks"
#: How the tables name that workload (the text above them says what it is).
SCALE_LABEL: Final = "fully_shard at scale"
SCALE_RATIO_TARGET: Final = 1.0
SCALE_GROWTH_FROM, SCALE_GROWTH_TO = 128, 1024
SCALE_GROWTH_SLACK: Final = 1.1

#: Options of every run: a short time budget per calibrated benchmark. Each file
#: picks its timer (a ``benchmark`` mark); the table says which rows are wall time.
PYTEST_OPTIONS: Final = (
    "-q",
    "-p",
    "no:cacheprovider",
    "--benchmark-group-by=group",
    "--benchmark-sort=name",
    "--benchmark-columns=median,min,max,rounds",
    "--benchmark-max-time=0.5",
    "--benchmark-min-rounds=5",
)


@attrs.frozen
class Result:
    """One benchmark's median, with what it measured."""

    workload: str
    library: str
    blocks: int | None
    modules: int | None
    median: float  # seconds per round
    rounds: int
    calls: int | None  # calls per round, when a round repeats one small call
    bytes_per_module: float | None
    timer: str  # the timer's name, e.g. "time.process_time"
    # Training steps: in-rank median over alternating steps of both libraries, and its ratio.
    alternating_ms: float | None = None
    alternating_ratio: float | None = None
    # Growth from a smaller size timed in each round next to this size's round: the median
    # of the rounds' ratios (each pair measured seconds apart, under the same load).
    paired_growth: float | None = None

    @property
    def per_call(self) -> float:
        """The median divided by the calls a round makes (the median itself if one)."""
        return self.median / (self.calls or 1)


def run_suite(selection: Sequence[str]) -> None:
    """Run the benchmarks with pytest-benchmark, writing the raw JSON; exit if they fail."""
    RESULTS.mkdir(exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pytest",
        str(HERE),
        *PYTEST_OPTIONS,
        f"--benchmark-json={RAW}",
        *selection,
    ]
    completed = subprocess.run(command, cwd=HERE.parent, check=False)
    if completed.returncode != 0:
        sys.exit(f"benchmarks failed (pytest exit status {completed.returncode})")


def load(path: Path) -> tuple[list[Result], dict[str, Any]]:
    """The results in ``path`` and the whole JSON document."""
    document: dict[str, Any] = json.loads(path.read_text())
    results = [
        result
        for entry in document["benchmarks"]
        for result in (_result(entry), _interleaved_torch(entry))
        if result is not None
    ]
    return results, document


def _interleaved_torch(entry: dict[str, Any]) -> Result | None:
    """Torch's result timed by hand between the rounds of ours, where a benchmark did so."""
    info: dict[str, Any] = entry.get("extra_info", {})
    rounds: list[float] | None = info.get("interleaved_torch_seconds")
    if not rounds:
        return None
    return attrs.evolve(
        _result(entry),
        library=TORCH,
        median=statistics.median(rounds),
        rounds=len(rounds),
        paired_growth=_paired_growth(info, TORCH, rounds),
    )


def _result(entry: dict[str, Any]) -> Result:
    info: dict[str, Any] = entry.get("extra_info", {})
    param = str(entry.get("param") or "")
    # A benchmark that does not call harness.label: its first parameter names the library.
    library = info.get("library") or param.split("-", maxsplit=1)[0] or entry["name"]
    return Result(
        workload=str(info.get("workload") or entry.get("group") or entry["name"]),
        library=str(library),
        blocks=info.get("blocks"),
        modules=info.get("modules"),
        median=float(entry["stats"]["median"]),
        rounds=int(entry["stats"]["rounds"]),
        calls=info.get("calls"),
        bytes_per_module=info.get("bytes_per_module"),
        timer=str(entry.get("options", {}).get("timer", "")),
        alternating_ms=info.get("alternating_median_ms"),
        alternating_ratio=info.get("alternating_ratio_to_torch"),
        paired_growth=_paired_growth(info, OURS, entry["stats"].get("data") or []),
    )


def _paired_growth(info: dict[str, Any], library: str, rounds: list[float]) -> float | None:
    """The median over rounds of ``rounds[i]`` over ``library``'s paired small-end round ``i``."""
    base: list[float] = (info.get("paired_base_seconds") or {}).get(library) or []
    if not base or len(base) != len(rounds):
        return None
    return statistics.median(large / small for large, small in zip(rounds, base, strict=True))


def format_time(seconds: float) -> str:
    """``seconds`` in the unit that keeps three significant digits readable."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _verdict(value: float, target: float) -> str:
    return f"≤ {target:g}: {'met' if value <= target else 'MISSED'}"


def _rows(results: Sequence[Result]) -> list[tuple[str, int | None, dict[str, Result]]]:
    """Results grouped by (workload, blocks), in the order the suite ran them."""
    groups: dict[tuple[str, int | None], dict[str, Result]] = {}
    for result in results:
        groups.setdefault((result.workload, result.blocks), {})[result.library] = result
    return [(workload, blocks, by_library) for (workload, blocks), by_library in groups.items()]


def _alternating_target(workload: str) -> float:
    if "fully_shard prefetch" in workload:
        return ALTERNATING_TARGETS["fully_shard prefetch"]
    api = "fully_shard" if "fully_shard" in workload else "replicate"
    return ALTERNATING_TARGETS[api]


def _is_step(workload: str) -> bool:
    return workload.startswith("training step")


def time_table(results: Sequence[Result], *, steps: bool = False) -> list[str]:
    """The markdown table of medians, torchcontract and torch side by side.

    The training steps (``steps=True``) or everything else: the steps have a table of
    their own, which the pages that quote them include.
    """
    lines = [
        "| workload | blocks | modules | torchcontract | torch | ratio | target |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    notes: list[str] = []
    for workload, blocks, by_library in _rows(results):
        if _is_step(workload) != steps:
            continue
        ours, theirs = by_library.get(OURS), by_library.get(TORCH)
        any_result = next(iter(by_library.values()))
        per_call = " per call" if any_result.calls else ""
        if "process_time" not in any_result.timer:
            per_call += " (wall time)"
        ratio = ours.per_call / theirs.per_call if ours and theirs else None
        target = RATIO_TARGETS.get((workload, blocks))
        if workload == SCALE_WORKLOAD:
            target = SCALE_RATIO_TARGET
        others = ", ".join(
            f"{name}: {format_time(result.per_call)}"
            for name, result in by_library.items()
            if name not in (OURS, TORCH)
        )
        if ours and theirs and ours.alternating_ratio is not None:
            others = (
                f"in-rank, alternating: {ours.alternating_ms} ms vs {theirs.alternating_ms} ms, "
                f"ratio {ours.alternating_ratio:.3f} "
                f"({_verdict(ours.alternating_ratio, _alternating_target(workload))})"
            )
            for name, result in by_library.items():
                if name not in (OURS, TORCH) and result.alternating_ms and ours.alternating_ms:
                    others += (
                        f"; {name}: {result.alternating_ms} ms, {OURS} / it "
                        f"{ours.alternating_ms / result.alternating_ms:.3f}"
                    )
        label = SCALE_LABEL if workload == SCALE_WORKLOAD else workload
        if others:
            notes.append(f"- {label}{per_call}, {blocks or ''} blocks: {others}")
        lines.append(
            f"| {label}{per_call} | {blocks if blocks is not None else ''} "
            f"| {any_result.modules or ''} "
            f"| {format_time(ours.per_call) if ours else ''} "
            f"| {format_time(theirs.per_call) if theirs else ''} "
            f"| {f'{ratio:.2f}' if ratio is not None else ''} "
            f"| {_verdict(ratio, target) if ratio is not None and target else ''} |"
        )
    return [*lines, "", *notes] if notes else lines


def growth_table(results: Sequence[Result]) -> list[str]:
    """Time at 512 blocks over time at 64 blocks, per workload and library.

    Where the 512-block rounds had 64-block rounds paired with them, the growth is the
    median of the paired rounds' ratios; elsewhere the ratio of the two sizes' medians.
    The root apply's target: at most ``GROWTH_TARGET``, and below torch's growth.
    """
    by_key = {(r.workload, r.library, r.blocks): r for r in results}
    lines = [
        f"| workload | modules {GROWTH_FROM} → {GROWTH_TO} blocks | torchcontract | torch "
        "| target |",
        "|---|---:|---:|---:|---|",
    ]
    workloads = dict.fromkeys(r.workload for r in results if r.blocks == GROWTH_TO)
    for workload in workloads:
        growth: dict[str, float] = {}
        size = ""
        for library in (OURS, TORCH):
            small = by_key.get((workload, library, GROWTH_FROM))
            large = by_key.get((workload, library, GROWTH_TO))
            if small and large:
                growth[library] = large.paired_growth or large.median / small.median
                if small.modules and large.modules:
                    size = f"×{large.modules / small.modules:.2f}"
        if not growth:
            continue
        target = ""
        if workload == "root apply" and OURS in growth:
            target = _verdict(growth[OURS], GROWTH_TARGET)
            if TORCH in growth:
                below = "met" if growth[OURS] < growth[TORCH] else "MISSED"
                target += f"; below torch's: {below}"
        cells = [f"×{growth[name]:.2f}" if name in growth else "" for name in (OURS, TORCH)]
        lines.append(f"| {workload} | {size} | {cells[0]} | {cells[1]} | {target} |")
    return lines


def _scale_growth_target(results: Sequence[Result]) -> float:
    """Linear growth in modules from the small to the large end, plus the slack."""
    modules = {r.blocks: r.modules for r in results if r.workload == SCALE_WORKLOAD}
    small, large = modules.get(SCALE_GROWTH_FROM), modules.get(SCALE_GROWTH_TO)
    return SCALE_GROWTH_SLACK * large / small if small and large else 0.0


def scale_growth_table(results: Sequence[Result]) -> list[str]:
    """fully_shard at scale: time at 1,024 layers over time at 128, against module growth.

    One row from paired rounds (the target's), one from each size's own rounds.
    """
    by_key = {(r.library, r.blocks): r for r in results if r.workload == SCALE_WORKLOAD}
    target = _scale_growth_target(results)
    if not target:
        return []
    lines = [
        f"| measured from | modules {SCALE_GROWTH_FROM} → {SCALE_GROWTH_TO} layers "
        "| torchcontract | torch | target |",
        "|---|---:|---:|---:|---|",
    ]
    for paired in (True, False):
        growth: dict[str, float] = {}
        for library in (OURS, TORCH):
            small = by_key.get((library, SCALE_GROWTH_FROM))
            large = by_key.get((library, SCALE_GROWTH_TO))
            if paired and large and large.paired_growth:
                growth[library] = large.paired_growth
            elif not paired and small and large:
                growth[library] = large.median / small.median
        if OURS not in growth:
            continue
        how = "paired rounds" if paired else "each size's own rounds"
        cells = [f"×{growth[name]:.2f}" if name in growth else "" for name in (OURS, TORCH)]
        verdict = _verdict(growth[OURS], round(target, 2)) if paired else ""
        linear = target / SCALE_GROWTH_SLACK
        lines.append(f"| {how} | ×{linear:.2f} | {cells[0]} | {cells[1]} | {verdict} |")
    return lines


def per_module_table(results: Sequence[Result], workload: str = "root apply") -> list[str]:
    """``workload``'s median divided by the module count, at every size: where growth bends."""
    sized = sorted({r.blocks for r in results if r.workload == workload and r.blocks and r.modules})
    if not sized:
        return []
    by_key = {(r.library, r.blocks): r for r in results if r.workload == workload}
    lines = [
        f"| {SCALE_LABEL if workload == SCALE_WORKLOAD else workload}, per module | "
        + " | ".join(f"{blocks} blocks" for blocks in sized)
        + " |",
        "|---|" + "---:|" * len(sized),
    ]
    for library in (OURS, TORCH):
        cells = []
        for blocks in sized:
            result = by_key.get((library, blocks))
            cells.append(
                format_time(result.median / result.modules) if result and result.modules else ""
            )
        lines.append(f"| {library} | " + " | ".join(cells) + " |")
    return lines


def memory_table(results: Sequence[Result]) -> list[str]:
    """Bytes kept per module, where a benchmark measured them."""
    measured = [r for r in results if r.bytes_per_module is not None]
    if not measured:
        return []
    lines = [
        "| workload | blocks | modules | torchcontract | torch |",
        "|---|---:|---:|---:|---:|",
    ]
    for workload, blocks, by_library in _rows(measured):
        ours, theirs = by_library.get(OURS), by_library.get(TORCH)
        any_result = next(iter(by_library.values()))
        lines.append(
            f"| {workload}: bytes kept per module | {blocks} | {any_result.modules} "
            f"| {f'{ours.bytes_per_module:.0f} B' if ours else ''} "
            f"| {f'{theirs.bytes_per_module:.0f} B' if theirs else ''} |"
        )
    return lines


def machine(document: dict[str, Any]) -> str:
    """CPU model, cores, load, Python and torch versions, and when the run happened."""
    info: dict[str, Any] = document["machine_info"]
    cpu = _cpu_model() or info.get("cpu", {}).get("brand_raw") or "unknown"
    load = info.get("load_average")
    loaded = (
        f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) at the start"
        if load
        else "load not recorded"
    )
    return (
        f"{cpu}, {info.get('cpu_count') or os.cpu_count()} cores, {loaded}, "
        f"{platform.system()} {platform.machine()}; "
        f"Python {platform.python_version()}, torch {_version('torch')}, "
        f"torchcontract {_version('torchcontract')}, pytest-benchmark "
        f"{_version('pytest-benchmark')}; run {document['datetime'][:19].replace('T', ' ')} UTC"
    )


def _cpu_model() -> str | None:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or None
    names = (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    return next(names, None)


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def markdown(results: Sequence[Result], document: dict[str, Any]) -> str:
    """The whole RESULTS.md."""
    memory = memory_table(results)
    parts = [
        "# Benchmark results",
        "",
        f"Machine: {machine(document)}.",
        "",
        "Reproduce with `make bench` (`python -m benchmarks.report`). Every workload ran "
        "through torchcontract and through `torch.distributed._composable.contract` (the "
        "fully_shard rows: through PyTorch's own `fully_shard`) in the same run. Times are "
        "medians of CPU time (`time.process_time`) per round unless a "
        "row says wall time; rounds "
        "that apply an API each get a freshly built model, built untimed; then the CPU "
        "caches are evicted (a program builds its model long before it applies an API) and "
        "every live object is frozen out of the garbage collector's reach until the round "
        "ends (`gc.freeze`). Lookups and updates are timed over every block of the "
        "model and shown per call. Model: per block two LayerNorms, attention with q/k/v/o "
        "Linear layers, an MLP with up/act/down/dropout (13 modules, 16 parameters). "
        f'The rows "{SCALE_LABEL}": {SCALE_WORKLOAD}. The rows "fully_shard step, CPU '
        'work on a fake group": one training step (forward, backward, SGD) of the demo GPT '
        f"with {OVERHEAD_BLOCKS} blocks, each block and the root sharded, under PyTorch's "
        "fake process group of 2 ranks (collectives cost nothing) with tensors small enough "
        "that a step's time is the CPU work a GPU would wait on; torch's steps alternate "
        "with ours.",
        "",
        *time_table(results),
        "",
        *steps_section(results, document),
        "",
        f"Growth from {GROWTH_FROM} to {GROWTH_TO} blocks (time at {GROWTH_TO} over time at "
        f"{GROWTH_FROM}; the module count grows ×{_module_growth(results)}, so that is linear). "
        "The one-Linear apply, the root apply and the FSDP pattern time torch's contract in "
        "rounds interleaved with ours; the latter two time both libraries at "
        f"{GROWTH_FROM} blocks in every {GROWTH_TO}-block round: their growth is the median "
        "of those paired rounds' ratios:",
        "",
        *growth_table(results),
        "",
        "Root apply per module, size by size (a flat row is linear growth; a step "
        "between two sizes and flat on both sides of it is a cost per module that "
        "changed there, as when the tree outgrows a CPU cache):",
        "",
        *per_module_table(results),
        "",
    ]
    scale = scale_growth_table(results)
    if scale:
        parts += [
            f"fully_shard at scale: growth from {SCALE_GROWTH_FROM} to {SCALE_GROWTH_TO} "
            "layers (fully_shard on every layer, then the root, of a meta-device stack of "
            "Llama-7B layers, 12 modules and 9 parameters each, under PyTorch's fake process "
            "group of 64 ranks; torch's rounds alternate with ours; 4,096 layers is one "
            "round of each). The target, linear growth plus 10%, applies to paired rounds, the "
            "median of each round's ratio: "
            f"{SCALE_GROWTH_FROM}-layer rounds of both libraries timed between the "
            f"{SCALE_GROWTH_TO}-layer rounds, under the same load; each size's own rounds, "
            "minutes apart, are shown too:",
            "",
            *scale,
            "",
            *per_module_table(results, SCALE_WORKLOAD),
            "",
        ]
    if memory:
        parts += [
            "Memory (tracemalloc, bytes still allocated after the apply and a full "
            "collection, divided by the modules the API was applied to):",
            "",
            *memory,
            "",
        ]
    parts += [PLOT_LINE, ""]
    return "\n".join(parts)


def steps_section(results: Sequence[Result], document: dict[str, Any]) -> list[str]:
    """The training steps against DDP and FSDP2, with the run's machine: STEPS' text."""
    return [
        "Training steps, `replicate` against `DistributedDataParallel` and `fully_shard` against "
        "PyTorch's `fully_shard`, on 2 gloo ranks (wall time; the targets apply to the in-rank "
        f"medians of alternating steps). Written by `make bench` on {machine(document)}:",
        "",
        *steps_table(results),
    ]


def steps_table(results: Sequence[Result]) -> list[str]:
    """The training steps: each library's median, and the in-rank alternating medians.

    A step timed for a third variant too (ours without prefetch) gets a note under the
    table: its medians and ours over its alternating median.
    """
    lines = [
        "| training step, 2 gloo ranks | torchcontract | torch | ratio "
        "| in-rank, alternating: torchcontract | torch | ratio | target |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    notes: list[str] = []
    for workload, _, by_library in _rows(results):
        ours, theirs = by_library.get(OURS), by_library.get(TORCH)
        if not _is_step(workload) or not ours or not theirs:
            continue
        name = workload.removeprefix("training step, ").replace(" on 2 gloo ranks", "")
        name = f"{name}, replicate" if "fully_shard" not in name else name
        alternating = ours.alternating_ratio
        lines.append(
            f"| {name} | {format_time(ours.per_call)} | {format_time(theirs.per_call)} "
            f"| {ours.per_call / theirs.per_call:.2f} "
            f"| {ours.alternating_ms or ''} ms | {theirs.alternating_ms or ''} ms "
            f"| {f'{alternating:.3f}' if alternating is not None else ''} "
            f"| {_verdict(alternating, _alternating_target(workload)) if alternating else ''} |"
        )
        notes += [
            _other_step_note(name, other, ours)
            for other in by_library.values()
            if other is not ours and other is not theirs
        ]
    return [*lines, "", *notes] if notes else lines


def _other_step_note(step: str, other: Result, ours: Result) -> str:
    """A note on ``other``'s step (a third variant of ``step``), beside ours and torch's."""
    note = f"- {step}, {other.library}: {format_time(other.per_call)}"
    if other.alternating_ms is not None:
        note += f"; in-rank, alternating: {other.alternating_ms} ms"
        if other.alternating_ratio is not None:
            note += f", ratio to torch {other.alternating_ratio:.3f}"
        if ours.alternating_ms is not None:
            note += f"; {OURS} / it {ours.alternating_ms / other.alternating_ms:.3f}"
    return note


def _module_growth(results: Iterable[Result]) -> str:
    sizes = {r.blocks: r.modules for r in results if r.modules}
    small, large = sizes.get(GROWTH_FROM), sizes.get(GROWTH_TO)
    return f"{large / small:.2f}" if small and large else "?"


def plot(results: Sequence[Result], path: Path) -> None:
    """Log-log apply time against module count, both libraries, each apply workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 5))
    colours = {OURS: "tab:blue", TORCH: "tab:orange"}
    styles = (("root apply", "-o"), ("FSDP pattern", "--s"), ("list apply", ":^"))
    for workload, style in (*styles, (SCALE_WORKLOAD, "-.d")):
        for library in (OURS, TORCH):
            points = sorted(
                (r.modules, r.median)
                for r in results
                if r.workload == workload and r.library == library and r.modules
            )
            if points:
                axes.plot(
                    [modules for modules, _ in points],
                    [median * 1e3 for _, median in points],
                    style,
                    color=colours[library],
                    label=f"{library}: {workload}",
                )
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("modules in the model")
    axes.set_ylabel("median time (ms, CPU)")
    axes.set_title("Applying an API: torchcontract vs torch's contract")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def update_page(results_markdown: str) -> None:
    """Replace the performance page's results with ``results_markdown``, the plot shown inline."""
    page = PAGE.read_text()
    start, end = page.index(PAGE_START), page.index(PAGE_END)
    body = results_markdown.replace("# Benchmark results\n\n", "", 1).replace(
        PLOT_LINE, f"![{PLOT_CAPTION}]({PLOT.relative_to(PAGE.parent)})"
    )
    steps = STEPS.read_text().strip()
    body = body.replace(steps, STEPS_INCLUDE)
    PAGE.write_text(f"{page[: start + len(PAGE_START)]}\n{body.strip()}\n{page[end:]}")


def main(argv: Sequence[str] | None = None) -> None:
    """Run the suite (unless ``--no-run``), write RESULTS.md, the plot and the page's tables."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__)
    parser.add_argument(
        "--no-run", action="store_true", help="rebuild the table and plot from the last JSON"
    )
    # Anything else goes to pytest, e.g. -k root_apply to run some benchmarks only.
    arguments, selection = parser.parse_known_args(argv)
    if not arguments.no_run:
        run_suite(selection)
    results, document = load(RAW)
    text = markdown(results, document)
    TABLE.write_text(text)
    STEPS.write_text("\n".join(steps_section(results, document)) + "\n")
    plot(results, PLOT)
    update_page(text)
    print()
    print(text)
    print(
        f"Wrote {TABLE.relative_to(ROOT)}, {STEPS.relative_to(ROOT)}, {PLOT.relative_to(ROOT)} "
        f"and {PAGE.relative_to(ROOT)}."
    )


if __name__ == "__main__":
    main()
