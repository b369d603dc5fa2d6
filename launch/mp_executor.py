"""The local multiprocess executor: one worker process per tensor-parallel rank on this machine.

Each step's ``SchedulerOutput`` is encoded once and pushed to every rank; every rank answers on
one results socket. A transfer counts as finished only when all ranks reported it. A rank that
dies, fails or stops answering makes ``execute`` raise ``ExecutorFailed`` naming it.
"""

import logging
import os
import subprocess
import sys
import time
from collections import Counter

import msgspec
import zmq

from engine_core.core_loop import ExecutorFailed
from engine_core.ipc import IpcDir, free_tcp_port, make_socket
from engine_core.protocol import (
    KVConnectorOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
    WorkerFailed,
    WorkerMessage,
    WorkerReady,
)
from worker.config import WorkerConfig

logger = logging.getLogger(__name__)

POLL_MS = 50


class MultiprocExecutor:
    def __init__(
        self,
        config: WorkerConfig,
        ipc_dir: str | None = None,
        worker_timeout_s: float = 60.0,
        startup_timeout_s: float = 600.0,
    ) -> None:
        self.size = config.tensor_parallel_size
        self.worker_timeout_s = worker_timeout_s
        self.ipc = IpcDir(ipc_dir)
        self.context = zmq.Context()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(WorkerMessage)
        self._results = make_socket(self.context, zmq.PULL, self.ipc.endpoint("results"), bind=True)
        self._steps = [
            make_socket(self.context, zmq.PUSH, self.ipc.endpoint(f"steps-{rank}"), bind=True) for rank in range(self.size)
        ]
        self._transfer_reports: tuple[Counter[str], Counter[str]] = (Counter(), Counter())
        self._ipc_seconds = 0.0  # encode + send + receive + decode, summed over steps
        self._receive_seconds = 0.0  # of the step in progress
        self._num_steps = 0
        init_method = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.processes = [self._start_worker(config, rank, init_method) for rank in range(self.size)]
        try:
            ready = self._wait_ready(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = min(r.num_blocks for r in ready)
        self.vocab_size = ready[0].vocab_size

    def _start_worker(self, config: WorkerConfig, rank: int, init_method: str) -> subprocess.Popen:
        from worker.worker_process import WorkerProcessConfig

        device = f"cuda:{rank}" if config.device == "cuda" else config.device
        worker = msgspec.structs.replace(config, rank=rank, device=device, distributed_init_method=init_method)
        payload = msgspec.msgpack.encode(
            WorkerProcessConfig(worker, self.ipc.endpoint(f"steps-{rank}"), self.ipc.endpoint("results"))
        )
        env = dict(os.environ)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks of one machine talk over loopback
        process = subprocess.Popen([sys.executable, "-m", "worker.worker_process"], stdin=subprocess.PIPE, env=env)
        assert process.stdin is not None
        process.stdin.write(payload)
        process.stdin.close()
        return process

    def _wait_ready(self, timeout_s: float) -> list[WorkerReady]:
        ready: dict[int, WorkerReady] = {}
        deadline = time.monotonic() + timeout_s
        while len(ready) < self.size:
            message = self._receive(deadline, waiting_for=set(range(self.size)) - set(ready), what="start-up")
            if isinstance(message, WorkerReady):
                ready[message.rank] = message
        return [ready[rank] for rank in range(self.size)]

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        started = time.perf_counter()
        frame = self._encoder.encode(scheduler_output)
        for sock in self._steps:
            sock.send(frame, copy=False)
        ipc_seconds = time.perf_counter() - started
        outputs: dict[int, ModelRunnerOutput] = {}
        deadline = time.monotonic() + self.worker_timeout_s
        while len(outputs) < self.size:
            message = self._receive(deadline, set(range(self.size)) - set(outputs), f"step {scheduler_output.step}")
            if isinstance(message, ModelRunnerOutput) and message.step == scheduler_output.step:
                outputs[message.rank] = message
        self._ipc_seconds += ipc_seconds + self._receive_seconds
        self._receive_seconds = 0.0
        self._num_steps += 1
        first = outputs[0]
        first.kv_connector_output = self._merge_transfers(outputs.values())
        return first

    def _receive(self, deadline: float, waiting_for: set[int], what: str):
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
            if any(process.poll() is not None for process in self.processes):
                raise ExecutorFailed(self._diagnose(None, what))
            if time.monotonic() > deadline:
                raise ExecutorFailed(
                    f"worker rank(s) {sorted(waiting_for)} did not answer {what} within {self.worker_timeout_s:.0f} s"
                )

    def _diagnose(self, failure: WorkerFailed | None, what: str) -> str:
        """Name the root cause. A rank killed by a signal makes its peers fail in their
        collectives a moment later, so look for a killed rank before blaming a reporter."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for rank, process in enumerate(self.processes):
                code = process.poll()
                if code is not None and code < 0:
                    return f"worker rank {rank} died (killed by signal {-code}) during {what}"
            time.sleep(0.05)
        if failure is not None:
            return f"worker rank {failure.rank} failed during {what}: {failure.message.strip().splitlines()[-1]}"
        rank, code = next((r, p.poll()) for r, p in enumerate(self.processes) if p.poll() is not None)
        return f"worker rank {rank} died (exit code {code}) during {what}"

    def _merge_transfers(self, outputs) -> KVConnectorOutput | None:
        """Transfers every rank has finished, across steps (ranks may finish in different steps)."""
        sending, receiving = self._transfer_reports
        reported = [o.kv_connector_output for o in outputs if o.kv_connector_output is not None]
        for output in reported:
            sending.update(output.finished_sending)
            receiving.update(output.finished_recving)
        if not sending and not receiving:
            return None
        done_sending = [key for key, count in sending.items() if count == self.size]
        done_receiving = [key for key, count in receiving.items() if count == self.size]
        for key in done_sending:
            del sending[key]
        for key in done_receiving:
            del receiving[key]
        return KVConnectorOutput(done_sending, done_receiving)

    def stats(self) -> dict[str, float]:
        return {"ipc_us_per_step": self._ipc_seconds / self._num_steps * 1e6 if self._num_steps else 0.0}

    def shutdown(self) -> None:
        """Stop every worker (politely, then by force) and remove the IPC files."""
        shutdown = self._encoder.encode(Shutdown())
        for sock in self._steps:
            try:
                sock.send(shutdown, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + 3
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.context.destroy(linger=0)
        self.ipc.cleanup()
