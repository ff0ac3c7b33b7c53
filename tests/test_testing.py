"""torchcontract.testing: run_distributed's process handling, check_api_invariants' checks."""

from __future__ import annotations

import ast
import importlib.machinery
import inspect
import os
import signal
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from commands import run_command
from torch import Tensor, nn

from torchcontract import contract
from torchcontract.apis import checkpoint
from torchcontract.testing import (
    ModelCase,
    RankFailedError,
    _launch,
    check_api_invariants,
    free_port,
    run_distributed,
)

# ----------------------------------------------------------------- rank functions


def _who(rank: int, world_size: int) -> tuple[int, int, int, int, str]:
    return rank, world_size, dist.get_rank(), dist.get_world_size(), dist.get_backend()


def _sum_over_ranks(rank: int, world_size: int, base: float) -> float:
    value = torch.tensor([base + rank])
    dist.all_reduce(value)
    return float(value)


def _tensors(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    return {"rank": torch.full((3,), float(rank)), "large": torch.arange(100_000.0)}


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one refuses")
    dist.barrier()  # waits for rank 1, which never comes: killed, not timed out


def _sleep_and_record_pid(rank: int, world_size: int, directory: str) -> None:
    Path(directory, f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(120)


def _exit_without_reporting(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)


def _wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.005)


def _exit_after_a_peer_failed(rank: int, world_size: int, directory: str) -> None:
    """Rank 0 fails first, with what gloo raises when a peer leaves; then rank 1 exits."""
    marker = Path(directory, "rank0-failed")
    # Both ranks have joined the group before rank 0 fails: a rank still joining when its
    # peer leaves fails there itself, with a peer's error, and the scenario is lost.
    dist.barrier()
    if rank == 0:
        marker.touch()
        raise RuntimeError("[pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer")
    _wait_for(marker)
    time.sleep(0.2)  # rank 0's report reaches the parent first
    os._exit(3)


def _raise_after_a_peer_failed(rank: int, world_size: int, directory: str) -> None:
    """Rank 0 fails first with a peer's connection error; then rank 1's function raises."""
    marker = Path(directory, "rank0-failed")
    dist.barrier()  # as above: both ranks are in the group before rank 0 fails
    if rank == 0:
        marker.touch()
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    _wait_for(marker)
    time.sleep(0.2)
    raise ValueError("rank one's own failure")


class UnpicklableError(Exception):
    def __init__(self) -> None:
        super().__init__("holds a lock")
        self.lock = threading.Lock()


def _raise_unpicklable(rank: int, world_size: int) -> None:
    raise UnpicklableError


# ----------------------------------------------------------------- run_distributed


def test_results_come_back_in_rank_order() -> None:
    assert run_distributed(_who, 2) == [(0, 2, 0, 2, "gloo"), (1, 2, 1, 2, "gloo")]


def test_args_reach_every_rank_and_collectives_work() -> None:
    assert run_distributed(_sum_over_ranks, 2, args=(10.0,)) == [21.0, 21.0]


def test_single_rank_group_works() -> None:
    assert run_distributed(_who, 1) == [(0, 1, 0, 1, "gloo")]


def test_ranks_may_return_tensors_which_come_back_by_value() -> None:
    """Not through memory the rank shares and frees as it exits (multiprocessing's way)."""
    results = run_distributed(_tensors, 2)
    assert [result["rank"].tolist() for result in results] == [[0.0] * 3, [1.0] * 3]
    assert all(torch.equal(result["large"], torch.arange(100_000.0)) for result in results)
    # Not rebuilt from shared memory, as multiprocessing's pickler makes them.
    assert not any(
        tensor.untyped_storage().is_shared() for result in results for tensor in result.values()
    )


def test_spawn_start_method_works() -> None:
    assert run_distributed(_who, 2, start_method="spawn") == [
        (0, 2, 0, 2, "gloo"),
        (1, 2, 1, 2, "gloo"),
    ]


def test_rank_exception_is_reraised_with_its_type() -> None:
    with pytest.raises(ValueError, match="rank one refuses"):
        run_distributed(_fail_on_rank_one, 2, timeout=60.0)


def test_reraised_exception_carries_the_rank_traceback_and_a_note() -> None:
    with pytest.raises(ValueError, match="rank one refuses") as caught:
        run_distributed(_fail_on_rank_one, 2, timeout=60.0)
    cause = caught.value.__cause__
    assert isinstance(cause, RankFailedError)
    assert "rank 1 of 2 raised" in str(cause)
    assert "in _fail_on_rank_one" in str(cause)
    assert 'raise ValueError("rank one refuses")' in str(cause)
    assert "raised on rank 1 of 2" in " ".join(caught.value.__notes__)


def test_hung_ranks_raise_timeout_error_naming_them(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish"):
        run_distributed(_sleep_and_record_pid, 2, timeout=1.0, args=(str(tmp_path),))


def test_the_timeout_error_shows_where_each_hung_rank_was(tmp_path: Path) -> None:
    # Long enough for both ranks to be in the function however loaded the machine is.
    with pytest.raises(TimeoutError) as caught:
        run_distributed(_sleep_and_record_pid, 2, timeout=10.0, args=(str(tmp_path),))
    sections = str(caught.value).split("\nrank ")[1:]
    assert [section.split(" was at:")[0] for section in sections] == ["0", "1"]
    assert all("in _sleep_and_record_pid" in section for section in sections)


def _return_then_hang_in_teardown(rank: int, world_size: int) -> int:
    def hang() -> None:
        time.sleep(120)

    vars(dist)["destroy_process_group"] = hang  # in this rank's process only
    return rank


def test_a_rank_hanging_in_teardown_holds_up_no_result() -> None:
    started = time.monotonic()
    assert run_distributed(_return_then_hang_in_teardown, 2, timeout=60.0) == [0, 1]
    assert time.monotonic() - started < 30


def test_hung_ranks_are_killed_at_the_timeout(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError):
        run_distributed(_sleep_and_record_pid, 2, timeout=3.0, args=(str(tmp_path),))
    pids = [int(path.read_text()) for path in sorted(tmp_path.glob("rank*.pid"))]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_rank_that_exits_without_reporting_raises_rank_failed_error() -> None:
    with pytest.raises(RankFailedError, match="rank 1 of 2 exited with code 3"):
        run_distributed(_exit_without_reporting, 2)


def _abort_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        os.abort()  # SIGABRT, as a native library's "double free" detected by glibc


def test_a_rank_killed_by_a_fatal_signal_shows_where_it_was() -> None:
    with pytest.raises(RankFailedError) as caught:
        run_distributed(_abort_on_rank_one, 2)
    message = str(caught.value)
    assert f"rank 1 of 2 exited with code -{signal.SIGABRT.value} without reporting" in message
    assert "Fatal Python error: Aborted" in message
    assert "in _abort_on_rank_one" in message


def test_a_rank_exiting_is_raised_over_a_peers_connection_error_that_came_first(
    tmp_path: Path,
) -> None:
    with pytest.raises(RankFailedError, match="rank 1 of 2 exited with code 3") as caught:
        run_distributed(_exit_after_a_peer_failed, 2, args=(str(tmp_path),))
    assert "then rank 0 failed: RuntimeError" in "".join(caught.value.__notes__)


def test_an_exception_from_the_function_is_raised_over_a_peers_connection_error(
    tmp_path: Path,
) -> None:
    with pytest.raises(ValueError, match="rank one's own failure") as caught:
        run_distributed(_raise_after_a_peer_failed, 2, args=(str(tmp_path),))
    assert "then rank 0 failed: RuntimeError" in "".join(caught.value.__notes__)


def test_unpicklable_exception_is_reported_with_its_traceback() -> None:
    with pytest.raises(RankFailedError, match=r"rank \d of 2 raised:(.|\n)*UnpicklableError"):
        run_distributed(_raise_unpicklable, 2)


def test_local_function_is_rejected_before_any_rank_starts() -> None:
    def local(rank: int, world_size: int) -> None:
        pass

    with pytest.raises(TypeError, match="pass a module-level function"):
        run_distributed(local, 2)


def test_world_size_below_one_is_rejected() -> None:
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        run_distributed(_who, 0)


def test_a_negative_grace_is_rejected() -> None:
    with pytest.raises(
        ValueError, match=r"run_distributed: grace must be at least 0 seconds, got -1"
    ):
        run_distributed(_who, 2, grace=-1.0)


#: A script that runs two ranks; the call is placed by ``{call}``.
_SCRIPT = """\
from torchcontract.testing import run_distributed


def ranks(rank: int, world_size: int) -> int:
    return rank


def main() -> None:
    print("ranks", run_distributed(ranks, 2, timeout=60.0))


{call}
"""


@pytest.mark.parametrize(
    ("call", "line"),
    [("print(run_distributed(ranks, 2))", 12), ("main()", 12)],
    ids=["the call itself", "a function making it"],
)
def test_a_script_calling_without_the_main_guard_is_refused_before_any_rank_starts(
    tmp_path: Path, call: str, line: int
) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(_SCRIPT.format(call=call))
    done = run_command((sys.executable, str(script)), timeout=120, cwd=tmp_path)
    assert done.returncode == 1
    assert (
        "torchcontract.testing.UnguardedMainError: run_distributed: called from the top level "
        f'of the script {script} (line {line}), outside `if __name__ == "__main__":`; '
        "each rank ('forkserver' start) imports the script again and would call "
        "run_distributed again. Put the call (or the call of the function that makes it) "
        'under `if __name__ == "__main__":`'
    ) in done.stderr
    assert "bootstrapping phase" not in done.stderr  # no rank started
    assert "ranks" not in done.stdout


def test_a_script_calling_under_the_main_guard_runs_its_ranks(tmp_path: Path) -> None:
    script = tmp_path / "guarded.py"
    script.write_text(_SCRIPT.format(call='if __name__ == "__main__":\n    main()'))
    done = run_command((sys.executable, str(script)), timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "ranks [0, 1]\n"


def test_the_main_guard_is_read_as_multiprocessing_reimports_the_main_module() -> None:
    from torchcontract.testing import _main_guard

    tree = ast.parse('x = 1\nif __name__ == "__main__":\n    x = 2\n    x = 3\nx = 4\n')
    assert [_main_guard._guarded(tree, line) for line in range(1, 6)] == [
        False,
        False,
        True,
        True,
        False,
    ]
    package_main = types.ModuleType("__main__")
    package_main.__spec__ = importlib.machinery.ModuleSpec("tool.__main__", None, origin="m.py")
    assert _main_guard._reimported_path(package_main) is None  # multiprocessing skips it
    module_main = types.ModuleType("__main__")
    module_main.__spec__ = importlib.machinery.ModuleSpec("tool.cli", None, origin="cli.py")
    assert _main_guard._reimported_path(module_main) == "cli.py"
    script = types.ModuleType("__main__")
    script.__file__ = "/bin/train"
    assert _main_guard._reimported_path(script) == "/bin/train"
    assert _main_guard._reimported_path(types.ModuleType("__main__")) is None  # python -c


def test_a_case_without_a_loss_sums_the_float_tensors_of_the_output() -> None:
    from torchcontract.testing._compare import sum_of_outputs

    def _first_output(output: Any) -> Tensor:
        return torch.as_tensor(output[0])

    assert ModelCase(Net, _inputs).loss is sum_of_outputs
    assert ModelCase(Net, _inputs, None).loss is sum_of_outputs
    assert ModelCase(Net, _inputs, _first_output).loss is _first_output


def test_the_default_grace_is_the_one_the_collector_uses() -> None:
    from torchcontract.testing._collect import GRACE_SECONDS

    assert inspect.signature(run_distributed).parameters["grace"].default == GRACE_SECONDS


def test_free_port_can_be_bound() -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", free_port()))


@pytest.mark.skipif(
    not Path("/proc/sys/net/ipv4/ip_local_port_range").exists(), reason="Linux lists the range"
)
def test_free_port_is_below_the_ports_the_system_hands_out_itself() -> None:
    """Those every connecting socket and ``bind(0)`` take: one could take it before its use."""
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(10_000 <= port < first_ephemeral for port in ports)
    assert len(ports) > 1  # drawn at random: two processes rarely draw the same


def test_free_port_skips_a_port_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        drawn = iter([busy, busy, 20_000])
        monkeypatch.setattr(_launch._pick, "randrange", lambda low, high: next(drawn))
        assert free_port() == 20_000


# ----------------------------------------------------------------- check_api_invariants


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Dropout(0.3))
        self.second = nn.Linear(12, 3)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.second(self.first(x))
        return out


def _inputs() -> tuple[Tensor]:
    return (torch.randn(5, 6),)


def _inputs_requiring_grad() -> tuple[Tensor]:
    return (torch.randn(5, 6, requires_grad=True),)


CASE = ModelCase(Net, _inputs)


def _double(module: nn.Module, args: object, output: Tensor) -> Tensor:
    return output * 2


@contract()
def doubling(module: nn.Module) -> None:
    module.register_forward_hook(_double)


@contract()
def cyclic(module: nn.Module) -> None:
    def hook(child: nn.Module, args: object, output: Tensor) -> None:
        assert module is not None  # the closure holds the module: a reference cycle

    module.register_forward_hook(hook)


def _extra_key(
    module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: dict[str, Any]
) -> None:
    state[prefix + "extra"] = torch.zeros(1)


@contract()
def renaming(module: nn.Module) -> None:
    hooked: Any = module  # torch leaves this method unannotated
    hooked.register_state_dict_post_hook(_extra_key)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_passes_the_invariants(use_reentrant: bool) -> None:
    # A reentrant region needs an input that requires grad to give parameters gradients.
    case = ModelCase(Net, _inputs_requiring_grad)
    report = check_api_invariants(checkpoint, case, use_reentrant=use_reentrant)
    assert report.parameters == 4
    assert report.output_difference <= 1e-6
    assert report.gradient_difference <= 1e-6


def _first(net: Net) -> nn.Sequential:
    # A function, not a lambda: mypy infers a lambda's result before it knows the model
    # type, so ``lambda net: net.first`` would give ``Tensor | Module`` as the target type.
    return net.first


def test_checkpoint_on_a_submodule_passes_the_invariants() -> None:
    case = ModelCase(Net, _inputs, target=_first)
    assert check_api_invariants(checkpoint, case).gradient_difference <= 1e-6


def test_api_that_changes_the_output_fails() -> None:
    with pytest.raises(AssertionError, match="doubling changed the forward output by"):
        check_api_invariants(doubling, CASE)


def test_api_allowed_to_change_numerics_passes_with_its_differences() -> None:
    report = check_api_invariants(doubling, ModelCase(Net, _inputs, same_numerics=False))
    assert report.output_difference > 0
    assert report.gradient_difference > 0


@contract()
def freezing(module: nn.Module) -> None:
    module.get_parameter("second.bias").requires_grad_(False)


def test_api_that_freezes_parameters_fails_when_numerics_must_be_the_same() -> None:
    with pytest.raises(AssertionError, match=r"gradients differ in which parameters have one"):
        check_api_invariants(freezing, CASE)


def test_api_that_freezes_parameters_passes_when_numerics_may_change() -> None:
    report = check_api_invariants(freezing, ModelCase(Net, _inputs, same_numerics=False))
    assert report.unmatched_gradients == ("second.bias",)
    assert report.parameters == 3
    assert report.output_difference == 0
    assert report.gradient_difference == 0


def test_api_whose_hook_holds_its_module_fails_as_a_cycle() -> None:
    with pytest.raises(AssertionError, match="a reference cycle"):
        check_api_invariants(cyclic, CASE)


def test_api_that_changes_state_dict_keys_fails() -> None:
    with pytest.raises(AssertionError, match="renaming changed the state_dict keys"):
        check_api_invariants(renaming, CASE)


def test_nondeterministic_model_builder_fails() -> None:
    counter = iter(range(100))

    def drifting() -> Net:
        net = Net()
        with torch.no_grad():
            net.second.bias.fill_(next(counter))
        return net

    with pytest.raises(AssertionError, match="make_model built different values"):
        check_api_invariants(checkpoint, ModelCase(drifting, _inputs))
