from torch.optim import Optimizer
from torchft.manager import Manager

class OptimizerWrapper(Optimizer):
    def __init__(self, manager: Manager, optim: Optimizer) -> None: ...
    def zero_grad(self, set_to_none: bool = True) -> None: ...
    def step(self, closure: object | None = None) -> None: ...  # type: ignore[override]
