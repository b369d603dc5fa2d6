"""Pipeline parallelism: which decoder layers a stage holds, and how its hidden states reach the next.

Ranks are numbered stage-major: global rank ``stage * tp_size + tp_rank``. Every rank of a
stage computes the same hidden states (the TP all-reduce leaves them whole on each), so TP rank
``t`` of stage ``s`` sends them, with the residual stream, to TP rank ``t`` of stage ``s + 1``
over point-to-point ``torch.distributed`` (gloo on CPU, NCCL on CUDA).
"""

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from strata.worker.devices import distributed_backend
from strata.worker.parallel_state import TensorParallel


def split_layers(num_layers: int, num_stages: int, partition: list[int] | None = None) -> list[range]:
    """Each stage's contiguous layer range: ``partition`` (layers per stage) if given, else
    balanced by count, earlier stages taking the remainder."""
    if partition is None:
        if num_layers < num_stages:
            raise ValueError(f"{num_layers} decoder layers cannot fill {num_stages} pipeline stages")
        base, extra = divmod(num_layers, num_stages)
        partition = [base + (stage < extra) for stage in range(num_stages)]
    if len(partition) != num_stages or sum(partition) != num_layers or min(partition) < 1:
        raise ValueError(
            f"pipeline layer partition {partition} must give each of the {num_stages} stages at least one "
            f"of the model's {num_layers} decoder layers, {num_layers} in all"
        )
    starts = [sum(partition[:stage]) for stage in range(num_stages)]
    return [range(start, start + count) for start, count in zip(starts, partition)]


@dataclass(frozen=True)
class PipelineStage:
    """Stage ``index`` of ``size``: the first embeds tokens, the last normalises and computes
    logits. ``partition``: layers per stage, None for a split balanced by layer count."""

    index: int = 0
    size: int = 1
    partition: tuple[int, ...] | None = None

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def layers(self, num_layers: int) -> range:
        partition = list(self.partition) if self.partition is not None else None
        return split_layers(num_layers, self.size, partition)[self.index]


WHOLE_MODEL = PipelineStage()


class StageLink:
    """This rank's point-to-point link to its peers in the neighbouring stages.

    Sends do not wait for the next stage to receive: it may still be busy with an earlier
    micro-batch, and this stage goes on to the next one meanwhile. A send's tensor is kept
    until its transfer completes."""

    def __init__(self, stage: PipelineStage, rank: int, tp_size: int) -> None:
        self.stage = stage
        self._previous = rank - tp_size
        self._next = rank + tp_size
        self._sending: list[tuple[dist.Work, torch.Tensor]] = []
        self.waited_seconds = 0.0  # in ``receive``, since start: the stage's idle time inside steps

    def send(self, hidden: torch.Tensor) -> None:
        """Hand a step's hidden states (``[2, T, hidden]``: output and residual) to the next stage."""
        self._sending = [(work, tensor) for work, tensor in self._sending if not work.is_completed()]
        hidden = hidden.contiguous()
        self._sending.append((dist.isend(hidden, self._next), hidden))

    def receive(self, buffer: torch.Tensor) -> torch.Tensor:
        """Fill ``buffer`` with the previous stage's hidden states for this step."""
        started = time.perf_counter()
        dist.recv(buffer, self._previous)
        self.waited_seconds += time.perf_counter() - started
        return buffer


def init_model_parallel(
    rank: int, tp_size: int, stage: PipelineStage, init_method: str, device: str = "cpu"
) -> tuple[TensorParallel, StageLink]:
    """Join the world of ``stage.size * tp_size`` ranks as global ``rank``: one TP group per
    stage, and a link to the neighbouring stages."""
    backend = distributed_backend(device)
    if backend == "nccl":
        torch.cuda.set_device(device)
    world_size = stage.size * tp_size
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size)
    tp_group = None
    if tp_size > 1:
        # Every rank creates every stage's group, in the same order, as new_group requires.
        groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(stage.size)]
        tp_group = groups[stage.index]
    return TensorParallel(rank % tp_size, tp_size, tp_group), StageLink(stage, rank, tp_size)


def destroy_model_parallel() -> None:
    """Tear down every process group this rank joined."""
    if dist.is_initialized():
        dist.destroy_process_group()
