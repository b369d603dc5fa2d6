"""A worker process: ``python -m strata.worker.worker_process`` with its config (msgpack) on
stdin. It runs every step the executor sends and answers on the results socket; the answer of
the first tensor-parallel rank of the last pipeline stage carries the sampled tokens."""

import gc
import logging
import sys
import time
import traceback

import msgspec
import torch
import zmq

from strata.engine_core.ipc import die_with_parent, make_socket
from strata.engine_core.protocol import (
    ExecutorMessage,
    GrammarBitmask,
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
    WorkerFailed,
    WorkerReady,
)
from strata.engine_core.zmq_curve import secure_client
from strata.worker.config import WorkerConfig, WorkerProcessConfig
from strata.worker.devices import check_device_visible
from strata.worker.model_runner import ModelRunner, default_num_threads
from strata.worker.parallel_state import TensorParallel, init_tensor_parallel
from strata.worker.pipeline_parallel import PipelineStage, StageLink, destroy_model_parallel, init_model_parallel

logger = logging.getLogger("worker")


def serve(config: WorkerProcessConfig) -> None:
    rank = config.worker.rank
    context = zmq.Context()
    secure = secure_client(config.curve) if config.curve is not None else None
    steps = make_socket(context, zmq.PULL, config.step_endpoint, bind=False, setup=secure)
    results = make_socket(context, zmq.PUSH, config.result_endpoint, bind=False, setup=secure)
    encoder = msgspec.msgpack.Encoder()
    tp = None
    try:
        num_ranks = config.worker.tensor_parallel_size * config.worker.pipeline_parallel_size
        torch.set_num_threads(default_num_threads(num_ranks))
        device = config.worker.device
        check_device_visible(device, rank, num_ranks, torch.cuda.device_count())
        tp, link = _join_groups(config.worker)
        runner = ModelRunner(config.worker, tp, link)
        ready = WorkerReady(rank, runner.num_blocks, runner.model.vocab_size, runner.num_cpu_blocks)
        results.send(encoder.encode(ready))
        samples = runner.model.stage.is_last and tp.rank == 0
        gc.freeze()  # what start-up made lives on: full collections between steps skip it (docs/performance.md)
        try:
            _run_steps(runner, steps, results, encoder, rank, samples)
        finally:
            runner.shutdown()
    except Exception:
        logger.exception("rank %d failed", rank)
        results.send(encoder.encode(WorkerFailed(rank, traceback.format_exc(limit=5))))
        raise
    finally:
        if tp is not None:
            tp.destroy()
        destroy_model_parallel()
        context.destroy(linger=1000)


def _join_groups(config: WorkerConfig) -> tuple[TensorParallel, StageLink | None]:
    """This rank's tensor-parallel group and, with pipeline stages, its link to the neighbouring ones."""
    tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
    if pp_size == 1:
        return init_tensor_parallel(config.rank, tp_size, config.distributed_init_method, config.device), None
    partition = tuple(config.pipeline_layer_partition) if config.pipeline_layer_partition else None
    stage = PipelineStage(config.rank // tp_size, pp_size, partition)
    return init_model_parallel(config.rank, tp_size, stage, config.distributed_init_method, config.device)


def _run_steps(runner: ModelRunner, steps: zmq.Socket, results: zmq.Socket, encoder, rank: int, samples: bool) -> None:
    decoder = msgspec.msgpack.Decoder(ExecutorMessage)

    def receive() -> ExecutorMessage | None:
        try:
            return decoder.decode(steps.recv())
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as error:
            logger.warning("rank %d dropped a malformed step frame: %s", rank, error)
            return None

    def grammar_bitmask_of(step: SchedulerOutput) -> bytes:
        """The step's masks: the next frame, which the EngineCore sends once it has them."""
        while True:
            message = receive()
            if isinstance(message, GrammarBitmask) and message.step == step.step:
                return message.bitmask
            if message is not None:
                raise RuntimeError(f"expected the grammar bitmask of step {step.step}, got {type(message).__name__}")

    while True:
        message = receive()
        if message is None or isinstance(message, GrammarBitmask):
            continue
        if isinstance(message, Shutdown):
            return
        started, waited = time.perf_counter(), _waited_seconds(runner)
        output = runner.execute(message, lambda: grammar_bitmask_of(message))
        output.busy_seconds = time.perf_counter() - started - (_waited_seconds(runner) - waited)
        if not samples:  # the tokens are one rank's to report; every rank its transfers and failed loads
            output = ModelRunnerOutput(
                output.step, rank, kv_connector_output=output.kv_connector_output, busy_seconds=output.busy_seconds,
                lora_load_errors=output.lora_load_errors,
            )
        results.send(encoder.encode(output))


def _waited_seconds(runner: ModelRunner) -> float:
    return runner.link.waited_seconds if runner.link is not None else 0.0


def main() -> None:
    die_with_parent()
    config = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=WorkerProcessConfig)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{config.worker.rank} %(levelname)s %(message)s")
    try:
        serve(config)
    except Exception:
        sys.exit(1)


if __name__ == "__main__":
    main()
