"""``strata serve``: the engine behind the OpenAI-compatible HTTP server until SIGINT/SIGTERM.

uvicorn runs in this process, on the asyncio loop that also runs the ``AsyncEngine``; the
EngineCore and its workers run in their own processes.
"""

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType

import uvicorn

from strata.launch.async_engine import AsyncEngine
from strata.runtime.engine_args import EngineArgs
from strata.launch.server.app import AppOptions, build_app

logger = logging.getLogger(__name__)

UNWIND_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ServeOptions:
    """Where to listen and how long a stop may take; ``app`` is what the application needs."""

    host: str = "127.0.0.1"
    port: int = 8000
    shutdown_timeout_s: float = 30.0  # how long in-flight requests may run on after a stop signal
    app: AppOptions = field(default_factory=AppOptions)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")


def run(options: ServeOptions, engine_args: EngineArgs) -> None:
    """Serve until SIGINT or SIGTERM, then stop gracefully: stop accepting connections, let
    in-flight requests finish for up to ``shutdown_timeout_s`` (then abort them), and stop the
    EngineCore and its workers. A second signal skips the wait."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # While the engine starts, a stop signal unwinds through every clean-up as an exception.
    # uvicorn handles both signals while it serves.
    _handle_stop_signals(_stop_starting)
    try:
        asyncio.run(_serve(options, engine_args))
    except StopWhileStarting:
        pass
    logger.info("stopped")


async def _serve(options: ServeOptions, engine_args: EngineArgs) -> None:
    engine = await AsyncEngine.start(engine_args)
    try:
        config = uvicorn.Config(
            build_app(engine, options.app),
            host=options.host,
            port=options.port,
            timeout_graceful_shutdown=options.shutdown_timeout_s,
            lifespan="off",
        )
        server = uvicorn.Server(config)
        # uvicorn re-raises the signal it caught once it has stopped, to the handler it found;
        # by then the server is down and the clean-up below is all that is left: ignore it.
        _handle_stop_signals(signal.SIG_IGN)
        await server.serve()
        # Requests cut short by the shutdown timeout are cancelled but not yet unwound: let
        # them close their streams (aborting their requests) while the engine still listens.
        if server.server_state.tasks:
            await asyncio.wait(list(server.server_state.tasks), timeout=UNWIND_TIMEOUT_S)
    finally:
        engine.shutdown()


def _handle_stop_signals(handler: Callable[[int, FrameType | None], None] | signal.Handlers) -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)


class StopWhileStarting(SystemExit):
    """A stop signal arrived while the engine was starting. Not KeyboardInterrupt: once one has
    passed through a C extension's ``PyRun_String`` call (where a signal may land), CPython
    kills itself with SIGINT at exit even though it was caught, and the server exits -2.
    asyncio lets SystemExit through as it does KeyboardInterrupt."""


def _stop_starting(signum: int, frame: FrameType | None) -> None:
    # The clean-up this starts stops the EngineCore and its workers: a second signal must not
    # cut it short (every wait in it is bounded).
    _handle_stop_signals(signal.SIG_IGN)
    raise StopWhileStarting(0)
