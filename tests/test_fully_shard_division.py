"""Where fully_shard's gradient reduction divides, against FSDP2's own rule, case by case.

``_division.division`` says whether the collectives divide (an average, or
premultiplied inputs) or the reduction sums between a division before and one
after. FSDP2 decides the same in ``_get_gradient_divide_factors``; this compares the
two over reduce dtypes, shard and replica group sizes, divide factors and force-sum.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import pytest
import torch
from torch.distributed.fsdp._fully_shard import _fsdp_collectives

from torchcontract.apis.fully_shard._division import Division, division

_theirs: Any = getattr(_fsdp_collectives, "_get_gradient_divide_factors", None)
_PARAMETERS = (
    "reduce_scatter_group",
    "all_reduce_group",
    "reduce_dtype",
    "device_type",
    "factor",
    "force_sum_reduction_for_comms",
)
pytestmark = pytest.mark.skipif(
    _theirs is None or tuple(inspect.signature(_theirs).parameters) != _PARAMETERS,
    reason=f"FSDP2's divide-factor rule has another shape in torch {torch.__version__}",
)


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
FACTORS = (None, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.5, 64.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_division_is_fsdp2s(dtype: torch.dtype) -> None:
    for world, replicas, factor, force_sum in itertools.product(
        (1, 2, 3, 4, 8), (None, 1, 2, 4), FACTORS, (False, True)
    ):
        ours = division(dtype, world * (replicas or 1), factor, force_sum=force_sum)
        before, after, scatter_op, _ = _theirs(
            _Group(world),
            None if replicas is None else _Group(replicas),
            dtype,
            "cpu",
            factor,
            force_sum,
        )
        in_collectives = scatter_op != torch.distributed.ReduceOp.SUM or (
            before is None and after is None
        )
        expected = Division(
            in_collectives=in_collectives,
            before=None if before in (None, 1) else before,
            after=None if after in (None, 1) else after,
        )
        assert ours == expected, (world, replicas, factor, force_sum)
