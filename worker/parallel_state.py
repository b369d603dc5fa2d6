"""The tensor-parallel group of one worker: its rank, the group size and the collectives the model needs."""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from strata.worker.devices import distributed_backend


@dataclass(frozen=True)
class TensorParallel:
    """One rank's view of its tensor-parallel group.

    With ``size == 1`` there is no process group and every collective is the identity, so a
    single-rank worker needs no ``torch.distributed`` set-up at all.
    """

    rank: int
    size: int
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel group of size {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError("a tensor-parallel group of size > 1 needs a process group")

    def shard(self, total: int) -> slice:
        """This rank's equal share of a dimension of ``total`` elements."""
        if total % self.size:
            raise ValueError(f"cannot split {total} evenly across {self.size} tensor-parallel ranks")
        per_rank = total // self.size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of ``x`` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def destroy(self) -> None:
        """Tear down the process group this object was created with (a no-op for one rank)."""
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group()


def init_tensor_parallel(
    rank: int, size: int, init_method: str, device: str = "cpu", backend: str | None = None
) -> TensorParallel:
    """Join the tensor-parallel group as ``rank`` of ``size`` whose tensors live on ``device``:
    NCCL for CUDA, gloo otherwise, unless ``backend`` says (gloo also reduces CUDA tensors,
    which lets two ranks share one GPU in tests).

    ``init_method`` is a ``torch.distributed`` URL such as ``tcp://127.0.0.1:29500``. A group of
    one rank skips ``torch.distributed`` entirely.
    """
    if size == 1:
        return TensorParallel(rank=rank, size=size)
    backend = backend or distributed_backend(device)
    if backend == "nccl":
        torch.cuda.set_device(device)  # NCCL binds each rank's communicator to its current device
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=size)
    return TensorParallel(rank=rank, size=size, group=dist.group.WORLD)
