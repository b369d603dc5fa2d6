"""Faults and their clean ends: the API key, clients that leave early, an EngineCore that
dies, and stop signals while starting or serving."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import psutil
import pytest

from server_helpers import ServerProcess, running_server, scrape

MODEL = "faults-model"
API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 5000, "ignore_eos": True}
ABORTED = "strata_requests_finished_total{finish_reason=abort}"


@pytest.fixture(scope="module")
def server(log_dir):
    flags = ("--served-model-name", MODEL, "--api-key", API_KEY, "--enable-debug-endpoints")
    with running_server(log_dir, *flags) as server:
        yield server


def debug_state(server: ServerProcess) -> dict:
    return httpx.get(f"{server.url}/debug/state", timeout=30).json()


def wait_until_idle(server: ServerProcess, timeout: float = 30) -> dict:
    """The EngineCore's state once it holds no request (aborts are asynchronous)."""
    deadline = time.monotonic() + timeout
    while (state := debug_state(server))["num_requests"] and time.monotonic() < deadline:
        time.sleep(0.1)
    return state


def data_events(lines: Iterator[str]) -> Iterator[str]:
    return (line[len("data: "):] for line in lines if line.startswith("data: "))


def test_v1_needs_the_api_key_while_health_and_metrics_stay_open(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{server.url}/v1/completions", json={**LONG, "max_tokens": 1}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_the_openai_client_is_served_with_the_key_and_refused_without(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_leaving_mid_stream_aborts_the_request_and_frees_its_blocks(server):
    aborted_before = scrape(server.url).get(ABORTED, 0)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=300) as client:
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
            events = data_events(response.iter_lines())
            assert json.loads(next(events))["choices"][0]["text"] is not None
            next(events)
            running = debug_state(server)
            assert running["num_requests"] == 1 and running["num_free_blocks"] < running["num_blocks"]
        # Leaving the block closed the connection halfway through the stream.
    state = wait_until_idle(server)
    assert state["num_requests"] == 0
    assert state["num_free_blocks"] == state["num_blocks"] and state["invariants"] == "ok"
    assert scrape(server.url)[ABORTED] == aborted_before + 1


def test_leaving_before_a_whole_response_aborts_the_request_too(server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=LONG, headers=AUTH, timeout=httpx.Timeout(30, read=3))
    state = wait_until_idle(server)
    assert state["num_requests"] == 0 and state["num_free_blocks"] == state["num_blocks"]


def test_a_killed_engine_core_turns_health_and_completions_to_503(log_dir):
    with (
        running_server(log_dir, "--served-model-name", MODEL) as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
            events = data_events(response.iter_lines())
            next(events)
            os.kill(server.engine_core_pid(), signal.SIGKILL)
            rest = list(events)
        # The stream had its headers: the failure comes as an error event, then [DONE].
        assert json.loads(rest[-2])["error"]["code"] == "engine_unavailable" and rest[-1] == "[DONE]"
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
        for stream in (False, True):
            response = client.post("/v1/completions", json={**LONG, "max_tokens": 2, "stream": stream})
            assert response.status_code == 503 and "exited" in response.json()["error"]["message"]


def refuses_connections(server: ServerProcess) -> bool:
    try:
        httpx.get(f"{server.url}/health", timeout=5)
    except httpx.TransportError as error:  # a connection cut by the shutdown is not a refusal
        return isinstance(error, httpx.ConnectError)
    return False


class StreamReader(threading.Thread):
    """Reads one streaming completion in the background: its data events, and how it ended."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.events: list[str] = []
        self.started = threading.Event()
        self.error: Exception | None = None

    def run(self) -> None:
        body = {**LONG, "max_tokens": self.max_tokens, "stream": True, "logprobs": 0}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=300) as response:
                for event in data_events(response.iter_lines()):
                    self.events.append(event)
                    self.started.set()
        except httpx.HTTPError as error:
            self.error = error
        self.started.set()

    @property
    def tokens(self) -> int:
        choices = [choice for event in self.events if event != "[DONE]" for choice in json.loads(event)["choices"]]
        return sum(len(choice["logprobs"]["tokens"]) for choice in choices)


def test_sigterm_stops_accepting_finishes_a_short_stream_cuts_a_long_one_and_exits_0(log_dir):
    shutdown_timeout = 15
    with running_server(log_dir, "--served-model-name", MODEL, "--shutdown-timeout", str(shutdown_timeout)) as server:
        short, long = StreamReader(server.url, max_tokens=4), StreamReader(server.url, max_tokens=5000)
        for reader in (short, long):
            reader.start()
            assert reader.started.wait(120) and reader.events, reader.error
        stopping = time.monotonic()
        server.signal(signal.SIGTERM)
        while not refuses_connections(server) and time.monotonic() - stopping < 10:
            time.sleep(0.1)
        assert refuses_connections(server)
        assert server.wait(timeout=shutdown_timeout + 60) == 0
        assert time.monotonic() - stopping > shutdown_timeout - 1, "the long stream was given its time"
        short.join(10)
        long.join(10)
        assert short.events[-1] == "[DONE]" and short.tokens == 4
        assert long.events[-1] != "[DONE]" and long.tokens < 5000


def test_sigterm_while_the_engine_starts_exits_cleanly(log_dir):
    server = ServerProcess(log_dir / "starting.log", "--served-model-name", MODEL)
    try:
        deadline = time.monotonic() + 120
        while not any("strata.runtime.core_process" in " ".join(p.cmdline()) for p in psutil.Process(server.pid).children()):
            assert time.monotonic() < deadline and server.process.poll() is None, server.log_tail()
            time.sleep(0.2)
        server.signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0, server.log_tail()
    finally:
        server.stop()


# Code run through PyRun_String, as C extensions run Python, stands in for the engine's start:
# the stop signal lands there. A KeyboardInterrupt that passed through such a call made
# CPython kill the server with SIGINT at exit, although ``run`` caught it.
SIGNAL_INSIDE_PYRUN_STRING = """
import ctypes
from strata.launch.server import serve

def start_in_c_code(engine_args):
    run_string = ctypes.pythonapi.PyRun_String
    run_string.restype = ctypes.py_object
    run_string.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.py_object, ctypes.py_object]
    run_string(b"import os, signal, time; os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)", 257, {}, {})

serve.AsyncEngine.start = start_in_c_code
serve.run(serve.ServeOptions(port=0), engine_args=None)
"""


def test_a_stop_signal_landing_in_c_called_python_while_starting_exits_zero():
    finished = subprocess.run([sys.executable, "-c", SIGNAL_INSIDE_PYRUN_STRING], capture_output=True, text=True, timeout=60)
    assert finished.returncode == 0, finished.stderr
    assert "stopped" in finished.stderr
