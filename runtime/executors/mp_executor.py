"""The local multiprocess executor: one worker process per rank (pipeline stage x tensor-parallel rank) on this machine.

The ranks talk to the executor over private IPC sockets, with the data path and the failure
detection of ``ZmqExecutor``; a rank is gone when its process has exited.
"""

import os
import subprocess
import sys
import time

import msgspec

from strata.engine_core.ipc import IpcDir, free_tcp_port
from strata.runtime.executors.zmq_executor import RankExit, ZmqExecutor
from strata.worker.config import WorkerConfig, WorkerProcessConfig
from strata.worker.devices import rank_device


class MultiprocExecutor(ZmqExecutor):
    """Ranks as child processes (``python -m strata.worker.worker_process``) that die with this one."""

    def __init__(
        self,
        config: WorkerConfig,
        ipc_dir: str | None = None,
        worker_timeout_s: float = 60.0,
        startup_timeout_s: float = 600.0,
    ) -> None:
        self.ipc = IpcDir(ipc_dir)
        super().__init__(config.tensor_parallel_size, config.pipeline_parallel_size, worker_timeout_s, self._bind_address)
        init_method = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.processes = [self._start_worker(config, rank, init_method) for rank in range(self.size)]
        try:
            self._await_ready(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _bind_address(self, name: str) -> str:
        return self.ipc.endpoint(name)

    def _start_worker(self, config: WorkerConfig, rank: int, init_method: str) -> subprocess.Popen:
        device = rank_device(config.device, rank)
        worker = msgspec.structs.replace(config, rank=rank, device=device, distributed_init_method=init_method)
        payload = msgspec.msgpack.encode(
            WorkerProcessConfig(worker, self.step_endpoints[rank], self.results_endpoint, self.worker_curve_keys)
        )
        env = dict(os.environ)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks of one machine talk over loopback
        # Idle OpenMP threads spin briefly (fast wake-ups between a step's ops), then sleep
        # instead of holding a core the EngineCore needs between steps: same throughput as the
        # default long spin, a third of its EngineCore-side IPC time (docs/performance.md, process split).
        env.setdefault("GOMP_SPINCOUNT", "10000")
        process = subprocess.Popen([sys.executable, "-m", "strata.worker.worker_process"], stdin=subprocess.PIPE, env=env)
        assert process.stdin is not None
        process.stdin.write(payload)
        process.stdin.close()
        return process

    def _exited_ranks(self) -> list[RankExit]:
        exits = []
        for rank, process in enumerate(self.processes):
            code = process.poll()
            if code is not None:
                cause = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                exits.append(RankExit(rank, killed=code < 0, cause=cause))
        return exits

    def _stop_workers(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def shutdown(self) -> None:
        """Stop every worker (politely, then by force) and remove the IPC files."""
        super().shutdown()
        self.ipc.cleanup()
