"""Incompatible rules: APIs that cannot be combined on a module or around it."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import get_args

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.distributed._composable.checkpoint_activation import checkpoint as torch_checkpoint

from torchcontract import (
    ArgumentBindingError,
    ContractError,
    Incompatible,
    IncompatibleAPIError,
    RegistryEntry,
    RulePredicateError,
    StateStore,
    TorchAPIName,
    UnknownRuleScopeError,
    UnknownTorchAPIError,
    contract,
    registry,
    take_snapshot,
)
from torchcontract._registry import check_compatible


@contract(store=StateStore())
def marked(module: nn.Module) -> None:
    pass


@contract(incompatible_with=[Incompatible(marked)])
def exclusive(module: nn.Module | list[nn.Module]) -> None:
    pass


@contract(incompatible_with=[Incompatible(marked, scope="module")])
def local(module: nn.Module) -> None:
    pass


@contract()
def checkpointing(module: nn.Module, *, use_reentrant: bool = True) -> None:
    pass


def _reentrant(entry: RegistryEntry) -> bool:
    return bool(entry.arguments["use_reentrant"])


@contract(incompatible_with=[Incompatible(checkpointing, when=_reentrant)])
def sharding(module: nn.Module) -> None:
    pass


@contract(incompatible_with=[Incompatible("checkpoint")])
def needs_plain_forward(module: nn.Module) -> None:
    pass


@contract(incompatible_with=[Incompatible("checkpoint", scope="module")])
def needs_plain_forward_here(module: nn.Module) -> None:
    pass


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(2, 2)
        self.l2 = nn.Linear(2, 2)


def _conflict(apply: Callable[[], object]) -> str:
    with pytest.raises(IncompatibleAPIError) as info:
        apply()
    message = str(info.value)
    assert "apply only one of them to this part of the model" in message
    return message


# ------------------------------------------------------------------- same module


def test_incompatible_error_is_a_contract_error() -> None:
    assert issubclass(IncompatibleAPIError, ContractError)


def test_rule_fires_when_the_declaring_api_comes_second() -> None:
    layer = nn.Linear(2, 2)
    marked(layer)
    message = _conflict(lambda: exclusive(layer))
    assert message.startswith(
        f"{exclusive.name} cannot be combined with {marked.name}, "
        "already applied on the same module, Linear;"
    )


def test_rule_fires_when_the_declaring_api_comes_first() -> None:
    layer = nn.Linear(2, 2)
    exclusive(layer)
    message = _conflict(lambda: marked(layer))
    assert message.startswith(
        f"{marked.name} cannot be combined with {exclusive.name}, "
        "already applied on the same module, Linear;"
    )


def test_rejected_application_neither_runs_nor_installs_anything() -> None:
    ran: list[nn.Module] = []

    @contract(incompatible_with=[Incompatible(marked)])
    def feature(module: nn.Module) -> None:
        ran.append(module)

    layer = nn.Linear(2, 2)
    marked(layer)
    _conflict(lambda: feature(layer))
    assert ran == []
    assert not feature.is_applied(layer)
    assert list(registry(layer)) == [marked]


def test_rule_does_not_fire_between_sibling_modules() -> None:
    model = TwoLayer()
    marked(model.l1)
    exclusive(model.l2)
    assert exclusive.is_applied(model.l2)


def test_rule_checks_every_target_of_a_list_apply() -> None:
    model = TwoLayer()
    marked(model.l2)
    _conflict(lambda: exclusive([model.l1, model.l2]))
    assert not exclusive.is_applied(model.l1)


# ------------------------------------------------------------------- nested scopes


def test_rule_fires_for_an_api_already_applied_inside() -> None:
    model = TwoLayer()
    marked(model.l1)
    message = _conflict(lambda: exclusive(model))
    assert f"{exclusive.name} cannot be combined with {marked.name}" in message
    assert "already applied on Linear 'l1', inside TwoLayer;" in message


def test_rule_fires_for_an_api_already_applied_around() -> None:
    model = TwoLayer()
    marked(model)
    message = _conflict(lambda: exclusive(model.l1))
    assert f"{exclusive.name} cannot be combined with {marked.name}" in message
    assert "already applied on TwoLayer, which contains Linear 'l1' of TwoLayer;" in message


def test_rule_declared_around_fires_for_the_api_applied_inside_later() -> None:
    model = TwoLayer()
    exclusive(model)
    message = _conflict(lambda: marked(model.l2))
    assert f"{marked.name} cannot be combined with {exclusive.name}" in message
    assert "which contains Linear 'l2' of TwoLayer" in message


def test_rule_declared_inside_fires_for_the_api_applied_around_later() -> None:
    model = TwoLayer()
    exclusive(model.l2)
    message = _conflict(lambda: marked(model))
    assert f"{marked.name} cannot be combined with {exclusive.name}" in message
    assert "inside TwoLayer" in message


def test_module_scope_rule_fires_on_the_same_module() -> None:
    layer = nn.Linear(2, 2)
    marked(layer)
    message = _conflict(lambda: local(layer))
    assert "on the same module, Linear" in message


@pytest.mark.parametrize("outer_first", [True, False], ids=["local-around", "local-inside"])
@pytest.mark.parametrize("local_first", [True, False], ids=["local-first", "marked-first"])
def test_module_scope_rule_does_not_fire_for_nested_modules(
    outer_first: bool, local_first: bool
) -> None:
    model = TwoLayer()
    local_target, marked_target = (model, model.l1) if outer_first else (model.l1, model)
    if local_first:
        local(local_target)
        marked(marked_target)
    else:
        marked(marked_target)
        local(local_target)
    assert local.is_applied(local_target)
    assert marked.is_applied(marked_target)


def _tree(spec: object) -> nn.Module:
    if isinstance(spec, list):
        return nn.Sequential(*[_tree(child) for child in spec])
    return nn.Linear(1, 1)


trees = st.recursive(
    st.just("leaf"), lambda children: st.lists(children, min_size=1, max_size=3), max_leaves=8
)


def _contains(outer: str, inner: str) -> bool:
    """Whether the module at FQN ``outer`` is, or contains, the one at ``inner``."""
    return outer in (inner, "") or inner.startswith(outer + ".")


@given(spec=trees, data=st.data())
def test_tree_rule_fires_exactly_when_one_module_contains_the_other(
    spec: object, data: st.DataObject
) -> None:
    named = list(nn.Sequential(_tree(spec)).named_modules())
    marked_fqn, marked_module = data.draw(st.sampled_from(named), label="marked")
    exclusive_fqn, exclusive_module = data.draw(st.sampled_from(named), label="exclusive")
    steps: list[Callable[[], object]] = [
        lambda: marked(marked_module),
        lambda: exclusive(exclusive_module),
    ]
    if data.draw(st.booleans(), label="declaring API first"):
        steps.reverse()
    steps[0]()
    if _contains(marked_fqn, exclusive_fqn) or _contains(exclusive_fqn, marked_fqn):
        _conflict(steps[1])
    else:
        steps[1]()


# ------------------------------------------------------------------- when=


def test_rule_narrowed_by_when_fires_for_a_matching_application() -> None:
    layer = nn.Linear(2, 2)
    checkpointing(layer, use_reentrant=True)
    message = _conflict(lambda: sharding(layer))
    assert f"{sharding.name} cannot be combined with {checkpointing.name}" in message


def test_rule_narrowed_by_when_fires_in_the_other_order_too() -> None:
    layer = nn.Linear(2, 2)
    sharding(layer)
    message = _conflict(lambda: checkpointing(layer, use_reentrant=True))
    assert f"{checkpointing.name} cannot be combined with {sharding.name}" in message


def test_rule_narrowed_by_when_sees_defaults_of_the_recorded_arguments() -> None:
    layer = nn.Linear(2, 2)
    checkpointing(layer)
    _conflict(lambda: sharding(layer))


@pytest.mark.parametrize("sharding_first", [True, False])
def test_rule_narrowed_by_when_lets_other_applications_through(sharding_first: bool) -> None:
    layer = nn.Linear(2, 2)
    if sharding_first:
        sharding(layer)
        checkpointing(layer, use_reentrant=False)
    else:
        checkpointing(layer, use_reentrant=False)
        sharding(layer)
    assert list(registry(layer)) == (
        [sharding, checkpointing] if sharding_first else [checkpointing, sharding]
    )


def test_rule_narrowed_by_when_is_given_the_other_applications_entry() -> None:
    seen: list[RegistryEntry] = []

    def remember(entry: RegistryEntry) -> bool:
        seen.append(entry)
        return False

    @contract(incompatible_with=[Incompatible(checkpointing, when=remember)])
    def feature(module: nn.Module) -> None:
        pass

    layer = nn.Linear(2, 2)
    checkpointing(layer, use_reentrant=False)
    feature(layer)
    assert seen == [registry(layer)[checkpointing]]


# ------------------------------------------------------------------- torch APIs by name


def test_rule_naming_a_torch_api_fires_after_torch_applied_it() -> None:
    layer = nn.Linear(2, 2)
    torch_checkpoint(layer)
    message = _conflict(lambda: needs_plain_forward(layer))
    assert message.startswith(
        f"{needs_plain_forward.name} cannot be combined with torch's checkpoint, "
        "already applied on the same module, Linear;"
    )
    assert not needs_plain_forward.is_applied(layer)


def test_rule_naming_a_torch_api_fires_for_torch_applied_inside() -> None:
    model = TwoLayer()
    torch_checkpoint(model.l2)
    message = _conflict(lambda: needs_plain_forward(model))
    expected = "cannot be combined with torch's checkpoint, already applied on Linear 'l2', inside"
    assert f"{expected} TwoLayer" in message


def test_module_scope_rule_naming_a_torch_api_does_not_fire_inside() -> None:
    model = TwoLayer()
    torch_checkpoint(model.l2)
    needs_plain_forward_here(model)
    assert needs_plain_forward_here.is_applied(model)


def test_rule_naming_a_torch_api_cannot_be_narrowed_with_when() -> None:
    with pytest.raises(TypeError) as info:
        Incompatible("checkpoint", when=lambda entry: True)  # type: ignore[call-overload]
    message = str(info.value)
    assert message == (
        "Incompatible('checkpoint', when=...): torch's registry records no arguments, "
        "so a rule on a torch API cannot be narrowed; drop when="
    )


def test_rule_naming_a_torch_api_does_not_look_at_modules_around_the_target() -> None:
    # torch's registry cannot be searched upwards: only the module and what is inside count.
    model = TwoLayer()
    torch_checkpoint(model)
    marked(model)  # one of ours around too: the torch rule still looks only inside
    needs_plain_forward(model.l1)
    assert needs_plain_forward.is_applied(model.l1)


def test_predicate_of_a_rule_whose_declarer_is_applied_nowhere_is_never_called() -> None:
    def explode(entry: RegistryEntry) -> bool:
        raise AssertionError("called for an API applied nowhere")

    @contract(incompatible_with=[Incompatible(checkpointing, when=explode)])
    def unused(module: nn.Module) -> None:
        pass

    layer = nn.Linear(2, 2)
    checkpointing(layer)
    assert checkpointing.is_applied(layer)
    assert unused in checkpointing.ruled_by


def test_contract_whose_rule_names_another_is_not_kept_alive_by_it() -> None:
    @contract(incompatible_with=[Incompatible(marked)])
    def short_lived(module: nn.Module) -> None:
        pass

    alive = weakref.ref(short_lived)
    del short_lived
    gc.collect()
    assert alive() is None
    assert "short_lived" not in {declarer.__name__ for declarer in marked.ruled_by}
    assert exclusive in marked.ruled_by


# ------------------------------------------------------------------- misuse named by the library


def test_rule_naming_an_unknown_torch_api_is_refused_listing_the_known_names() -> None:
    with pytest.raises(UnknownTorchAPIError) as info:
        Incompatible("checkpiont")  # type: ignore[call-overload]
    message = str(info.value)
    assert "Incompatible('checkpiont')" in message
    assert "(did you mean 'checkpoint'?)" in message
    assert "'checkpoint', 'fully_shard', 'replicate'" in message


@pytest.mark.parametrize("scope", ["subtree", "Tree", "", None])
def test_a_rule_of_an_unknown_scope_is_refused_where_it_is_made(scope: object) -> None:
    for other in ("fully_shard", contract()(lambda module: module)):
        with pytest.raises(UnknownRuleScopeError) as info:
            Incompatible(other, scope=scope)  # type: ignore[call-overload]
        message = str(info.value)
        assert f"scope={scope!r}): scope is 'tree'" in message
        assert message.startswith("Incompatible(")


def test_known_torch_api_names_are_the_names_torch_registers_its_apis_under() -> None:
    from torch.distributed._composable.replicate import replicate as torch_replicate
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    # torch's contract keys an API by its function's __name__ (functools.wraps keeps it).
    names = {getattr(api, "__name__", None) for api in (torch_checkpoint, torch_replicate)}
    names.add(getattr(torch_fully_shard, "__name__", None))
    assert set(get_args(TorchAPIName)) == names


@contract()
def ranked(module: nn.Module, *, rank: int, tag: str = "") -> None:
    pass


def _same_rank(entry: RegistryEntry) -> bool:
    return bool(entry.arguments["rank"] == 0)


@contract(store=StateStore(), incompatible_with=[Incompatible(ranked, when=_same_rank)])
def pinned(module: nn.Module) -> None:
    pass


def test_misspelt_keyword_read_by_a_rule_names_the_api_the_keyword_and_the_rule() -> None:
    elsewhere = pinned(nn.Linear(2, 2))  # applied somewhere: its rule reads every ranked call
    layer = nn.Linear(2, 2)
    with pytest.raises(ArgumentBindingError) as info:
        ranked(layer, rnk=0)  # type: ignore[call-arg]
    message = str(info.value)
    assert message.startswith(f"{ranked.name} was called with an unknown keyword argument 'rnk'")
    assert "(did you mean 'rank'?)" in message
    assert "'rank', 'tag'" in message
    assert f"the rule Incompatible({ranked.name}, when=_same_rank) of {pinned.name}" in message
    assert "on Linear" in message
    assert "fix the call" in message
    assert pinned.is_applied(elsewhere)


def test_call_refused_for_a_misspelt_keyword_installs_nothing_and_a_retry_works() -> None:
    elsewhere = pinned(nn.Linear(2, 2))
    layer = nn.Linear(2, 2)
    with pytest.raises(ArgumentBindingError):
        ranked(layer, rnk=1)  # type: ignore[call-arg]
    assert pinned.is_applied(elsewhere)
    assert not ranked.is_applied(layer)
    assert dict(registry(layer)) == {}
    ranked(layer, rank=1)
    assert registry(layer)[ranked].arguments == {"rank": 1, "tag": ""}


def test_arguments_of_an_entry_that_do_not_bind_name_the_api_and_the_keyword() -> None:
    entry = RegistryEntry(ranked, (), {"rnk": 0})
    with pytest.raises(ArgumentBindingError) as info:
        _ = entry.arguments
    message = str(info.value)
    assert "unknown keyword argument 'rnk' (did you mean 'rank'?)" in message
    assert ranked.name in message


def _misspelt_predicate(entry: RegistryEntry) -> bool:
    return bool(entry.arguments["rnk"] == 0)


@pytest.mark.parametrize("declarer_first", [True, False])
def test_predicate_reading_a_missing_argument_names_the_rule_and_the_key(
    declarer_first: bool,
) -> None:
    # Declared here, after a collection: a declarer applied to a module that an earlier
    # test's traceback cycle still keeps alive would fire too.
    gc.collect()

    @contract(incompatible_with=[Incompatible(ranked, when=_misspelt_predicate)])
    def misread(module: nn.Module) -> None:
        pass

    model = TwoLayer()
    if declarer_first:
        misread(model)
    else:
        ranked(model.l1, rank=0)

    def second() -> object:
        return ranked(model.l1, rank=0) if declarer_first else misread(model)

    with pytest.raises(RulePredicateError) as info:
        second()
    message = str(info.value)
    rule = f"the rule Incompatible({ranked.name}, when=_misspelt_predicate) of {misread.name}"
    assert message.startswith(rule)
    assert f"reads argument 'rnk', which {ranked.name} does not have (did you mean 'rank'?)" in (
        message
    )
    where = "Linear 'l1' of TwoLayer" if declarer_first else "Linear 'l1'"
    assert f"(reading {ranked.name}'s arguments on {where}); fix the predicate" in message
    assert isinstance(info.value.__cause__, KeyError)
    assert list(registry(model)) == ([misread] if declarer_first else [])
    assert list(registry(model.l1)) == ([] if declarer_first else [ranked])


def test_predicate_raising_is_a_rule_predicate_error_chained_to_its_cause() -> None:
    def broken(entry: RegistryEntry) -> bool:
        raise ValueError("no such mode")

    @contract(incompatible_with=[Incompatible(ranked, when=broken)])
    def fragile_rule(module: nn.Module) -> None:
        pass

    layer = nn.Linear(2, 2)
    ranked(layer, rank=0)
    with pytest.raises(RulePredicateError) as info:
        fragile_rule(layer)
    assert "raised ValueError: no such mode" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    assert not fragile_rule.is_applied(layer)


def _no_label(module: nn.Module) -> str:
    raise AssertionError("a module label was built while no rule failed")


def test_rules_narrowed_by_when_build_no_module_label_unless_they_fail() -> None:
    elsewhere = pinned(nn.Linear(2, 2))  # its rule now reads every ranked call
    layer = nn.Linear(2, 2)
    check_compatible(
        RegistryEntry(ranked, (), {"rank": 1}), [layer], [take_snapshot(layer)], _no_label
    )
    checkpointing(layer, use_reentrant=False)
    entry = RegistryEntry(sharding, (), {})
    check_compatible(entry, [layer], [take_snapshot(layer)], _no_label)  # reads the old entry
    assert pinned.is_applied(elsewhere)


def test_a_declaring_api_applied_nowhere_hides_no_other_declarers_rule() -> None:
    """Rules are read from every declaring API that is applied somewhere.

    Which declaring API is read first depends on addresses, so the case is built
    many times over: one that is applied nowhere comes first in some of them.
    """
    for _ in range(30):
        store = StateStore()

        @contract(store=store)
        def named(module: nn.Module) -> None:
            pass

        @contract(store=store, incompatible_with=[Incompatible(named)])
        def applied_nowhere(module: nn.Module) -> None:
            pass

        @contract(store=store, incompatible_with=[Incompatible(named)])
        def applied(module: nn.Module) -> None:
            pass

        layer = applied(nn.Linear(1, 1))
        words = r"<locals>\.named cannot be combined with .*<locals>\.applied, already applied"
        with pytest.raises(IncompatibleAPIError, match=words):
            named(layer)
        assert (named.is_applied(layer), applied_nowhere.is_applied(layer)) == (False, False)
