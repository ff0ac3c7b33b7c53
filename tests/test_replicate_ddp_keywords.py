"""replicate's signature is the installed DDP's, and each DDP keyword case ends as DDP's does.

The signature: ``DistributedDataParallel.__init__``'s names, in its order, with its
defaults, so a torch release that adds or moves a keyword fails here. Each case
(``device_ids``, ``output_device``, ``dim``, the buffer keywords, the deprecated and
paired ones) is run through both, in one process (a gloo group of one rank): both
accept it, or ours raises a subclass of the type DDP raises; both warn the same
warnings. The numbers behind the buffer keywords are compared on 2 ranks in
``tests/distributed/test_replicate_keywords_gloo.py``.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable
from typing import Any, Final, cast

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from torchcontract import ContractError
from torchcontract.apis import _compat, replicate
from torchcontract.apis.replicate import (
    InvalidKeywordError,
    KeywordNotInThisTorchError,
    UnsupportedKeywordError,
)
from torchcontract.apis.replicate._devices import Devices, MoveInputs, devices
from torchcontract.apis.replicate._reducer import reducer_of

pytestmark = pytest.mark.usefixtures("one_rank_group")

_DDP_INIT: Final = cast(Callable[..., None], vars(DistributedDataParallel)["__init__"])
#: DDP's parameters after ``self``, and ours: both start with the module.
THEIRS: Final = list(inspect.signature(_DDP_INIT).parameters.values())[1:]
OURS: Final = list(inspect.signature(replicate).parameters.values())
#: Where a parameter's position is the same in every torch release tested (2.6 on):
#: these are positional too, as DDP's; the rest are keyword-only.
POSITIONAL: Final = ("module", "device_ids", "output_device", "dim", "broadcast_buffers")


def test_replicate_takes_the_installed_ddps_keywords_in_its_order() -> None:
    ours = [parameter.name for parameter in OURS]
    theirs = [parameter.name for parameter in THEIRS]
    assert [name for name in ours if name in theirs] == theirs
    # Ours beyond the installed DDP's: keywords of a newer DDP, refused here as DDP would.
    for name in (name for name in ours if name not in theirs):
        assert name not in _compat.DDP_KEYWORDS


def test_replicate_has_the_installed_ddps_defaults() -> None:
    ours = {parameter.name: parameter.default for parameter in OURS}
    for parameter in THEIRS[1:]:
        if parameter.name == "broadcast_buffers" and parameter.default is True:
            # torch 2.6's DDP: True; 2.13 on, None, which means True (ours: None, so
            # that passing it, deprecated there, can be told from leaving it out).
            assert ours["broadcast_buffers"] is None
            continue
        assert ours[parameter.name] == parameter.default, parameter.name


def test_replicates_first_keywords_are_positional_as_ddps() -> None:
    kinds = {parameter.name: parameter.kind for parameter in OURS}
    assert [parameter.name for parameter in OURS[: len(POSITIONAL)]] == list(POSITIONAL)
    for parameter in THEIRS:
        assert parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        expected = (
            inspect.Parameter.POSITIONAL_OR_KEYWORD
            if parameter.name in POSITIONAL
            else inspect.Parameter.KEYWORD_ONLY
        )
        assert kinds[parameter.name] is expected, parameter.name


def test_a_keyword_of_a_newer_ddp_is_refused_with_a_type_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_compat, "DDP_KEYWORDS", _compat.DDP_KEYWORDS - {"forward_sync_buffers"})
    with pytest.raises(KeywordNotInThisTorchError, match=r"replicate on Linear: forward_sync_"):
        replicate(nn.Linear(2, 2), forward_sync_buffers=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation where DDP has no replacement
        replicate(nn.Linear(2, 2), broadcast_buffers=False)


class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.norm = nn.BatchNorm1d(2)


def _mesh_2d() -> Any:
    return init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))


def _hook_parameter(model: nn.Module) -> dict[str, Any]:
    return {"param_to_hook_all_reduce": next(model.parameters())}


def _delayed(model: nn.Module) -> dict[str, Any]:
    return {"delay_all_reduce_named_params": list(model.named_parameters())[:1]}


#: By name: the keywords, made from the model (a few name its parameters).
CASES: Final[dict[str, Callable[[nn.Module], dict[str, Any]]]] = {
    "no keyword": lambda model: {},
    "device_ids=None, output_device=None": lambda model: {
        "device_ids": None,
        "output_device": None,
    },
    "device_ids=[]": lambda model: {"device_ids": []},
    "device_ids=[0] on a CPU module": lambda model: {"device_ids": [0]},
    "device_ids=[cpu] on a CPU module": lambda model: {"device_ids": [torch.device("cpu")]},
    "device_ids=[0, 1]": lambda model: {"device_ids": [0, 1]},
    "device_ids=0": lambda model: {"device_ids": 0},
    "output_device=0 (falsy: DDP takes it)": lambda model: {"output_device": 0},
    "output_device=1 on a CPU module": lambda model: {"output_device": 1},
    "output_device=cpu on a CPU module": lambda model: {"output_device": torch.device("cpu")},
    "dim=1": lambda model: {"dim": 1},
    "broadcast_buffers=True": lambda model: {"broadcast_buffers": True},
    "broadcast_buffers=False": lambda model: {"broadcast_buffers": False},
    "broadcast_buffers=None": lambda model: {"broadcast_buffers": None},
    "forward_sync_buffers=True": lambda model: {"forward_sync_buffers": True},
    "forward_sync_buffers=False": lambda model: {"forward_sync_buffers": False},
    "broadcast_buffers and forward_sync_buffers": lambda model: {
        "broadcast_buffers": False,
        "forward_sync_buffers": True,
    },
    "check_reduction=True": lambda model: {"check_reduction": True},
    "check_reduction=False": lambda model: {"check_reduction": False},
    "init_sync=False": lambda model: {"init_sync": False},
    "batched_grad_copy=True": lambda model: {"batched_grad_copy": True},
    "bucket_cap_mb_list=[1]": lambda model: {"bucket_cap_mb_list": [1]},
    "skip_all_reduce_unused_params=False": lambda model: {"skip_all_reduce_unused_params": False},
    "delay_all_reduce_named_params alone": _delayed,
    "param_to_hook_all_reduce alone": _hook_parameter,
    "mixed_precision=None": lambda model: {"mixed_precision": None},
    "process_group and device_mesh": lambda model: {
        "process_group": torch.distributed.group.WORLD,
        "device_mesh": init_device_mesh("cpu", (1,)),
    },
    "a 2-D device_mesh": lambda model: {"device_mesh": _mesh_2d()},
}


def _outcome(
    build: Callable[[nn.Module], object], keywords: Callable[[nn.Module], dict[str, Any]]
) -> tuple[type[BaseException] | None, list[type[Warning]]]:
    """The exception type ``build(model, **keywords)`` raised (or None), and its warnings."""
    torch.manual_seed(0)
    model = _WithBuffer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            build(model, **keywords(model))
        except Exception as error:
            return type(error), []
    return None, [w.category for w in caught if issubclass(w.category, FutureWarning)]


@pytest.mark.parametrize("name", list(CASES))
def test_each_ddp_keyword_case_ends_as_ddps(name: str) -> None:
    ours, ours_warned = _outcome(replicate, CASES[name])
    newer = set(CASES[name](nn.Linear(1, 1))) - _compat.DDP_KEYWORDS
    if newer:
        # A keyword of a newer DDP: refused where given another value than its default, as
        # this torch's DDP refuses it; at its default it changes nothing, and is taken.
        defaults = {parameter.name: parameter.default for parameter in OURS}
        keywords = CASES[name](nn.Linear(1, 1))
        at_default = all(keywords[keyword] == defaults[keyword] for keyword in newer)
        assert ours is (None if at_default else KeywordNotInThisTorchError)
        return
    theirs, theirs_warned = _outcome(DistributedDataParallel, CASES[name])
    if theirs is None:
        assert ours is None
        assert ours_warned == theirs_warned
        return
    assert ours is not None
    assert issubclass(ours, theirs), (ours, theirs)
    if theirs is not TypeError:  # a wrong type is a plain TypeError, as everywhere
        assert issubclass(ours, ContractError)


def test_the_cases_cover_acceptance_refusal_and_warnings() -> None:
    """What the comparison rests on: DDP accepts some, refuses others, warns for some."""
    outcomes = {name: _outcome(DistributedDataParallel, CASES[name]) for name in CASES}
    assert outcomes["device_ids=None, output_device=None"] == (None, [])
    assert outcomes["output_device=0 (falsy: DDP takes it)"] == (None, [])
    assert outcomes["device_ids=[0] on a CPU module"][0] is ValueError
    assert outcomes["device_ids=[0, 1]"][0] is ValueError
    assert outcomes["check_reduction=True"] == (None, [FutureWarning])
    if "forward_sync_buffers" in _compat.DDP_KEYWORDS:
        assert outcomes["broadcast_buffers=False"] == (None, [FutureWarning])
        assert outcomes["broadcast_buffers=None"] == (None, [])
    else:
        assert outcomes["forward_sync_buffers=False"][0] is TypeError


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        (
            {"device_ids": [0]},
            r"replicate on Linear: device_ids and output_device are for a module on one ",
        ),
        ({"output_device": 1}, r"parameters are on \['cpu'\]; leave both None"),
        ({"device_ids": [0, 1]}, r"device_ids can hold one device at most .* got 2; pass "),
    ],
)
def test_a_device_keyword_ddp_refuses_is_named_with_what_to_do(
    keywords: dict[str, Any], message: str
) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(InvalidKeywordError, match=message):
        replicate(model, **keywords)
    assert type(model) is nn.Linear  # nothing half-applied


def test_device_ids_as_a_number_is_a_type_error_saying_what_to_pass() -> None:
    with pytest.raises(TypeError, match=r"device_ids takes a list of one device .* got int 0"):
        replicate(nn.Linear(2, 2), device_ids=0)  # type: ignore[arg-type]


@pytest.mark.skipif(
    "forward_sync_buffers" not in _compat.DDP_KEYWORDS,
    reason=f"torch {torch.__version__}'s DDP does not deprecate broadcast_buffers",
)
def test_broadcast_buffers_warns_its_deprecation_naming_replicate_and_the_replacement() -> None:
    with pytest.warns(FutureWarning, match=r"replicate on Linear: broadcast_buffers is deprecat"):
        replicate(nn.Linear(2, 2), broadcast_buffers=True)
    with pytest.warns(FutureWarning, match=r"both broadcast_buffers and forward_sync_buffers"):
        replicate(nn.Linear(2, 2), broadcast_buffers=True, forward_sync_buffers=False)


#: DDP's keywords replicate does not implement: the keywords, and what the refusal says.
UNSUPPORTED: Final[dict[str, tuple[Callable[[nn.Module], dict[str, Any]], str]]] = {
    "delay_all_reduce_named_params": (
        lambda model: {**_delayed(model), **_hook_parameter(model)},
        r"delay_all_reduce_named_params= is not implemented",
    ),
    "skip_all_reduce_unused_params": (
        lambda model: {"skip_all_reduce_unused_params": True},
        r"skip_all_reduce_unused_params= is not implemented; leave it False",
    ),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_a_ddp_keyword_replicate_does_not_implement_is_refused_where_given(name: str) -> None:
    make, message = UNSUPPORTED[name]
    model = nn.Linear(2, 2)
    keywords = make(model)
    if any(keyword not in _compat.DDP_KEYWORDS for keyword in keywords):
        pytest.skip(f"torch {torch.__version__}'s DDP lacks {sorted(keywords)}")
    with pytest.raises(UnsupportedKeywordError, match=message):
        replicate(model, **keywords)


def test_the_pair_ddp_refuses_alone_is_named() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(InvalidKeywordError, match=r"param_to_hook_all_reduce go together"):
        replicate(model, **_hook_parameter(model))


def test_device_ids_is_positional_as_ddps() -> None:
    model = replicate(nn.Linear(2, 2), None, None)
    assert replicate.state(model).broadcast_buffers


def test_device_ids_on_a_module_on_one_accelerator_device_names_where_inputs_go() -> None:
    """The branch only an accelerator reaches, on the meta device: DDP's resolution."""
    parameters = list(nn.Linear(2, 2, device="meta").parameters())
    resolved = devices(nn.Linear(2, 2), parameters, [0], None)
    assert resolved == Devices((0,), 0, torch.device("meta", 0))
    assert devices(nn.Linear(2, 2), parameters, [0], 3).output_device == 3
    assert devices(nn.Linear(2, 2), parameters, None, None) == Devices(None, None, None)


def test_the_input_hook_copies_every_tensor_of_the_arguments_to_the_device() -> None:
    model = replicate(nn.Linear(2, 2))
    reducer = reducer_of(model)
    assert reducer is not None
    hook = MoveInputs(reducer, torch.device("meta"))
    moved = hook(model, (torch.ones(2), 3), {"mask": torch.zeros(1)})
    assert moved is not None
    args, kwargs = moved
    assert args[0].device.type == "meta"
    assert args[1] == 3
    assert kwargs["mask"].device.type == "meta"
    # Copies get an inert hook: it acts for the application that installed it only.
    assert copy.deepcopy(hook)(model, (torch.ones(2),), {}) is None
    assert hook(nn.Linear(2, 2), (torch.ones(2),), {}) is None
