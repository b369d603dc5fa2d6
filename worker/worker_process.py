"""A tensor-parallel worker process: ``python -m strata.worker.worker_process`` with its config
(msgpack) on stdin. It runs every step the executor broadcasts and answers on the results
socket; rank 0's answer carries the sampled tokens."""

import logging
import sys
import traceback

import msgspec
import torch
import zmq

from strata.engine_core.ipc import die_with_parent, make_socket
from strata.engine_core.protocol import ExecutorMessage, ModelRunnerOutput, Shutdown, WorkerFailed, WorkerReady
from strata.worker.config import WorkerConfig
from strata.worker.devices import check_device_visible
from strata.worker.model_runner import ModelRunner, default_num_threads
from strata.worker.parallel_state import init_tensor_parallel

logger = logging.getLogger("worker")


class WorkerProcessConfig(msgspec.Struct):
    worker: WorkerConfig
    step_endpoint: str  # the executor binds a PUSH socket per rank here
    result_endpoint: str  # the executor's PULL socket, shared by all ranks


def serve(config: WorkerProcessConfig) -> None:
    rank = config.worker.rank
    context = zmq.Context()
    steps = make_socket(context, zmq.PULL, config.step_endpoint, bind=False)
    results = make_socket(context, zmq.PUSH, config.result_endpoint, bind=False)
    encoder = msgspec.msgpack.Encoder()
    tp = None
    try:
        torch.set_num_threads(default_num_threads(config.worker.tensor_parallel_size))
        device = config.worker.device
        check_device_visible(device, rank, config.worker.tensor_parallel_size, torch.cuda.device_count())
        tp = init_tensor_parallel(rank, config.worker.tensor_parallel_size, config.worker.distributed_init_method, device)
        runner = ModelRunner(config.worker, tp)
        ready = WorkerReady(rank, runner.num_blocks, runner.model.vocab_size, runner.num_cpu_blocks)
        results.send(encoder.encode(ready))
        try:
            _run_steps(runner, steps, results, encoder, rank)
        finally:
            runner.shutdown()
    except Exception:
        logger.exception("rank %d failed", rank)
        results.send(encoder.encode(WorkerFailed(rank, traceback.format_exc(limit=5))))
        raise
    finally:
        if tp is not None:
            tp.destroy()
        context.destroy(linger=1000)


def _run_steps(runner: ModelRunner, steps: zmq.Socket, results: zmq.Socket, encoder, rank: int) -> None:
    decoder = msgspec.msgpack.Decoder(ExecutorMessage)
    while True:
        frame = steps.recv()
        try:
            message = decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as error:
            logger.warning("rank %d dropped a malformed step frame: %s", rank, error)
            continue
        if isinstance(message, Shutdown):
            return
        output = runner.execute(message)
        if rank != 0:  # the tokens are rank 0's to report; every rank reports its transfers
            output = ModelRunnerOutput(output.step, rank, kv_connector_output=output.kv_connector_output)
        results.send(encoder.encode(output))


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
