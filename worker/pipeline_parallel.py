"""Pipeline parallelism: which decoder layers a stage holds, and how its hidden states reach the next.

Ranks are numbered stage-major: global rank ``stage * tp_size + tp_rank``. Every rank of a
stage computes the same hidden states (the TP all-reduce leaves them whole on each), so TP rank
``t`` of stage ``s`` sends them, with the residual stream, to TP rank ``t`` of stage ``s + 1``
over point-to-point ``torch.distributed`` (gloo on CPU, NCCL on CUDA). The stages before the
last sample nothing: TP rank ``t`` of the last stage sends the tokens each step's rows gained to
TP rank ``t`` of every earlier stage the same way.
"""

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from strata.worker.devices import distributed_backend
from strata.worker.input_batch import InputBatch
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
    """This rank's point-to-point link to its peers in the other stages.

    Sends do not wait for the receiver: the next stage may still be busy with an earlier
    micro-batch, and this stage goes on to the next one meanwhile. A send's tensor is kept
    until its transfer completes. Tokens travel in ``sampled_group``, a group of their own: on
    NCCL each group has its own stream, so hidden states going one way never queue behind
    tokens going the other."""

    def __init__(
        self,
        stage: PipelineStage,
        rank: int,
        tp_size: int,
        device: torch.device | str,
        sampled_group: dist.ProcessGroup,
    ) -> None:
        self.stage = stage
        self.device = torch.device(device)
        self._sampled_group = sampled_group
        tp_rank = rank % tp_size
        self._previous = rank - tp_size
        self._next = rank + tp_size
        self._sampler = (stage.size - 1) * tp_size + tp_rank
        self._earlier = [s * tp_size + tp_rank for s in range(stage.index)] if stage.is_last else []
        self._sending: list[tuple[dist.Work, torch.Tensor]] = []
        self.waited_seconds = 0.0  # in receives, since start: the stage's idle time inside steps

    def send(self, hidden: torch.Tensor) -> None:
        """Hand a step's hidden states (``[2, T, hidden]``: output and residual) to the next stage."""
        self._post(hidden.contiguous(), self._next)

    def receive(self, buffer: torch.Tensor) -> torch.Tensor:
        """Fill ``buffer`` with the previous stage's hidden states for this step."""
        return self._receive(buffer, self._previous)

    def send_sampled(self, counts: np.ndarray, tokens: np.ndarray) -> None:
        """Last stage: tell every earlier stage how many tokens each row of a step gained
        (``counts``, in batch order) and which (``tokens``, concatenated)."""
        counts_tensor = torch.from_numpy(counts.astype(np.int32)).to(self.device)
        tokens_tensor = torch.from_numpy(tokens.astype(np.int32)).to(self.device)
        for peer in self._earlier:
            self._post(counts_tensor, peer, self._sampled_group)
            if len(tokens):
                self._post(tokens_tensor, peer, self._sampled_group)

    def receive_sampled(self, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """A stage before the last: the counts and tokens of a step of ``num_rows`` rows, as sent."""
        counts_buffer = torch.empty(num_rows, dtype=torch.int32, device=self.device)
        counts = self._receive(counts_buffer, self._sampler, self._sampled_group).cpu().numpy()
        total = int(counts.sum())
        if not total:
            return counts, np.zeros(0, dtype=np.int32)
        tokens = self._receive(torch.empty(total, dtype=torch.int32, device=self.device), self._sampler, self._sampled_group)
        return counts, tokens.cpu().numpy()

    def _post(self, tensor: torch.Tensor, peer: int, group: dist.ProcessGroup | None = None) -> None:
        """Send without waiting; ``group`` None: the default group (hidden states)."""
        self._sending = [(work, sent) for work, sent in self._sending if not work.is_completed()]
        self._sending.append((dist.isend(tensor, peer, group=group), tensor))

    def _receive(self, buffer: torch.Tensor, peer: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        started = time.perf_counter()
        dist.recv(buffer, peer, group=group)
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
    # Every rank creates every group, in the same order, as new_group requires.
    tp_group = None
    if tp_size > 1:
        groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(stage.size)]
        tp_group = groups[stage.index]
    sampled_group = dist.new_group(list(range(world_size)))  # its ranks are the global ones
    link = StageLink(stage, rank, tp_size, device, sampled_group)
    return TensorParallel(rank % tp_size, tp_size, tp_group), link


def destroy_model_parallel() -> None:
    """Tear down every process group this rank joined."""
    if dist.is_initialized():
        dist.destroy_process_group()


class SampledTokenFeed:
    """On a stage before the last: the tokens the last stage sampled, put into this stage's batch
    rows before a step that may need them.

    The EngineCore says with each step which earlier step's output it had when it scheduled it
    (``collected_step``): the last stage sent those steps' tokens before answering them, so they
    are here to receive. A row whose handle a new request took since a step gets none of that
    step's tokens: they were its earlier owner's."""

    def __init__(self, link: StageLink, batch: InputBatch) -> None:
        self.link = link
        self.batch = batch
        self._awaiting: deque[tuple[int, np.ndarray]] = deque()  # (step, its rows) whose tokens are to come
        self._added_at = np.zeros(len(batch.num_tokens), dtype=np.int64)  # step that put each row's request there

    def row_added(self, row: int, step: int) -> None:
        self._added_at[row] = step

    def step_ran(self, step: int, rows: np.ndarray) -> None:
        self._awaiting.append((step, rows))

    def catch_up(self, collected_step: int) -> None:
        """Append the tokens of every step up to ``collected_step`` not yet appended."""
        while self._awaiting and self._awaiting[0][0] <= collected_step:
            step, rows = self._awaiting.popleft()
            counts, tokens = self.link.receive_sampled(len(rows))
            same_owner = self._added_at[rows] <= step
            if not same_owner.all():
                tokens = tokens[np.repeat(same_owner, counts)]
                rows, counts = rows[same_owner], counts[same_owner]
            self.batch.append_sampled(rows, counts, tokens)
