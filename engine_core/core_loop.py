"""The EngineCore's busy loop: requests in, steps, outputs out, over ZeroMQ.

A thread decodes frontend frames into a queue. The loop sends its outputs itself, without
waiting: a frontend that stops reading (its socket's queue full) leaves them queued here, in
order, never stalling the steps. Handing each step's output to a sending thread instead cost a
single stream under ``--executor mp`` 3-6% on a 2-core Xeon-AMX (the thread's wake-up and its
turn at the GIL, every step). With no work, the loop blocks on the input queue instead of
spinning.
"""

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from strata.engine_core.core import EngineCore
from strata.engine_core.ipc import make_socket
from strata.engine_core.protocol import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineReady,
    FrontendMessage,
    UtilityRequest,
    UtilityResponse,
    UtilityResult,
)

logger = logging.getLogger(__name__)

IDLE_WAKE_S = 0.2
# Outputs the frontend has not taken yet are offered again this often while idle; at exit they
# (a last EngineDead) may wait this long for it.
UNSENT_RETRY_S = 0.01
EXIT_SEND_TIMEOUT_S = 5.0
# The longest a frontend goes without the scheduler's stats while the engine steps.
STATS_INTERVAL_S = 1.0


class ExecutorFailed(RuntimeError):
    """A worker died, hung or raised: the engine cannot go on."""


class EngineCoreLoop:
    def __init__(self, input_endpoint: str, output_endpoint: str) -> None:
        self.core: EngineCore | None = None
        self.inputs: queue.Queue = queue.Queue()
        self._unsent: deque[bytes] = deque()  # encoded outputs the output socket has not taken yet
        self._last_output_time = 0.0  # when a step's outputs last went out (time.monotonic())
        self._encoder = msgspec.msgpack.Encoder()
        self.context = zmq.Context()
        # Bound before the loop starts, so the frontend can connect as soon as it hears "ready".
        self._input_socket = make_socket(self.context, zmq.PULL, input_endpoint, bind=True)
        self._output_socket = make_socket(self.context, zmq.PUSH, output_endpoint, bind=True)
        self._stopping = threading.Event()
        self._receiver = threading.Thread(target=self._receive, name="core-input", daemon=True)

    def serve(self, core: EngineCore, ready: EngineReady) -> None:
        """Announce ``ready``, then serve until the process is told to stop or the executor fails."""
        self.core = core
        self._receiver.start()
        self._emit(ready)
        try:
            self._loop()
        except ExecutorFailed as error:
            logger.error("engine stopping: %s", error)
            self._fail_everything(str(error))
        except Exception as error:  # a bug: fail loudly but still answer every request
            logger.exception("engine stopping on an unexpected error")
            self._fail_everything(f"internal engine error: {error!r}")
        finally:
            deadline = time.monotonic() + EXIT_SEND_TIMEOUT_S
            while self._send_unsent() and time.monotonic() < deadline:
                time.sleep(UNSENT_RETRY_S)

    def report_startup_failure(self, reason: str) -> None:
        """Tell the frontend why there will be no ``EngineReady``."""
        self._output_socket.send(msgspec.msgpack.encode(EngineDead(reason)))

    def _loop(self) -> None:
        while True:
            if not self.core.has_work():
                self._wait_for_input()
            while not self.inputs.empty():
                self._handle(self.inputs.get_nowait())
            if self.core.has_work():
                self._emit_step(self.core.step())

    def _wait_for_input(self) -> None:
        """Idle: block instead of spinning, but wake now and then so that a signal handler (run
        only by the main thread between bytecodes) is never starved by a wait in C."""
        while True:
            # What a frontend that was not reading (or not connected yet) has room for now.
            timeout_s = UNSENT_RETRY_S if self._send_unsent() else IDLE_WAKE_S
            try:
                self._handle(self.inputs.get(timeout=timeout_s))
                return
            except queue.Empty:
                continue

    def _handle(self, message: object) -> None:
        if isinstance(message, EngineCoreRequest):
            self.core.add_request(message)
        elif isinstance(message, AbortRequests):
            self.core.abort_requests(message.request_ids)
        elif isinstance(message, UtilityRequest):
            self._emit(self._utility(message))

    def _utility(self, call: UtilityRequest) -> UtilityResponse:
        if call.method == "ping":
            return UtilityResponse(call.call_id, {"ok": True})
        if call.method == "debug_state":
            return UtilityResponse(call.call_id, self._debug_state())
        if call.method == "reset_prefix_cache":
            self.core.reset_prefix_cache()
            return UtilityResponse(call.call_id, {"ok": True})
        return UtilityResponse(call.call_id, error=f"unknown utility method {call.method!r}")

    def _debug_state(self) -> UtilityResult:
        scheduler = self.core.scheduler
        try:
            scheduler.check_invariants()
            invariants = "ok"
        except AssertionError as error:
            invariants = str(error)
        result: UtilityResult = msgspec.structs.asdict(scheduler.stats())
        result.update(
            invariants=invariants,
            num_free_blocks=scheduler.kv.num_free_blocks,
            num_blocks=scheduler.kv.num_blocks,
            num_requests=len(scheduler.requests),
        )
        result.update(self.core.stats())
        return result

    def _fail_everything(self, reason: str) -> None:
        self._emit(self.core.abort_everything(reason))
        self._emit(EngineDead(reason))

    def _receive(self) -> None:
        decoder = msgspec.msgpack.Decoder(FrontendMessage)
        while not self._stopping.is_set():
            # Poll with a timeout, so this thread sees close() and exits before its socket closes.
            if not self._input_socket.poll(IDLE_WAKE_S * 1000):
                continue
            frame = self._input_socket.recv()
            try:
                self.inputs.put(decoder.decode(frame))
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as error:
                logger.warning("dropped a malformed frame on the EngineCore input socket: %s", error)

    def _emit_step(self, outputs: EngineCoreOutputs) -> None:
        """Send a step's outputs; one with nothing but stats (its requests' tokens are held, or
        it ran prefill chunks that sample nothing) only if the frontend has heard nothing for
        ``STATS_INTERVAL_S``: each message wakes the frontend (``engine_core/held_outputs.py``)."""
        now = time.monotonic()
        if outputs.has_results or now - self._last_output_time >= STATS_INTERVAL_S:
            self._last_output_time = now
            self._emit(outputs)

    def _emit(self, message: object) -> None:
        self._unsent.append(self._encoder.encode(message))
        self._send_unsent()

    def _send_unsent(self) -> bool:
        """Hand the queued outputs to the socket in order, as far as it takes them without
        waiting; returns whether some are left."""
        while self._unsent:
            try:
                self._output_socket.send(self._unsent[0], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            self._unsent.popleft()
        return False

    def close(self) -> None:
        self._stopping.set()
        if self._receiver.is_alive():
            self._receiver.join(timeout=2 * IDLE_WAKE_S)
        self._input_socket.close(linger=0)
        self._output_socket.close(linger=500)  # let a last EngineDead reach the frontend
        self.context.term()

