"""A real ``strata serve`` on 127.0.0.1, started as a subprocess, for the server tests.

Each test module shares one server (a module-scoped fixture built on ``running_server``);
stopping one checks that its whole process tree and its IPC directory are gone, and kills
whatever is left even when the test failed.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

STARTUP_TIMEOUT_S = 300.0  # the machine may be shared with other heavy jobs
STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


CLI = (sys.executable, "-m", "strata.launch.cli")  # the strata under test, as this interpreter imports it


class ServerProcess:
    """``strata serve`` in a subprocess; its output goes to ``log``. ``cli`` is how to run the
    ``strata`` command (an installed script, say)."""

    def __init__(self, log: Path, *flags: str, cli: tuple[str, ...] = CLI) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [*cli, "serve", "--host", "127.0.0.1", "--port", str(self.port), *flags]
        # A temporary directory of its own, where its IPC directory goes: other jobs on the
        # machine make theirs in /tmp too. Short, since it ends up in socket paths.
        self.tmp = tempfile.mkdtemp(prefix="srv-")
        with open(log, "wb") as output:
            self.process = subprocess.Popen(
                command, stdout=output, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": self.tmp}
            )
        self._tree: dict[int, psutil.Process] = {}

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def wait_until_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            self._remember_tree()
            if self.process.poll() is not None:
                pytest.fail(f"strata serve exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    self._remember_tree()
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        pytest.fail(f"strata serve was not healthy within {STARTUP_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def engine_core_pid(self) -> int:
        children = psutil.Process(self.pid).children()
        [engine_core] = [child for child in children if "strata.runtime.core_process" in " ".join(child.cmdline())]
        return engine_core.pid

    def signal(self, signum: int) -> None:
        self._remember_tree()
        self.process.send_signal(signum)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        """SIGTERM, then check that every process it started and its IPC directory are gone
        (killing leftovers, so that a failing test still cleans up)."""
        if self.process.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.assert_no_leftovers()

    def assert_no_leftovers(self) -> None:
        deadline = time.monotonic() + 15
        alive = list(self._tree.values())
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            time.sleep(0.2)
        for process in alive:
            process.kill()
        leftover_files = [name for name in os.listdir(self.tmp) if name.startswith("strata-")]
        shutil.rmtree(self.tmp, ignore_errors=True)
        assert not alive, f"processes left behind: {[p.pid for p in alive]}"
        assert not leftover_files, f"IPC directories left behind: {leftover_files}"

    def _remember_tree(self) -> None:
        try:
            root = psutil.Process(self.pid)
            for process in [root, *root.children(recursive=True)]:
                self._tree.setdefault(process.pid, process)
        except psutil.NoSuchProcess:
            pass


class BackgroundStream:
    """A greedy streamed completion read on a thread of its own through the official client:
    its tokens and their logprobs as they arrive, its finish reason, or the error that ended it.
    ``started`` is set at its first chunk (or its end)."""

    def __init__(self, client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.error: Exception | None = None
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(client, model, prompt, max_tokens), daemon=True)
        self._thread.start()

    def _read(self, client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> None:
        try:
            stream = client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0, stream=True,
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                for choice in chunk.choices:
                    if choice.logprobs is not None:
                        self.tokens += choice.logprobs.tokens
                        self.token_logprobs += choice.logprobs.token_logprobs
                    self.finish_reason = choice.finish_reason or self.finish_reason
                self.started.set()
        except Exception as error:  # the test asserts on it
            self.error = error
        finally:
            self.started.set()

    def wait(self, timeout: float = 300) -> "BackgroundStream":
        """This stream, once it ended."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"a stream still running after {timeout} s"
        return self


def scrape(url: str) -> dict[str, float]:
    """The server's ``/metrics`` as {sample name{label=value,...}: value}."""
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            labels = ",".join(f"{key}={value}" for key, value in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


@contextmanager
def running_server(log_dir: Path, *flags: str, cli: tuple[str, ...] = CLI) -> Iterator[ServerProcess]:
    """A healthy server with ``flags``, stopped (and checked for leftovers) on exit."""
    server = ServerProcess(log_dir / f"server-{free_port()}.log", *flags, cli=cli)
    try:
        server.wait_until_healthy()
        yield server
    finally:
        server.stop()
