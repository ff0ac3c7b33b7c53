"""What differs from FSDP2 and DDP, and which torch each feature needs: the one source.

The pages render these rows (``tools/mkdocs_differences.py`` replaces a marker such as
``<!-- differences: fully_shard -->`` with a table), and ``tests/test_differences.py``
checks each row against the code: a row whose ``check`` starts with ``probe:`` is run
there (the call is refused with ``raises``, or accepted where ``raises`` is None); any
other ``check`` names a test, ``path`` or ``path::function``, that must exist. A page
therefore cannot say one thing while the code does another, and two pages cannot disagree.

Everything is verified with gloo on CPU; what only an accelerator runs is written but
never run, and the rendered tables say so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from torchcontract import (
    AlreadyManagedError,
    ContractError,
    InvalidTargetError,
    NoProcessGroupError,
)
from torchcontract.apis import ModelMismatchError
from torchcontract.apis.replicate import InvalidKeywordError, UnsupportedKeywordError

__all__ = [
    "DIFFERENCES",
    "KEYWORDS",
    "MINIMUM_TORCH",
    "OLDEST_TORCH",
    "TESTED_RELEASES",
    "Difference",
    "Keyword",
    "MinimumTorch",
    "render",
    "render_differences",
    "render_keywords",
    "render_minimum_torch",
]

API = Literal["fully_shard", "replicate"]

#: The PyTorch implementation each API is held to, as the tables name it.
REFERENCE: Final[dict[API, str]] = {"fully_shard": "FSDP2", "replicate": "DDP"}


@dataclass(frozen=True)
class Difference:
    """One way an API differs from PyTorch's.

    ``ours`` and ``theirs`` say what each does; ``raises`` is the exception ours raises
    where it refuses (the table shows it; the test asserts it); ``why`` says why, and
    what to do.
    """

    api: API
    what: str
    ours: str
    theirs: str
    why: str
    check: str
    raises: type[BaseException] | None = None


@dataclass(frozen=True)
class Keyword:
    """One keyword of PyTorch's API: whether ours takes it, and what to know.

    ``refused``: taken at its default only; any other value raises this (the table
    shows it; the test asserts it). ``pair``: a keyword that must be given with this
    one; given without it, this one raises ``alone`` instead.
    """

    api: API
    name: str
    taken: bool
    note: str
    refused: type[BaseException] | None = None
    pair: str | None = None
    alone: type[BaseException] | None = None


@dataclass(frozen=True)
class MinimumTorch:
    """A feature that needs a newer torch than the oldest supported.

    ``torch`` is the oldest release tested that has what the feature needs; ``gate`` the
    name in ``torchcontract.apis._compat`` that detects it (``DDP_KEYWORDS:<keyword>``
    for one of DDP's keywords). Releases between the oldest supported and ``torch`` are
    not tested: the feature is detected, not read from the version, so one that has it
    works too.
    """

    feature: str
    torch: tuple[int, int]
    gate: str
    keyword: str
    api: API


#: The releases ``make compat`` and the development pin run the suite on.
TESTED_RELEASES: Final = ((2, 6), (2, 13), (2, 14))
#: The oldest supported release: every feature not in ``MINIMUM_TORCH`` works there.
OLDEST_TORCH: Final = (2, 6)

ACCELERATOR_METHODS: Final = (
    "set_post_optim_event",
    "set_allocate_memory_from_process_group_for_comm",
    "set_symm_mem_for_comm",
    "set_separate_reduce_scatter_group",
)

_DISTRIBUTED = "tests/distributed/"

DIFFERENCES: Final = (
    # ------------------------------------------------------------------ fully_shard
    Difference(
        "fully_shard",
        "No process group started",
        "refused",
        "starts one from the environment",
        "Starting the process group is the program's choice. Call "
        "`torch.distributed.init_process_group()` first, or pass `mesh=`.",
        "probe:no_process_group",
        NoProcessGroupError,
    ),
    Difference(
        "fully_shard",
        "The static type of `fully_shard(m)`",
        "`m`'s own class",
        "`FSDPModule`",
        "A type cannot say both. Narrow with `isinstance(m, FSDPModule)` to call the methods.",
        "tests/typing/check_keeps_class.py",
    ),
    Difference(
        "fully_shard",
        "Implicit forward prefetch",
        "on every device: the next group's all-gather starts early, in the previous "
        "iteration's order",
        "none: each all-gather starts at its group's forward (on an accelerator, on a stream "
        "of its own)",
        "On CPU, asynchronous gloo collectives are the only overlap. Values are the same; "
        "`set_implicit_prefetch(model, False)` turns it off.",
        _DISTRIBUTED + "test_fully_shard_prefetch_gloo.py"
        "::test_forward_prefetches_the_next_block_while_the_current_one_computes",
    ),
    Difference(
        "fully_shard",
        "`unshard(async_op=True)`, then `reshard()` before waiting, then an optimizer step",
        "the next forward gathers the parameters as they are, after the step",
        "the next forward uses the pending all-gather: the parameters before the step",
        "A reshard drops a gather not yet waited for. Wait on the handle before a reshard "
        "to use what it gathered.",
        _DISTRIBUTED + "test_fully_shard_where_fsdp2_errs_gloo.py"
        "::test_a_reshard_before_an_async_unshard_was_waited_for_drops_it",
    ),
    Difference(
        "fully_shard",
        "HSDP, `set_requires_all_reduce(False)`, micro-batches that use different parameters",
        "each parameter's deferred sum joins its own gradient",
        "deferred sums are added to the next reduction by position: one parameter's may "
        "land in another's gradient",
        "Deferred results are kept per parameter. Where every micro-batch uses the same "
        "parameters, both agree.",
        _DISTRIBUTED + "test_fully_shard_where_fsdp2_errs_gloo.py"
        "::test_deferred_all_reduces_of_different_parameters_stay_with_their_own",
    ),
    Difference(
        "fully_shard",
        "A dtype cast between steps",
        "followed: the shards take the new dtype",
        "its dtypes are fixed at the first forward; the next all-gather fails",
        "Each gather reads the dtype from the shard.",
        _DISTRIBUTED + "test_fully_shard_paths_gloo.py"
        "::test_a_cast_between_steps_continues_as_torch_rebuilt_there",
    ),
    Difference(
        "fully_shard",
        "`set_post_optim_event` on a CPU mesh (taken on an accelerator's), "
        "`set_allocate_memory_from_process_group_for_comm`, `set_symm_mem_for_comm`, "
        "`set_separate_reduce_scatter_group`",
        "refused",
        "configure accelerator collectives",
        "A CPU mesh has no streams for the event; the other three configure NCCL allocators "
        "and communicators fully_shard does not implement. Leave the calls out.",
        "probe:accelerator_methods",
        NotImplementedError,
    ),
    Difference(
        "fully_shard",
        "`offload_policy=CPUOffloadPolicy()` on an accelerator mesh",
        "refused",
        "keeps shards, gradients and the optimizer step on CPU",
        "Not implemented. Use `OffloadPolicy()` there. On a CPU mesh it is taken, and changes "
        "nothing: the shards are on CPU already.",
        "tests/test_fully_shard_module.py::test_cpu_offload_on_an_accelerator_mesh_is_refused",
        NotImplementedError,
    ),
    Difference(
        "fully_shard",
        "An int `reshard_after_forward` with a placement on dim 1 or later",
        "refused",
        "taken",
        "The smaller post-forward mesh keeps dim-0 rows only. Pass `True` or `False`.",
        "probe:int_reshard_with_shard_1",
        NotImplementedError,
    ),
    Difference(
        "fully_shard",
        "An int `reshard_after_forward` with tensor-parallel parameters",
        "refused at apply",
        "refused at the first forward",
        "Refused before anything changes. Pass `True` or `False`.",
        "probe:int_reshard_with_tensor_parallel",
        NotImplementedError,
    ),
    Difference(
        "fully_shard",
        "An int `reshard_after_forward` with a parameter whose shard defines "
        "`fsdp_pre_all_gather`/`fsdp_post_all_gather`",
        "taken",
        "refused (`AssertionError` after forward, or `NotImplementedError` in backward)",
        "The all-gather outputs forward's hooks made are kept, a share per rank, and gathered "
        "again over the smaller mesh in backward; the pre-all-gather runs in forward only.",
        _DISTRIBUTED + "test_fully_shard_extensions_gloo.py"
        "::test_a_post_forward_mesh_gathers_the_kept_hook_outputs",
    ),
    Difference(
        "fully_shard",
        "`shard_placement_fn` returning a `ShardPlacementResult` (a placement with its own mesh)",
        "refused",
        "taken",
        "Not implemented: one application shards over one mesh, where FSDP2 makes a group per "
        "mesh. Return `Shard(d)` or `None`, and give the parameter's submodule its own "
        "`fully_shard(..., mesh=...)` first.",
        "probe:shard_placement_result",
        NotImplementedError,
    ),
    Difference(
        "fully_shard",
        "`dp_mesh_dims` naming `replicate` only (FSDP2's DDP mode)",
        "refused",
        "taken",
        "Not implemented. Name the `shard` dims, or use `replicate`.",
        "probe:dp_mesh_dims_replicate_only",
        NotImplementedError,
    ),
    Difference(
        "fully_shard",
        "`set_force_sum_reduction_for_comms(True)` with a divide factor, on a shard group of one",
        "the sum divided by the factor once, as on every mesh",
        "divides before the all-reduce as well as after: gradients the factor times smaller",
        "One rule for every mesh.",
        _DISTRIBUTED + "test_fully_shard_reduction_gloo.py"
        "::test_force_sum_with_a_factor_on_a_shard_group_of_one_divides_once",
    ),
    Difference(
        "fully_shard",
        "A divide factor on a shard group of one, reducing in a dtype other than float32 and "
        "bfloat16 (float16)",
        "the sum divided by the factor once, as on every mesh",
        "divides by the factor where it copies for the reduce-scatter, and again around the "
        "sum: gradients the factor times smaller",
        "One rule for every mesh.",
        _DISTRIBUTED + "test_fully_shard_fp16_reduction_gloo.py"
        "::test_a_factor_on_a_shard_group_of_one_divides_once",
    ),
    Difference(
        "fully_shard",
        "Trainable parameters of two dtypes (float32 and float64) in one application",
        "taken: one collective per dtype",
        "refused at the first forward with an `AssertionError`",
        "Parameters are gathered and reduced by dtype.",
        "probe:trainable_parameters_of_two_dtypes",
    ),
    Difference(
        "fully_shard",
        "`copy.deepcopy` of a sharded module",
        "refused",
        "refused with an `AssertionError`",
        "A `ContractError` (a `RuntimeError`), not FSDP2's `AssertionError`. Copy the model "
        "before `fully_shard`, or load its state dict into a new model sharded the same way.",
        "probe:deepcopy_of_a_sharded_module",
        ContractError,
    ),
    Difference(
        "fully_shard",
        "A module sharded after its parent",
        "refused at apply, naming the parameter",
        "fails with a `TypeError` from inside FSDP2 (`Invariant encountered`)",
        "An `AlreadyManagedError` (a `RuntimeError` and a `ValueError`), not a `TypeError`. "
        "Apply `fully_shard` to the inner modules first, then to their parents.",
        "probe:module_sharded_after_its_parent",
        AlreadyManagedError,
    ),
    Difference(
        "fully_shard",
        "torch's code reading FSDP2's internal objects (its parameters' records, streams, "
        "buffers: what its memory tracker reads)",
        "raises, naming the attribute",
        "its own objects",
        "Only what torch's pipeline schedules, `register_fsdp_forward_method` and "
        "`share_comm_ctx` read has a counterpart.",
        "probe:torch_state_internals",
        AttributeError,
    ),
    # ------------------------------------------------------------------ replicate
    Difference(
        "replicate",
        "The wrapper",
        "none: the model itself, its state-dict keys unchanged",
        "a new module; state-dict keys gain `module.`",
        "Hooks on the model instead of a wrapper. Strip DDP's prefix with "
        "`consume_prefix_in_state_dict_if_present`.",
        "probe:no_wrapper",
    ),
    Difference(
        "replicate",
        "`copy.deepcopy` of a replicated model",
        "a plain model of its class: its gradients are not averaged",
        "a `DistributedDataParallel` that averages",
        "A copy (an EMA model, a snapshot) is a model of its own: apply `replicate` to it if "
        "it trains on every rank.",
        "probe:deepcopy_of_a_replicated_module",
    ),
    Difference(
        "replicate",
        "Tensor-parallel parameters (`DTensor`s)",
        "refused at apply",
        "taken (its `_pre_dp_module_transform` first)",
        "Use `fully_shard` over the data-parallel mesh, which takes them, as torchtitan does.",
        "probe:tensor_parallel_parameters",
        InvalidTargetError,
    ),
    Difference(
        "replicate",
        "Evaluating on one rank alone",
        "`with rank_local(model): model(x)`",
        "`ddp.module(x)`",
        "There is no `.module`: the model is not wrapped, so the choice is a context.",
        "probe:rank_local",
    ),
    Difference(
        "replicate",
        "Ranks holding models of different shapes",
        "every rank raises, naming the first difference",
        "its own check: one rank raised while another waited",
        "One all-gather of a digest of every rank's model, so no rank is left waiting.",
        _DISTRIBUTED + "test_replicate_real_use_gloo.py"
        "::test_different_widths_on_different_ranks_raise_on_every_rank",
        ModelMismatchError,
    ),
    Difference(
        "replicate",
        "Under `Join`, after each forward",
        "two flags all-reduced: whether buffers are broadcast next, whether a backward follows",
        "one flag: a synchronizing forward, whose backward a joined rank then waits to meet",
        "A forward whose output needs no gradient starts no backward: the joined rank does not "
        "shadow one. Every other collective is DDP's.",
        _DISTRIBUTED + "test_replicate_messages_gloo.py"
        "::test_under_join_a_forward_whose_output_needs_no_gradient_is_not_shadowed",
    ),
    Difference(
        "replicate",
        "`broadcast_buffers`'s default, before torch 2.13",
        "`None`, DDP's from torch 2.13 on: before it, where DDP has no `forward_sync_buffers`, "
        "`None` means `True`",
        "`True` before torch 2.13; `None` from it (deprecated in favour of `forward_sync_buffers`)",
        "The same buffers are broadcast on every release: one signature serves them all.",
        "probe:broadcast_buffers_default",
    ),
    Difference(
        "replicate",
        "A module with no parameter that requires a gradient",
        "refused",
        "refused with a `RuntimeError`",
        "An `InvalidTargetError` (a `TypeError` and a `ValueError`), not DDP's `RuntimeError`. "
        "Apply `replicate` to a module with trainable parameters.",
        "probe:no_trainable_parameter",
        InvalidTargetError,
    ),
    Difference(
        "replicate",
        "A communication hook in a module with `from __future__ import annotations`",
        "accepted",
        "refused: it compares the annotation strings with `dist.GradBucket`",
        "The annotations are resolved before they are compared.",
        "tests/test_replicate_module.py::test_a_hook_with_string_annotations_is_accepted",
    ),
    Difference(
        "replicate",
        "A non-reentrant `checkpoint` around the whole model, a parameter's gradient "
        "arriving before the recompute",
        "trains",
        'raises at the recompute: "Expected to have finished reduction"',
        "The recompute runs inside the backward that is still synchronizing, which is no "
        "failed backward. Checkpoint the blocks inside the model instead, as most models do.",
        "tests/test_replicate_failed_backward.py"
        "::test_a_checkpoint_recomputing_the_module_inside_its_own_backward_is_no_failure",
    ),
    Difference(
        "replicate",
        "`find_unused_parameters=True`, a reentrant `checkpoint` inside the forward and an "
        "output of the user's own class",
        "averaged",
        'raises "Expected to mark a variable ready only once"',
        "Parameters are found used by the gradients they get, and a backward that begins "
        "inside the checkpoint's nested one synchronizes on to the end of the backward around it.",
        _DISTRIBUTED + "test_replicate_training_patterns_gloo.py"
        "::test_ddp_refuses_a_reentrant_checkpoint_with_unused_parameters_found",
    ),
    Difference(
        "replicate",
        "`static_graph=True` and an output of the user's own class (no tensor a search finds)",
        "averaged",
        "averages nothing, silently: each rank steps on its own gradients",
        "Its static graph's first backward sends everything from a hook on the outputs it "
        "finds; ours starts from the first gradient, wherever the outputs hide their tensors.",
        _DISTRIBUTED + "test_replicate_training_patterns_gloo.py"
        "::test_ddps_static_graph_averages_no_output_of_the_users_own_class",
    ),
    Difference(
        "replicate",
        "Sparse gradients",
        "refused at the synchronizing backward",
        "averaged",
        "Not implemented. Use dense gradients (`nn.Embedding(sparse=False)`), or DDP.",
        _DISTRIBUTED + "test_replicate_gloo.py::test_sparse_gradients_are_refused_with_advice",
        ContractError,
    ),
)

KEYWORDS: Final = (
    Keyword("fully_shard", "mesh", True, "1-D: sharding; 2-D `(replicate, shard)`: HSDP"),
    Keyword(
        "fully_shard",
        "reshard_after_forward",
        True,
        "`None`, `True`, `False` or an int, with FSDP2's meanings",
    ),
    Keyword(
        "fully_shard",
        "shard_placement_fn",
        True,
        "returns `None` (dim 0) or `Shard(d)` for any dim `d`",
    ),
    Keyword("fully_shard", "mp_policy", True, "torch's `MixedPrecisionPolicy`, every field"),
    Keyword(
        "fully_shard",
        "offload_policy",
        True,
        "`OffloadPolicy()`; `CPUOffloadPolicy()` on a CPU mesh",
    ),
    Keyword("fully_shard", "ignored_params", True, "left unsharded and unmanaged"),
    Keyword(
        "fully_shard",
        "dp_mesh_dims",
        True,
        "torch's `DataParallelMeshDims`; `shard` must be named",
    ),
    Keyword(
        "replicate",
        "device_ids",
        True,
        "`None`, or `[local_rank]` for a model on that one device: nothing moves at apply; "
        "each forward's inputs are copied there, as DDP's",
    ),
    Keyword(
        "replicate",
        "output_device",
        True,
        "checked and kept, as DDP's (its forward moves no output either)",
    ),
    Keyword("replicate", "dim", True, "as DDP's: nothing in forward reads it"),
    Keyword(
        "replicate",
        "broadcast_buffers",
        True,
        "deprecated from torch 2.13, as DDP's (a `FutureWarning`): use `forward_sync_buffers`",
    ),
    Keyword("replicate", "init_sync", True, "as DDP's"),
    Keyword("replicate", "process_group", True, "the default group if `None`"),
    Keyword("replicate", "bucket_cap_mb", True, "DDP's buckets in every backward"),
    Keyword("replicate", "find_unused_parameters", True, "`False` by default, as DDP's"),
    Keyword("replicate", "check_reduction", True, "deprecated in DDP, which ignores it"),
    Keyword("replicate", "gradient_as_bucket_view", True, "as DDP's"),
    Keyword("replicate", "static_graph", True, "as DDP's"),
    Keyword(
        "replicate",
        "delay_all_reduce_named_params",
        True,
        "not implemented: `None` only; one of the two alone is a `ValueError`, as in DDP",
        UnsupportedKeywordError,
        pair="param_to_hook_all_reduce",
        alone=InvalidKeywordError,
    ),
    Keyword(
        "replicate",
        "param_to_hook_all_reduce",
        True,
        "not implemented: `None` only; one of the two alone is a `ValueError`, as in DDP",
        UnsupportedKeywordError,
        pair="delay_all_reduce_named_params",
        alone=InvalidKeywordError,
    ),
    Keyword(
        "replicate",
        "mixed_precision",
        True,
        "not implemented: `None` only",
        UnsupportedKeywordError,
    ),
    Keyword("replicate", "device_mesh", True, "a 1-D mesh"),
    Keyword(
        "replicate",
        "skip_all_reduce_unused_params",
        True,
        "not implemented: `False` only",
        UnsupportedKeywordError,
    ),
    Keyword("replicate", "bucket_cap_mb_list", True, "the cap of each bucket in turn"),
    Keyword("replicate", "batched_grad_copy", True, "taken; the numbers are the same either way"),
    Keyword(
        "replicate",
        "forward_sync_buffers",
        True,
        "rank 0's buffers before each forward; copied at apply either way, as DDP's",
    ),
)

MINIMUM_TORCH: Final = (
    MinimumTorch(
        "`fully_shard(..., dp_mesh_dims=...)`",
        (2, 13),
        "DATA_PARALLEL_MESH_DIMS",
        "dp_mesh_dims",
        "fully_shard",
    ),
    MinimumTorch(
        "`replicate(..., bucket_cap_mb_list=...)`",
        (2, 13),
        "DDP_KEYWORDS:bucket_cap_mb_list",
        "bucket_cap_mb_list",
        "replicate",
    ),
    MinimumTorch(
        "`replicate(..., forward_sync_buffers=...)`",
        (2, 13),
        "DDP_KEYWORDS:forward_sync_buffers",
        "forward_sync_buffers",
        "replicate",
    ),
    MinimumTorch(
        "`replicate(..., batched_grad_copy=True)`",
        (2, 13),
        "DDP_KEYWORDS:batched_grad_copy",
        "batched_grad_copy",
        "replicate",
    ),
    MinimumTorch(
        "`replicate(..., init_sync=False)`",
        (2, 13),
        "DDP_KEYWORDS:init_sync",
        "init_sync",
        "replicate",
    ),
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _ours(row: Difference) -> str:
    if row.raises is None:
        return row.ours
    return f"{row.ours}: `{row.raises.__name__}`"


def render_differences(api: API) -> str:
    """The table of ``api``'s differences from PyTorch's implementation, as markdown."""
    lines = [
        f"| what | torchcontract | {REFERENCE[api]} | why, and what to do |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {_cell(row.what)} | {_cell(_ours(row))} | {_cell(row.theirs)} | {_cell(row.why)} |"
        for row in DIFFERENCES
        if row.api == api
    ]
    lines += [
        "",
        f"Each row is checked against the code, and ours against {REFERENCE[api]}, with gloo on "
        "CPU. What only an accelerator runs is written, never run.",
    ]
    return "\n".join(lines)


def render_keywords(api: API) -> str:
    """The table of PyTorch's keywords for ``api``: taken or not, and a note."""
    lines = [f"| {REFERENCE[api]}'s keyword | torchcontract | note |", "|---|---|---|"]
    for row in KEYWORDS:
        if row.api == api:
            taken = "taken" if row.taken else "refused: `TypeError`"
            if row.refused is not None:
                taken = f"at its default only; another value: `{row.refused.__name__}`"
            if row.refused is not None and row.pair is not None and row.alone is not None:
                taken = (
                    f"at its default only; another value, with `{row.pair}`: "
                    f"`{row.refused.__name__}`; without it: `{row.alone.__name__}`"
                )
            lines.append(f"| `{row.name}` | {taken} | {_cell(row.note)} |")
    return "\n".join(lines)


def _release(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def render_minimum_torch() -> str:
    """The table of features needing a newer torch than the oldest supported."""
    lines = ["| feature | torch | on an older torch |", "|---|---|---|"]
    for row in MINIMUM_TORCH:
        lines.append(f"| {row.feature} | {_release(row.torch)} | refused: `TypeError` |")
    lines.append(f"| everything else | {_release(OLDEST_TORCH)} | |")
    lines += [
        "",
        "A release in this table is the oldest tested one that has what the feature needs. "
        f"The releases between {_release(OLDEST_TORCH)} and it are not tested: torchcontract "
        "detects what torch has, not its version, so one of them that has it works too.",
    ]
    return "\n".join(lines)


def render(name: str) -> str:
    """The markdown a page's ``<!-- name -->`` marker stands for; ``KeyError`` for another."""
    tables = {
        "differences: fully_shard": lambda: render_differences("fully_shard"),
        "differences: replicate": lambda: render_differences("replicate"),
        "keywords: fully_shard": lambda: render_keywords("fully_shard"),
        "keywords: replicate": lambda: render_keywords("replicate"),
        "minimum torch": render_minimum_torch,
    }
    return tables[name]()
