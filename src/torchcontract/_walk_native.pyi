# The C walk (_walk_native.c), which _fqn uses where it was built: _fqn's copies of a tree.
from torch import nn

from ._fqn import _Copies

def unchanged(root: nn.Module, copies: _Copies, /) -> bool | None: ...
def walk(root: nn.Module, /) -> _Copies | None: ...
