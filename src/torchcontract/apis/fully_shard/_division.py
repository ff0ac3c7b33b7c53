"""Where a gradient reduction divides its sum, as FSDP2's ``_get_gradient_divide_factors``.

The reduction divides the sum of the ranks' gradients by the factor
(``set_gradient_divide_factor``), or by the mesh's size. In float32 and bfloat16
the collectives do it (an average, or a sum of premultiplied inputs), unless
``set_force_sum_reduction_for_comms`` asks for sums: then everything is divided
after. In any other reduce dtype (float16's range overflows where the sum of a few
ranks' gradients is large) the inputs are divided before the sum by a power of two
near the factor's square root, and the output by the rest after it, as FSDP2 does.
"""

from __future__ import annotations

import attrs
import torch

__all__ = ["Division", "division"]


@attrs.frozen
class Division:
    """How one reduction divides: in its collectives, or before and after them.

    ``in_collectives``: the reduce-scatter averages (or sums inputs premultiplied by
    ``1 / factor``) and HSDP's all-reduce averages, unless a factor is set (then it
    sums). Otherwise both sum, ``before`` divides the input (None: not at all) and
    ``after`` the output, after the all-reduce hook (None: not at all).
    """

    in_collectives: bool
    before: float | None = None
    after: float | None = None


#: What the collectives divide in: the dtypes whose range holds any sum of gradients.
_WIDE_RANGE = (torch.float32, torch.bfloat16)


def division(dtype: torch.dtype, size: int, factor: float | None, *, force_sum: bool) -> Division:
    """The division of a reduction in ``dtype`` over a mesh of ``size`` ranks, as FSDP2's.

    ``factor``: ``set_gradient_divide_factor``'s, None for the mesh's size;
    ``force_sum``: ``set_force_sum_reduction_for_comms``'s.
    """
    if dtype in _WIDE_RANGE and not force_sum:
        return Division(in_collectives=True)
    total = float(size) if factor is None else factor
    if dtype in _WIDE_RANGE:
        return Division(in_collectives=False, after=_unless_one(total))
    before = 1
    while total % before == 0 and total / before > before:
        before *= 2
    return Division(
        in_collectives=False, before=_unless_one(float(before)), after=_unless_one(total / before)
    )


def _unless_one(value: float) -> float | None:
    """``value``, or None for 1: a division by one is skipped, as FSDP2's ``_div_if_needed``."""
    return None if value == 1 else value
