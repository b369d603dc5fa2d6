"""The EngineCore: scheduler + executor, one step at a time.

This module is the loop body; ``launch/engine/engine_process.py`` runs it in its own process behind
ZeroMQ sockets. An executor is anything that runs a ``SchedulerOutput`` on the workers.
"""

import random
import time
from typing import Protocol

import msgspec

from strata.engine_core.kv_connector import SchedulerConnector
from strata.engine_core.kv_events import KVEventPublisher
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
    """Steps the scheduler on the executor. With an ``event_publisher``, every step's KV
    events go out as one batch; without, the connector's are still drained and dropped."""

    def __init__(
        self,
        config: SchedulerConfig,
        executor: Executor,
        connector: SchedulerConnector | None = None,
        event_publisher: KVEventPublisher | None = None,
    ) -> None:
        self.executor = executor
        self.event_publisher = event_publisher
        self.scheduler = Scheduler(config, executor.num_blocks, connector, record_kv_events=event_publisher is not None)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; one that can never run is answered with an ``error`` output."""
        error = self._token_id_error(request)
        if error is not None:
            self.scheduler.reject(request.request_id, error)
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
                cache_salt=request.cache_salt,
            )
        )

    def _token_id_error(self, request: EngineCoreRequest) -> str | None:
        """Every token id that would reach a worker must index its vocabulary: an id outside
        it makes the worker's sampler index out of range and takes the whole engine down."""
        vocab_size = self.executor.vocab_size
        named_ids = (
            ("prompt token id", request.prompt_token_ids),
            ("stop_token_ids entry", request.sampling_params.stop_token_ids or ()),
            ("eos_token_id", () if request.eos_token_id is None else (request.eos_token_id,)),
        )
        for name, token_ids in named_ids:
            bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                return f"{name} {bad} is outside the vocabulary [0, {vocab_size})"
        return None

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> EngineCoreOutputs:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        events = self.scheduler.take_kv_events()
        if self.event_publisher is not None:
            self.event_publisher.publish(events)
        return outputs

    def reset_prefix_cache(self) -> None:
        self.scheduler.kv.reset_prefix_cache()
        if self.event_publisher is not None:
            self.event_publisher.publish(self.scheduler.take_kv_events())

    def shutdown(self) -> None:
        self.executor.shutdown()
