"""Frontend side of the EngineCore process: start it, talk to it over ZeroMQ, notice its death.

``SyncCoreClient`` serves ``LLM``; ``AsyncCoreClient`` serves the HTTP server and
``AsyncEngine``. Both send ``EngineCoreRequest``/``AbortRequests``/``UtilityRequest`` frames and
receive ``EngineCoreOutputs``; both raise ``EngineDeadError`` once the EngineCore is gone.
"""

import asyncio
import contextlib
import itertools
import logging
import subprocess
import sys
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from strata.engine_core.ipc import IpcDir, make_socket
from strata.engine_core.protocol import (
    AbortRequests,
    CoreMessage,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineReady,
    UtilityRequest,
    UtilityResponse,
    UtilityResult,
)
from strata.runtime.engine_args import ResolvedConfig
from strata.runtime.core_process import INPUT_ENDPOINT, OUTPUT_ENDPOINT, EngineProcessConfig
from strata.runtime.kv_event_endpoints import connectable, replica_event_endpoints

logger = logging.getLogger(__name__)

POLL_MS = 100
STARTUP_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 10.0


class EngineDeadError(RuntimeError):
    """The EngineCore process is gone; the message says why."""


class EngineCoreProcess:
    """The child process running the EngineCore, and its private IPC directory. ``replica``
    numbers it among data-parallel replicas; ``private_events`` makes it publish KV events
    on private IPC endpoints when the user named none (for the router)."""

    def __init__(self, config: ResolvedConfig, replica: int = 0, private_events: bool = False) -> None:
        self.ipc = IpcDir()
        # Until it returns, any exception (a stop signal's too) takes back what it made so far.
        with contextlib.ExitStack() as undo:
            undo.callback(self.ipc.cleanup)
            self.input_endpoint = self.ipc.endpoint(INPUT_ENDPOINT)
            self.output_endpoint = self.ipc.endpoint(OUTPUT_ENDPOINT)
            event_endpoints = replica_event_endpoints(
                config.kv_events_endpoint, config.kv_events_replay_endpoint, replica, self.ipc, private_events
            )
            # Where a subscriber on this machine connects: (publish, replay), or None.
            self.kv_events_endpoints = None if event_endpoints is None else tuple(map(connectable, event_endpoints))
            process_config = EngineProcessConfig(
                config.scheduler, config.worker, config.executor, self.ipc.path, config.worker_timeout_s, config.ray,
                config.kv_offload_policy, event_endpoints,
            )
            self.process = subprocess.Popen([sys.executable, "-m", "strata.runtime.core_process"], stdin=subprocess.PIPE)
            undo.callback(self._kill)
            assert self.process.stdin is not None
            self.process.stdin.write(msgspec.msgpack.encode(process_config))
            self.process.stdin.close()
            undo.pop_all()

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_reason(self) -> str | None:
        """None while the process runs; otherwise how it ended."""
        code = self.process.poll()
        return None if code is None else f"the EngineCore process exited (code {code})"

    def shutdown(self) -> None:
        """SIGTERM (it stops its workers), then SIGKILL if it takes too long."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._kill()
        self.ipc.cleanup()

    def _kill(self) -> None:
        self.process.kill()
        self.process.wait()


def _connect(context: zmq.Context, process: EngineCoreProcess) -> tuple[zmq.Socket, zmq.Socket]:
    """A client's sockets: pushing to the EngineCore's input, pulling from its output."""
    return (
        make_socket(context, zmq.PUSH, process.input_endpoint, bind=False),
        make_socket(context, zmq.PULL, process.output_endpoint, bind=False),
    )


class _Connection:
    """Encoding, decoding and the handshake common to both clients."""

    def __init__(self, process: EngineCoreProcess) -> None:
        self.process = process
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(CoreMessage)
        self.dead_reason: str | None = None
        self.num_blocks = 0
        self.vocab_size = 0
        self._call_ids = itertools.count()

    def on_ready(self, message: CoreMessage) -> None:
        if not isinstance(message, EngineReady):
            raise EngineDeadError(f"expected the EngineCore's ready message, got {type(message).__name__}")
        self.num_blocks, self.vocab_size = message.num_blocks, message.vocab_size

    def decode(self, frame: bytes) -> CoreMessage:
        """A frame from the EngineCore; its ``EngineDead`` raises ``EngineDeadError``."""
        message = self.decoder.decode(frame)
        if isinstance(message, EngineDead):
            self.dead_reason = message.reason
            raise EngineDeadError(message.reason)
        return message

    def check_alive(self) -> None:
        reason = self.dead_reason or self.process.exit_reason()
        if reason is not None:
            self.dead_reason = reason
            raise EngineDeadError(reason)

    def utility(self, method: str) -> tuple[int, bytes]:
        call_id = next(self._call_ids)
        return call_id, self.encoder.encode(UtilityRequest(call_id, method))


class SyncCoreClient:
    """The blocking client. ``wait_ready=False`` returns once the process is started; call
    ``wait_ready`` before anything else (several replicas then start side by side)."""

    def __init__(
        self, config: ResolvedConfig, replica: int = 0, private_events: bool = False, wait_ready: bool = True
    ) -> None:
        self.context = zmq.Context()
        self.process = EngineCoreProcess(config, replica, private_events)
        self._conn = _Connection(self.process)
        try:
            self._input, self._output = _connect(self.context, self.process)
        except BaseException:  # a stop signal too: the process must not outlive this
            self.shutdown()
            raise
        self._replies: dict[int, UtilityResponse] = {}
        if wait_ready:
            self.wait_ready()

    def wait_ready(self) -> None:
        try:
            self._conn.on_ready(self._receive(timeout_s=STARTUP_TIMEOUT_S))
        except BaseException:
            self.shutdown()
            raise

    @property
    def num_blocks(self) -> int:
        return self._conn.num_blocks

    @property
    def output_socket(self) -> zmq.Socket:
        return self._output

    def check_alive(self) -> None:
        """Raise EngineDeadError if the EngineCore is gone."""
        self._conn.check_alive()

    def next_output(self, timeout_s: float) -> EngineCoreOutputs | None:
        """The next step's outputs if one arrives within ``timeout_s``, else None."""
        try:
            message = self._receive(timeout_s)
        except TimeoutError:
            return None
        if isinstance(message, UtilityResponse):
            self._replies[message.call_id] = message
            return None
        return message if isinstance(message, EngineCoreOutputs) else None

    def add_request(self, request: EngineCoreRequest) -> None:
        self._conn.check_alive()
        self._input.send(self._conn.encoder.encode(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._input.send(self._conn.encoder.encode(AbortRequests(request_ids)))

    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs; EngineDeadError once the engine is gone."""
        while True:
            message = self._receive()
            if isinstance(message, EngineCoreOutputs):
                return message
            if isinstance(message, UtilityResponse):
                self._replies[message.call_id] = message

    def reset_prefix_cache(self) -> None:
        self.call_utility("reset_prefix_cache")

    def call_utility(self, method: str, timeout_s: float = 30.0) -> UtilityResult:
        call_id, frame = self._conn.utility(method)
        self._input.send(frame)
        deadline = time.monotonic() + timeout_s
        while call_id not in self._replies:
            message = self._receive(timeout_s=max(0.0, deadline - time.monotonic()))
            if isinstance(message, UtilityResponse):
                self._replies[message.call_id] = message
        reply = self._replies.pop(call_id)
        if reply.error:
            raise RuntimeError(reply.error)
        return reply.result or {}

    def _receive(self, timeout_s: float | None = None) -> CoreMessage:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._conn.check_alive()
            wait_ms = POLL_MS if deadline is None else min(POLL_MS, max(0, int((deadline - time.monotonic()) * 1000)))
            if self._output.poll(wait_ms):
                return self._conn.decode(self._output.recv())
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no answer from the EngineCore within {timeout_s:.0f} s")

    def shutdown(self) -> None:
        self.process.shutdown()
        self.context.destroy(linger=0)


class AsyncCoreClient:
    """The asyncio client. ``start`` waits for the engine; outputs are handed to ``on_output``
    from a background task; ``on_dead`` is called once if the engine dies."""

    def __init__(self, config: ResolvedConfig, replica: int = 0, private_events: bool = False) -> None:
        self._reader: asyncio.Task | None = None
        self.context = zmq.asyncio.Context()
        self.process = EngineCoreProcess(config, replica, private_events)
        self._conn = _Connection(self.process)
        try:
            self._input, self._output = _connect(self.context, self.process)
        except BaseException:  # a stop signal too: the process must not outlive this
            self.shutdown()
            raise
        self._replies: dict[int, asyncio.Future] = {}

    @property
    def num_blocks(self) -> int:
        return self._conn.num_blocks

    @property
    def dead_reason(self) -> str | None:
        return self._conn.dead_reason or self.process.exit_reason()

    async def start(
        self, on_output: Callable[[EngineCoreOutputs], None], on_dead: Callable[[str], None]
    ) -> None:
        try:
            self._conn.on_ready(await self._receive(timeout_s=STARTUP_TIMEOUT_S))
        except BaseException:
            self.shutdown()
            raise
        self._reader = asyncio.create_task(self._read(on_output, on_dead))

    async def add_request(self, request: EngineCoreRequest) -> None:
        self._conn.check_alive()
        await self._input.send(self._conn.encoder.encode(request))

    async def abort_requests(self, request_ids: list[str]) -> None:
        if self._conn.dead_reason is None:
            await self._input.send(self._conn.encoder.encode(AbortRequests(request_ids)))

    async def call_utility(self, method: str, timeout_s: float = 30.0) -> UtilityResult:
        call_id, frame = self._conn.utility(method)
        future = asyncio.get_running_loop().create_future()
        self._replies[call_id] = future
        await self._input.send(frame)
        reply: UtilityResponse = await asyncio.wait_for(future, timeout_s)
        if reply.error:
            raise RuntimeError(reply.error)
        return reply.result or {}

    async def _read(self, on_output: Callable[[EngineCoreOutputs], None], on_dead: Callable[[str], None]) -> None:
        try:
            while True:
                message = await self._receive()
                if isinstance(message, EngineCoreOutputs):
                    on_output(message)
                elif isinstance(message, UtilityResponse) and message.call_id in self._replies:
                    self._replies.pop(message.call_id).set_result(message)
        except EngineDeadError as error:
            for future in self._replies.values():
                future.set_exception(EngineDeadError(str(error)))
            self._replies.clear()
            on_dead(str(error))

    async def _receive(self, timeout_s: float | None = None) -> CoreMessage:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._conn.check_alive()
            if await self._output.poll(POLL_MS):
                return self._conn.decode(await self._output.recv())
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no answer from the EngineCore within {timeout_s:.0f} s")

    def shutdown(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.process.shutdown()
        self.context.destroy(linger=0)
