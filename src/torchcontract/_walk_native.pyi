# The C walk (_walk_native.c), which _fqn uses where it was built: _fqn's copies of a tree.
from collections.abc import Mapping, Sequence

from torch import nn

_Copies = tuple[
    Sequence[nn.Module],
    tuple[type[nn.Module], ...],
    tuple[list[int], list[str], list[tuple[int, tuple[bool, ...]]]],
    Mapping[int, object],
    tuple[tuple[list[int], list[str], list[int]], tuple[list[int], list[str], list[int]]],
]

def unchanged(root: nn.Module, copies: _Copies, /) -> bool | None: ...
def walk(
    root: nn.Module, /
) -> (
    tuple[
        list[nn.Module],
        tuple[type[nn.Module], ...],
        tuple[list[int], list[str], list[tuple[int, tuple[bool, ...]]]],
        dict[int, object],
        tuple[tuple[list[int], list[str], list[int]], tuple[list[int], list[str], list[int]]],
    ]
    | None
): ...
