"""The EngineCore: scheduler + executor, one step at a time.

This module is the loop body; ``launch/engine/engine_process.py`` runs it in its own process behind
ZeroMQ sockets. An executor is anything that runs a ``SchedulerOutput`` on the workers.
"""

import random
import time
from typing import Protocol

import msgspec

from strata.engine_core.kv_connector import SchedulerConnector
from strata.engine_core.protocol import EngineCoreOutputs, EngineCoreRequest, ModelRunnerOutput, SchedulerOutput
from strata.engine_core.request import Request
from strata.engine_core.scheduler import Scheduler, SchedulerConfig


class Executor(Protocol):
    """Runs steps on the workers. ``num_blocks`` is the KV-cache size the workers allocated,
    ``num_cpu_blocks`` their CPU offload tier's (0 = none); ``vocab_size`` bounds token ids."""

    num_blocks: int
    num_cpu_blocks: int
    vocab_size: int

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def stats(self) -> dict[str, float]:
        """Executor-specific timings (e.g. IPC cost per step) for debug calls and benchmarks."""
        ...

    def shutdown(self) -> None: ...


class EngineCore:
    def __init__(
        self, config: SchedulerConfig, executor: Executor, connector: SchedulerConnector | None = None
    ) -> None:
        self.executor = executor
        self.scheduler = Scheduler(config, executor.num_blocks, connector)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; one that can never run is answered with an ``error`` output."""
        bad = next((t for t in request.prompt_token_ids if not 0 <= t < self.executor.vocab_size), None)
        if bad is not None:
            self.scheduler.reject(
                request.request_id, f"prompt token id {bad} is outside the vocabulary [0, {self.executor.vocab_size})"
            )
            return
        params = request.sampling_params
        if params.seed is None:
            # Every request gets a seed so all TP ranks draw the same random numbers.
            params = msgspec.structs.replace(params, seed=random.getrandbits(63))
        self.scheduler.add_request(
            Request(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=params,
                eos_token_id=request.eos_token_id,
                arrival_time=request.arrival_time or time.time(),
                priority=request.priority,
            )
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, so the next requests compute their prompts afresh (blocks
        that running requests hold stay theirs). The CPU offload tier keeps its copies."""
        self.scheduler.kv.reset_prefix_cache()

    def step(self) -> EngineCoreOutputs:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def shutdown(self) -> None:
        self.executor.shutdown()
