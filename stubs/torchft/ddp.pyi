from torch import Tensor, nn
from torch._C._distributed_c10d import GradBucket
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel as _DistributedDataParallel
from torchft.manager import Manager

class DistributedDataParallel(_DistributedDataParallel):
    def __init__(self, manager: Manager, module: nn.Module, **kwargs: object) -> None: ...
    @staticmethod
    def _comm_hook(state: Manager, bucket: GradBucket) -> Future[Tensor]: ...
