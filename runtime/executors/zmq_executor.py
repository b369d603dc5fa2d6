"""What every executor whose ranks live outside the EngineCore shares: the ZeroMQ data path.

Each step's ``SchedulerOutput`` is encoded once and pushed to every rank; every rank answers on
one results socket. Steps may be submitted before earlier ones are collected (a
pipeline's micro-batches); answers are gathered per step. A transfer counts as finished only
when all ranks reported it. A rank that dies, fails or stops answering makes ``submit`` or
``collect`` (and so ``execute``) raise ``ExecutorFailed`` naming it.

Sockets bound on TCP use CurveZMQ: only this executor's workers, which get its keys in their
configuration, can connect (``engine_core/zmq_curve.py``). IPC sockets stay plain.

Subclasses start the ranks (local processes, Ray actors) and say how to tell that one is gone.
"""

import logging
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgspec
import zmq

from strata.engine_core.core_loop import ExecutorFailed
from strata.engine_core.ipc import make_socket
from strata.engine_core.zmq_curve import CurveServer, WorkerCurveKeys
from strata.engine_core.protocol import (
    GrammarBitmask,
    KVConnectorOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
    WorkerFailed,
    WorkerMessage,
    WorkerReady,
)

logger = logging.getLogger(__name__)

POLL_MS = 50
SHUTDOWN_GRACE_S = 3.0
DIAGNOSIS_GRACE_S = 1.0


@dataclass(frozen=True)
class RankExit:
    """A rank whose worker is gone. ``killed``: ended from outside (a signal, a killed actor, a
    lost node) rather than by its own failure; ``cause`` says how, e.g. "killed by signal 9"."""

    rank: int
    killed: bool
    cause: str


class TransferTally:
    """Counts each rank's transfer completions across steps: ranks may finish a transfer in
    different steps, and it is finished only once all of them have."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._sending: Counter[str] = Counter()
        self._receiving: Counter[str] = Counter()

    def merge(self, reports: Iterable[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        """One step's reports, one per rank, into the transfers now finished everywhere."""
        moved, seconds = 0, 0.0
        for report in reports:
            if report is not None:
                self._sending.update(report.finished_sending)
                self._receiving.update(report.finished_recving)
                moved += report.bytes_moved
                seconds += report.transfer_seconds
        done_sending = self._take_complete(self._sending)
        done_receiving = self._take_complete(self._receiving)
        if not (done_sending or done_receiving or moved):
            return None
        return KVConnectorOutput(done_sending, done_receiving, moved, seconds)

    def _take_complete(self, counts: Counter[str]) -> list[str]:
        done = [key for key, count in counts.items() if count == self.size]
        for key in done:
            del counts[key]
        return done


class ZmqExecutor(ABC):
    """Sends steps to ``tp_size * pp_size`` ranks (stage-major) and gathers their answers over
    ZeroMQ (msgspec frames only).

    ``bind_address(name)`` gives the address to bind the socket ``name`` ("results",
    "steps-<rank>") on; the bound endpoints, the ones workers connect to, are
    ``results_endpoint`` and ``step_endpoints``. A subclass starts its workers, giving each
    ``worker_curve_keys`` (None on IPC), then calls ``_await_ready``.
    """

    def __init__(self, tp_size: int, pp_size: int, worker_timeout_s: float, bind_address: Callable[[str], str]) -> None:
        self.size = tp_size * pp_size
        self.pipeline_parallel_size = pp_size
        self._last_stage = range(self.size - tp_size, self.size)  # their first rank's answer has the tokens
        self.worker_timeout_s = worker_timeout_s
        self.num_blocks = 0
        self.num_cpu_blocks = 0
        self.vocab_size = 0
        self.context = zmq.Context()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(WorkerMessage)
        over_tcp = bind_address("results").startswith("tcp://")
        self._curve = CurveServer(self.context) if over_tcp else None
        self.worker_curve_keys: WorkerCurveKeys | None = self._curve.worker_keys if self._curve else None
        secure = self._curve.secure if self._curve else None
        self._results = make_socket(self.context, zmq.PULL, bind_address("results"), bind=True, setup=secure)
        self._steps = [
            make_socket(self.context, zmq.PUSH, bind_address(f"steps-{rank}"), bind=True, setup=secure)
            for rank in range(self.size)
        ]
        # Read back, as a wildcard TCP port ("tcp://host:*") is only known once bound.
        self.results_endpoint = self._results.getsockopt_string(zmq.LAST_ENDPOINT)
        self.step_endpoints = [sock.getsockopt_string(zmq.LAST_ENDPOINT) for sock in self._steps]
        self._transfers = TransferTally(self.size)
        self._answers: dict[int, dict[int, ModelRunnerOutput]] = {}  # step -> rank -> answer
        self._ipc_seconds = 0.0  # encode + send + receive + decode, summed over steps
        self._receive_seconds = 0.0  # since the last step collected
        self._num_steps = 0
        self._step_bytes = 0  # sent to each rank, summed over steps
        self._stage_busy_seconds = [0.0] * pp_size  # the stage's first rank's, summed over steps

    @abstractmethod
    def _exited_ranks(self) -> list[RankExit]:
        """The ranks whose worker is gone; cheap, as it runs whenever the results socket is quiet."""

    @abstractmethod
    def _stop_workers(self, grace_s: float) -> None:
        """The workers were told to shut down: wait up to ``grace_s`` for them, then force them."""

    def _await_ready(self, timeout_s: float) -> None:
        ready: dict[int, WorkerReady] = {}
        deadline = time.monotonic() + timeout_s
        while len(ready) < self.size:
            message = self._receive(deadline, waiting_for=set(range(self.size)) - set(ready), what="start-up")
            if isinstance(message, WorkerReady):
                ready[message.rank] = message
        self.num_blocks = min(r.num_blocks for r in ready.values())
        self.num_cpu_blocks = min(r.num_cpu_blocks for r in ready.values())
        self.vocab_size = ready[0].vocab_size

    def execute(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: Callable[[], bytes] | None = None
    ) -> ModelRunnerOutput:
        self.submit(scheduler_output, grammar_bitmask)
        return self.collect(scheduler_output.step)

    def submit(self, scheduler_output: SchedulerOutput, grammar_bitmask: Callable[[], bytes] | None = None) -> None:
        """Send a step to every rank without waiting for its answers (``collect`` gathers them)."""
        started = time.perf_counter()
        what = f"step {scheduler_output.step}"
        frame = self._encoder.encode(scheduler_output)
        for rank in range(self.size):
            self._push(rank, frame, what)
        self._step_bytes += len(frame)
        ipc_seconds = time.perf_counter() - started
        if scheduler_output.structured_rows:
            # The workers are running the forward pass meanwhile; only the last stage samples.
            assert grammar_bitmask is not None, "structured rows without a bitmask"
            mask = grammar_bitmask()
            started = time.perf_counter()
            mask_frame = self._encoder.encode(GrammarBitmask(scheduler_output.step, mask))
            for rank in self._last_stage:
                self._push(rank, mask_frame, what)
            ipc_seconds += time.perf_counter() - started
        self._ipc_seconds += ipc_seconds

    def _push(self, rank: int, frame: bytes, what: str) -> None:
        """Send ``frame`` to ``rank``. A bound PUSH socket whose one peer has gone (its rank died,
        or its node did) has nowhere to queue, and a plain send would wait for a new peer
        forever: wait only while the rank lives, and no longer than the worker timeout."""
        sock = self._steps[rank]
        deadline = time.monotonic() + self.worker_timeout_s
        while True:
            try:
                sock.send(frame, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                pass
            if sock.poll(POLL_MS, zmq.POLLOUT):
                continue
            if self._exited_ranks():
                raise ExecutorFailed(self._diagnose(None, what))
            if time.monotonic() > deadline:
                raise ExecutorFailed(
                    f"{self._rank_name(rank)} did not take {what} within {self.worker_timeout_s:.0f} s"
                    f"{self._why_silent()}"
                )

    def collect(self, step: int) -> ModelRunnerOutput:
        """Every rank's answer to ``step`` (submitted earlier), merged: the sampled tokens, the
        transfers now finished on all ranks and the adapters some rank could not load. Answers
        to later steps that arrive meanwhile are kept."""
        answers = self._answers.setdefault(step, {})
        deadline = time.monotonic() + self.worker_timeout_s
        while len(answers) < self.size:
            message = self._receive(deadline, set(range(self.size)) - set(answers), f"step {step}")
            if isinstance(message, ModelRunnerOutput) and message.step >= step:
                self._answers.setdefault(message.step, {})[message.rank] = message
        del self._answers[step]
        self._ipc_seconds += self._receive_seconds
        self._receive_seconds = 0.0
        self._num_steps += 1
        tp_size = len(self._last_stage)
        for stage in range(self.pipeline_parallel_size):
            self._stage_busy_seconds[stage] += answers[stage * tp_size].busy_seconds
        first = answers[self._last_stage.start]
        first.kv_connector_output = self._transfers.merge(o.kv_connector_output for o in answers.values())
        # An adapter any rank could not load is failed: its slot is not whole on that rank.
        first.lora_load_errors = {
            lora_id: why for answer in answers.values() for lora_id, why in answer.lora_load_errors.items()
        }
        return first

    def _receive(self, deadline: float, waiting_for: set[int], what: str) -> WorkerMessage:
        """The next worker message; raises ExecutorFailed on a failed, dead or silent rank."""
        while True:
            if self._results.poll(POLL_MS):
                started = time.perf_counter()
                try:
                    message = self._decoder.decode(self._results.recv())
                except (msgspec.DecodeError, msgspec.ValidationError) as error:
                    logger.warning("dropped a malformed worker frame: %s", error)
                    continue
                self._receive_seconds += time.perf_counter() - started
                if isinstance(message, WorkerFailed):
                    raise ExecutorFailed(self._diagnose(message, what))
                return message
            if self._exited_ranks():
                raise ExecutorFailed(self._diagnose(None, what))
            if time.monotonic() > deadline:
                silent = ", ".join(self._rank_name(rank) for rank in sorted(waiting_for))
                raise ExecutorFailed(
                    f"{silent} did not answer {what} within {self.worker_timeout_s:.0f} s"
                    f"{self._why_silent()}"
                )

    def _diagnose(self, failure: WorkerFailed | None, what: str) -> str:
        """Name the root cause. A rank killed from outside makes its peers fail in their
        collectives a moment later, so look for a killed rank before blaming a reporter."""
        deadline = time.monotonic() + DIAGNOSIS_GRACE_S
        while time.monotonic() < deadline:
            killed = next((gone for gone in self._exited_ranks() if gone.killed), None)
            if killed is not None:
                return f"{self._rank_name(killed.rank)} died ({killed.cause}) during {what}"
            time.sleep(0.05)
        if failure is not None:
            return f"{self._rank_name(failure.rank)} failed during {what}: {failure.message.strip().splitlines()[-1]}"
        gone = self._exited_ranks()[0]
        return f"{self._rank_name(gone.rank)} died ({gone.cause}) during {what}"

    def _rank_name(self, rank: int) -> str:
        """How errors name ``rank`` (the Ray executor adds its node)."""
        return f"worker rank {rank}"

    def _why_silent(self) -> str:
        """What more can be told about why ranks stopped answering, to append to the error."""
        return ""

    def stats(self) -> dict[str, float]:
        """IPC time and bytes of step messages each rank got, per step; per pipeline stage ``s``,
        the seconds its first rank computed since start."""
        steps = max(self._num_steps, 1)
        stats = {"ipc_us_per_step": self._ipc_seconds / steps * 1e6, "step_bytes_per_rank": self._step_bytes / steps}
        for stage, busy in enumerate(self._stage_busy_seconds):
            stats[f"busy_seconds_stage{stage}"] = busy
        return stats

    def shutdown(self) -> None:
        """Tell every worker to stop, stop them (politely, then by force), close the sockets."""
        shutdown = self._encoder.encode(Shutdown())
        for sock in self._steps:
            try:
                sock.send(shutdown, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._stop_workers(SHUTDOWN_GRACE_S)
        if self._curve is not None:
            self._curve.stop()
        self.context.destroy(linger=0)
