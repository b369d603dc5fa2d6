"""The real Scheduler with the offloading connector, driven by a fake worker that keeps the
KV itself: each GPU and CPU block records, slot by slot, the token whose KV it holds."""

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from strata.connector.offloading_scheduler import OffloadingConnectorScheduler
from strata.engine_core.protocol import (
    BlockTransfer,
    EngineCoreOutputs,
    KVConnectorOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    unpack_handles,
)
from strata.engine_core.request import Request
from strata.engine_core.sampling_params import SamplingParams
from strata.engine_core.scheduler import Scheduler, SchedulerConfig

# The persistent-batch fake worker of the scheduler tests, extended here rather than copied.
from fake_runner import FakeRunner, Result, Row, next_token, step


@dataclass
class _Copy:
    transfer: BlockTransfer
    is_load: bool
    done_at: int  # the step whose output reports it


@dataclass
class OffloadingFakeRunner(FakeRunner):
    """``FakeRunner`` plus KV contents and asynchronous copies.

    A step starts the copies its metadata lists, runs the forward (writes the new tokens'
    KV, then checks that every scheduled request finds its own earlier tokens in the blocks
    it attends to), and lands the copies due this step, reporting them. A copy lands ``copy_steps`` steps after
    the one that started it (0: the same step), or a random 0..``copy_steps`` with ``rng``.
    Data moves when a copy lands, and a load's GPU blocks hold garbage until then. Anything
    that touches a block an unfinished copy uses in a conflicting way fails at once.
    """

    copy_steps: int = 0
    rng: random.Random | None = None
    gpu: dict[int, list[int | None] | None] = field(default_factory=dict)  # None: garbage
    cpu: dict[int, list[int | None]] = field(default_factory=dict)
    copies: dict[str, _Copy] = field(default_factory=dict)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if out.kv_connector_metadata is not None:
            for transfer in out.kv_connector_metadata.stores:
                self._start_copy(transfer, is_load=False, step=out.step)
            for transfer in out.kv_connector_metadata.loads:
                self._start_copy(transfer, is_load=True, step=out.step)
        result = super().execute(out)
        batch = [(self.rows[new.handle], new.num_scheduled_tokens) for new in out.new_requests]
        batch += [(self.rows[h], out.cached.num_tokens.get(h, 1)) for h in unpack_handles(out.cached.handles)]
        # Like each model layer: first write the new tokens' KV of the whole batch, then
        # attend (a request may hit blocks that another one fills in this same step).
        for row, num_new in batch:
            self._write_kv(row, num_new)
        for row, num_new in batch:
            self._check_attended_kv(row, row.num_computed - num_new)
        result.kv_connector_output = self._land_copies(out.step)
        return result

    def _start_copy(self, transfer: BlockTransfer, is_load: bool, step: int) -> None:
        assert len(transfer.gpu_block_ids) == len(transfer.cpu_block_ids)
        busy_gpu = {g for c in self.copies.values() for g in c.transfer.gpu_block_ids}
        busy_cpu = {b for c in self.copies.values() for b in c.transfer.cpu_block_ids}
        loading_gpu = {g for c in self.copies.values() if c.is_load for g in c.transfer.gpu_block_ids}
        storing_cpu = {b for c in self.copies.values() if not c.is_load for b in c.transfer.cpu_block_ids}
        if is_load:
            assert busy_gpu.isdisjoint(transfer.gpu_block_ids), "load into a GPU block a copy uses"
            assert storing_cpu.isdisjoint(transfer.cpu_block_ids), "load from a CPU block being stored"
            for gpu_id, cpu_id in zip(transfer.gpu_block_ids, transfer.cpu_block_ids):
                assert self.cpu.get(cpu_id) is not None, "load from a CPU block never stored"
                self.gpu[gpu_id] = None
        else:
            assert busy_cpu.isdisjoint(transfer.cpu_block_ids), "store into a CPU block a copy uses"
            assert loading_gpu.isdisjoint(transfer.gpu_block_ids), "store from a GPU block being loaded"
            for gpu_id in transfer.gpu_block_ids:
                content = self.gpu.get(gpu_id)
                assert content is not None and None not in content, "store of a block not yet full"
        delay = self.rng.randint(0, self.copy_steps) if self.rng else self.copy_steps
        self.copies[transfer.transfer_id] = _Copy(transfer, is_load, step + delay)

    def _write_kv(self, row: Row, num_new: int) -> None:
        busy_gpu = {g for c in self.copies.values() for g in c.transfer.gpu_block_ids}
        for position in range(row.num_computed - num_new, row.num_computed):
            block_id = row.block_ids[position // self.block_size]
            assert block_id not in busy_gpu, f"forward writes GPU block {block_id} while a copy uses it"
            content = self.gpu.get(block_id)
            if content is None:
                content = self.gpu[block_id] = [None] * self.block_size
            content[position % self.block_size] = row.token_ids[position]

    def _check_attended_kv(self, row: Row, num_tokens: int) -> None:
        """The first ``num_tokens`` KV slots of the request's blocks hold its own tokens."""
        size = self.block_size
        for index in range(-(-num_tokens // size)):
            expected = row.token_ids[index * size : min(num_tokens, (index + 1) * size)]
            content = self.gpu.get(row.block_ids[index])
            assert content is not None and content[: len(expected)] == expected, (
                f"{row.request_id}: GPU block {row.block_ids[index]} does not hold its tokens"
            )

    def _land_copies(self, step: int) -> KVConnectorOutput:
        output = KVConnectorOutput()
        for transfer_id, copy in list(self.copies.items()):
            if copy.done_at > step:
                continue
            del self.copies[transfer_id]
            pairs = zip(copy.transfer.gpu_block_ids, copy.transfer.cpu_block_ids)
            if copy.is_load:
                for gpu_id, cpu_id in pairs:
                    self.gpu[gpu_id] = list(self.cpu[cpu_id])
                output.finished_recving.append(transfer_id)
            else:
                for gpu_id, cpu_id in pairs:
                    self.cpu[cpu_id] = list(self.gpu[gpu_id])
                output.finished_sending.append(transfer_id)
        return output


@dataclass
class OffloadEngine:
    """A scheduler, its offloading connector and the fake worker, stepped together."""

    scheduler: Scheduler
    connector: OffloadingConnectorScheduler
    runner: OffloadingFakeRunner
    results: dict[str, Result] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    tokens_computed: int = 0  # every token the model ran, prompt or not

    def add(self, request: Request) -> Request:
        self.scheduler.add_request(request)
        return request

    def step(self) -> tuple[SchedulerOutput, EngineCoreOutputs]:
        out, outputs = step(self.scheduler, self.runner, self.tokens, self.results)
        self.connector.tier.check_invariants()
        self.tokens_computed += out.total_num_scheduled_tokens
        return out, outputs

    def steps(self, max_steps: int = 10_000) -> Iterator[tuple[SchedulerOutput, EngineCoreOutputs]]:
        """Step until the scheduler has nothing left, copies included."""
        for _ in range(max_steps):
            if not self.scheduler.has_work():
                return
            yield self.step()
        raise AssertionError(f"not done after {max_steps} steps")

    def run(self) -> dict[str, Result]:
        for _ in self.steps():
            pass
        return self.results

    def assert_idle(self) -> None:
        """Nothing leaked: every GPU block free, no CPU block pinned or in flight."""
        kv = self.scheduler.kv
        assert not kv.held and not kv.req_to_blocks and kv.num_free_blocks == kv.num_blocks
        assert self.connector.tier.num_pinned == 0 and self.connector.tier.num_in_flight == 0
        assert not self.connector._requests and not self.connector._transfers and not self.connector._loading


def make_engine(
    num_gpu_blocks: int,
    num_cpu_blocks: int,
    *,
    block_size: int = 4,
    factor: int = 1,
    policy: str = "lru",
    copy_steps: int = 0,
    rng: random.Random | None = None,
    **config,
) -> OffloadEngine:
    config.setdefault("max_num_batched_tokens", 256)
    connector = OffloadingConnectorScheduler(block_size, block_size * factor, num_cpu_blocks, policy)
    scheduler = Scheduler(SchedulerConfig(block_size=block_size, **config), num_gpu_blocks, connector)
    return OffloadEngine(scheduler, connector, OffloadingFakeRunner(block_size, copy_steps=copy_steps, rng=rng))


def make_request(request_id: str, prompt: list[int], max_tokens: int = 2) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens), None, 0.0)


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    """What the fake worker generates for this prompt, however the work was scheduled."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]
