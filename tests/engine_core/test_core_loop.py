"""The EngineCore loop's output side: it sends without waiting on the frontend, so a frontend that
is not reading never stalls the steps, and what it missed arrives in order once it reads; a
step that carries nothing but stats wakes the frontend at most once a stats interval."""

import threading
import time

import msgspec
import zmq

from strata.engine_core.core_loop import EngineCoreLoop, ExecutorFailed
from strata.engine_core.protocol import (
    CoreMessage, EngineCoreOutputs, EngineCoreRequest, EngineDead, EngineReady, FinishedRequest, SchedulerStats,
)
from strata.engine_core.sampling_params import SamplingParams


class CountingCore:
    """A core with ``steps`` steps of work, each output naming its step; a request ends it."""

    def __init__(self, steps: int) -> None:
        self.left = steps
        self.made = 0

    def has_work(self) -> bool:
        return self.left > 0

    def step(self) -> EngineCoreOutputs:
        self.left -= 1
        self.made += 1
        return EngineCoreOutputs(request_ids=[str(self.made)], new_token_ids=[self.made])

    def add_request(self, request: EngineCoreRequest) -> None:
        raise ExecutorFailed(f"stopped by {request.request_id}")

    def abort_everything(self, reason: str) -> EngineCoreOutputs:
        return EngineCoreOutputs()


def test_a_frontend_that_is_not_reading_stalls_no_step_and_then_gets_every_output_in_order(tmp_path):
    steps = 3000  # more than a socket's default queue of 1,000 messages
    loop = EngineCoreLoop(f"ipc://{tmp_path}/input", f"ipc://{tmp_path}/output")
    core = CountingCore(steps)
    serving = threading.Thread(target=loop.serve, args=(core, EngineReady(1, 1, 0)), daemon=True)
    serving.start()
    context = zmq.Context()
    try:
        deadline = time.monotonic() + 30
        while core.left and time.monotonic() < deadline:  # nothing is connected to read yet
            time.sleep(0.01)
        assert core.left == 0
        output = context.socket(zmq.PULL)
        output.connect(f"ipc://{tmp_path}/output")
        decoder = msgspec.msgpack.Decoder(CoreMessage)
        assert output.poll(10_000)
        assert isinstance(decoder.decode(output.recv()), EngineReady)
        made = [decoder.decode(output.recv()).new_token_ids[0] for _ in range(steps)]
        assert made == list(range(1, steps + 1))
        requests = context.socket(zmq.PUSH)
        requests.connect(f"ipc://{tmp_path}/input")
        requests.send(msgspec.msgpack.encode(EngineCoreRequest("last", [1], SamplingParams(), None, 0.0)))
        assert output.poll(10_000) and isinstance(decoder.decode(output.recv()), EngineCoreOutputs)
        assert output.poll(10_000)
        dead = decoder.decode(output.recv())
        assert isinstance(dead, EngineDead) and "stopped by last" in dead.reason
        serving.join(timeout=10)
        assert not serving.is_alive()
    finally:
        context.destroy(linger=0)
        loop.close()


class StatsOnlyCore(CountingCore):
    """Steps whose outputs hold only the scheduler's stats (their requests' tokens held), the
    last finishing a request."""

    def step(self) -> EngineCoreOutputs:
        self.left -= 1
        finished = [] if self.left else [FinishedRequest("r", "length")]
        return EngineCoreOutputs(finished=finished, stats=SchedulerStats.before_any_step())


def test_steps_with_nothing_but_stats_wake_the_frontend_once_then_the_finish_does(tmp_path):
    loop = EngineCoreLoop(f"ipc://{tmp_path}/input", f"ipc://{tmp_path}/output")
    context = zmq.Context()
    output = context.socket(zmq.PULL)
    output.connect(f"ipc://{tmp_path}/output")
    core = StatsOnlyCore(500)  # far less than the stats interval of work
    serving = threading.Thread(target=loop.serve, args=(core, EngineReady(1, 1, 0)), daemon=True)
    serving.start()
    try:
        decoder = msgspec.msgpack.Decoder(CoreMessage)
        received = []
        while output.poll(2_000):
            received.append(decoder.decode(output.recv()))
        assert core.left == 0
        assert isinstance(received[0], EngineReady)
        assert [(o.stats is not None, [f.request_id for f in o.finished]) for o in received[1:]] == [
            (True, []), (True, ["r"])
        ]
        requests = context.socket(zmq.PUSH)
        requests.connect(f"ipc://{tmp_path}/input")
        requests.send(msgspec.msgpack.encode(EngineCoreRequest("last", [1], SamplingParams(), None, 0.0)))
        serving.join(timeout=10)
        assert not serving.is_alive()
    finally:
        context.destroy(linger=0)
        loop.close()
