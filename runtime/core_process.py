"""The EngineCore process: ``python -m strata.runtime.core_process`` with its config (msgpack) on
stdin. Starts the executor (and through it the workers), then serves the busy loop. It never
imports torch: the workers do the tensor work."""

import gc
import logging
import signal
import sys

import msgspec
import zmq

from strata.engine_core.core_loop import EngineCoreLoop, ExecutorFailed
from strata.engine_core.core import EngineCore, Executor
from strata.engine_core.ipc import IpcDir, die_with_parent
from strata.engine_core.kv_events import KVEventPublisher
from strata.engine_core.protocol import EngineReady
from strata.engine_core.scheduler import SchedulerConfig
from strata.runtime.engine_args import make_offload_connector, tokenizer_json_path
from strata.runtime.executors.ray_config import RayConfig
from strata.worker.config import WorkerConfig

logger = logging.getLogger("engine_core")

INPUT_ENDPOINT = "engine-input"
OUTPUT_ENDPOINT = "engine-output"


class EngineProcessConfig(msgspec.Struct):
    scheduler: SchedulerConfig
    worker: WorkerConfig
    executor: str  # "mp" | "ray"
    ipc_dir: str  # owned by the frontend, which removes it even if this process is killed
    worker_timeout_s: float = 60.0
    ray: RayConfig | None = None  # executor "ray" only
    kv_offload_policy: str = "lru"
    kv_events_endpoints: tuple[str, str] | None = None  # (publish, replay) to bind


def build_executor(config: EngineProcessConfig) -> Executor:
    if config.executor == "mp":
        from strata.runtime.executors.mp_executor import MultiprocExecutor

        return MultiprocExecutor(config.worker, config.ipc_dir, config.worker_timeout_s)
    if config.executor == "ray":
        from strata.runtime.executors.ray_executor import RayExecutor

        return RayExecutor(config.worker, config.ray or RayConfig(), config.worker_timeout_s)
    raise ValueError(f"unknown executor {config.executor!r}")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main() -> None:
    die_with_parent()
    config = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=EngineProcessConfig)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    ipc = IpcDir(config.ipc_dir)
    loop = EngineCoreLoop(ipc.endpoint(INPUT_ENDPOINT), ipc.endpoint(OUTPUT_ENDPOINT))
    executor = None
    publisher = None
    try:
        try:
            executor = build_executor(config)
            if config.kv_events_endpoints is not None:
                publisher = KVEventPublisher(*config.kv_events_endpoints)
        except (ExecutorFailed, ValueError, OSError, zmq.ZMQError) as error:
            loop.report_startup_failure(f"the engine failed to start: {error}")
            sys.exit(1)
        connector = make_offload_connector(config.scheduler, config.worker, config.kv_offload_policy, executor.num_cpu_blocks)
        core = EngineCore(
            config.scheduler, executor, connector, publisher, tokenizer_path=tokenizer_json_path(config.worker.model)
        )
        gc.freeze()  # what start-up made lives on: full collections between steps skip it
        loop.serve(core, EngineReady(executor.num_blocks, executor.vocab_size, executor.num_cpu_blocks))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
        if executor is not None:
            executor.shutdown()
        if publisher is not None:
            publisher.close()
        loop.close()


if __name__ == "__main__":
    main()
