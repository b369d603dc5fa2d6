"""A server that a benchmark starts as a child process: on a free loopback port, in a session of
its own, waited for until it is healthy, and stopped together with every process it started."""

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import httpx

STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def strata_serve_command(port: int, flags: Sequence[str]) -> list[str]:
    """``strata serve FLAGS`` on ``port`` of the loopback address, run by this interpreter."""
    return [sys.executable, "-m", "strata.launch.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]


class ServerProcess:
    """``command``, a server listening on ``port`` of 127.0.0.1, started now; its output is
    appended to ``log``, or dropped without one. Used as a context manager, it is stopped on exit.

    ``started`` is the ``time.perf_counter()`` of the launch, for start-up timings."""

    def __init__(self, command: list[str], port: int, log: Path | None = None, env: dict[str, str] | None = None) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        output = log.open("ab") if log is not None else subprocess.DEVNULL
        self.started = time.perf_counter()
        # A session of its own: the server's workers can be killed as one group, whatever happens to it.
        self.process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        if log is not None:
            output.close()  # the child holds its own copy

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.stop()

    def check_running(self) -> None:
        """Raise if the server has exited."""
        if self.process.poll() is not None:
            raise RuntimeError(f"the server exited with status {self.process.returncode}{self._see_log()}")

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Return once ``GET /health`` answers 200; raise if the server exits first or ``timeout_s``
        after its launch."""
        deadline = self.started + timeout_s
        while time.perf_counter() < deadline:
            self.check_running()
            try:
                if httpx.get(f"{self.url}/health", timeout=5, trust_env=False).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not healthy within {timeout_s:.0f} s{self._see_log()}")

    def stop(self) -> None:
        """SIGTERM, on which the server stops its own processes; then SIGKILL for whatever of its
        session is left, the server too if it has not exited within ``STOP_TIMEOUT_S``."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:  # nothing left
            pass
        self.process.wait()

    def _see_log(self) -> str:
        return f"; see {self.log}" if self.log is not None else ""
