# The C walk (_walk_native.c), which _fqn uses where it was built: _fqn's copies of a tree.
from torch import nn

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
