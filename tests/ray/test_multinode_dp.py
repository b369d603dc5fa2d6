"""Two data-parallel replicas behind ``strata serve``'s cache-aware router, each replica's rank on
a Ray node of its own, every node in a network namespace of its own. ``/metrics`` lists both
replicas before any request; a node killed mid-serving fails only its replica's requests, naming
the replica, as the server's failure (a 503, or its error body in a stream), and the other
replica serves every new request."""

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from strata.launch.bench.netns_cluster import NamespaceCluster

from conftest import rank_workers, wait_until_none_left
from namespace_cluster import joined_cluster, rank_workers_on, save_tiny_model_with_tokenizer
from server.server_helpers import ServerProcess, running_server, scrape

MODEL = "tiny"
MAX_MODEL_LEN = 2048
LONG_TOKENS = 1500  # about 10 s: the node dies, less than 3 s into them, before any ends
# Over one KV block (16 tokens: the server's --block-size) each: the cache-aware router sends a prompt's twin where the
# prompt runs, which it holds (pinned while the first is in flight).
PROMPTS = [
    "Tell me a long story about a lighthouse keeper who finds a message in a bottle one stormy night.",
    "Write a poem about rain falling on the roofs of a quiet town, and the people listening to it.",
    "List every prime number you know, then explain why there are infinitely many of them.",
    "Describe the sea at dawn, at noon and at midnight, as a sailor who has crossed it many times.",
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[NamespaceCluster]:
    """A head without CPUs and two nodes of one CPU each: one replica's rank fits per node."""
    yield from joined_cluster([0, 1, 1])


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny-llama"), MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(cluster: NamespaceCluster, model: str, tmp_path_factory) -> Iterator[ServerProcess]:
    """Two replicas on the cluster behind the cache-aware router (the default), shared by the
    module's tests, in order: the idle replicas first, then the one that loses a replica."""
    with running_server(
        tmp_path_factory.mktemp("server-logs"), "--model", model, "--served-model-name", MODEL, "--dtype", "float32",
        "--executor", "ray", "--ray-address", cluster.address,
        "--data-parallel-size", "2", "--worker-timeout-s", "5", "--block-size", "16",
    ) as server:
        yield server
    wait_until_none_left(rank_workers)


@pytest.fixture(autouse=True)
def no_rank_left_behind() -> None:
    """The shared server's ranks outlive each test: ``server`` checks that none is left once it stopped."""


def request(prompt: str, max_tokens: int, stream: bool = False) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    return {**body, "temperature": 0}


class Completion(threading.Thread):
    """One long completion, read in the background: streamed, its data events as JSON up to
    [DONE]; else its one body. ``status`` is the HTTP status."""

    def __init__(self, url: str, prompt: str, stream: bool = True) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.stream = url, prompt, stream
        self.events: list[dict] = []
        self.status: int | None = None
        self.started = threading.Event()

    def run(self) -> None:
        body = request(self.prompt, LONG_TOKENS, stream=self.stream)
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=300) as response:
            self.status = response.status_code
            if response.status_code != 200 or not self.stream:  # one body: the completion, or why not
                self.events.append(json.loads(response.read()))
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    self.events.append(json.loads(line.removeprefix("data: ")))
                    self.started.set()
        self.started.set()

    @property
    def error(self) -> str | None:
        return self.events[-1]["error"]["message"] if "error" in self.events[-1] else None


def test_each_replica_runs_on_a_node_of_its_own_and_is_in_metrics_before_any_request(cluster, server):
    assert [len(rank_workers_on(cluster, node)) for node in cluster.nodes] == [0, 1, 1]
    samples = scrape(server.url)
    for replica in (0, 1):
        assert samples[f"strata_num_requests_running{{replica={replica}}}"] == 0
        assert samples[f"strata_kv_cache_usage_ratio{{replica={replica}}}"] == 0


def running(server: ServerProcess) -> float:
    samples = scrape(server.url)
    return sum(value for name, value in samples.items() if name.startswith("strata_num_requests_running{"))


def test_a_node_killed_mid_serving_fails_its_replicas_requests_and_the_other_replica_serves_on(cluster, server):
    victim = cluster.nodes[2]
    streams = [Completion(server.url, prompt) for prompt in PROMPTS]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(60) and stream.error is None, stream.error
    twins = [Completion(server.url, prompt, stream=False) for prompt in PROMPTS]  # each on its stream's replica
    for twin in twins:
        twin.start()
    deadline = time.monotonic() + 60
    while running(server) < 2 * len(PROMPTS) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running(server) == 2 * len(PROMPTS)
    cluster.kill_node(victim)
    for completion in streams + twins:
        completion.join(120)

    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "degraded"
    [dead] = [int(replica) for replica, state in health["replicas"].items() if state != "ok"]
    failed = [stream.error for stream in streams if stream.error is not None]
    served = [stream for stream in streams if stream.error is None]
    assert failed and served, "the router sent requests to both replicas"
    for error in failed:
        assert error.startswith(f"data-parallel replica {dead}: worker rank 0 on node {victim.address} died"), error
    for stream, twin in zip(streams, twins):
        if stream.error is None:
            assert stream.events[-1]["choices"][0]["finish_reason"] == "length"
            assert twin.status == 200 and twin.events[-1]["choices"][0]["finish_reason"] == "length"
        else:  # the stream had sent its headers: the error body comes as its last event
            assert {stream.events[-1]["error"]["code"], twin.events[-1]["error"]["code"]} == {"engine_failed"}
            assert twin.status == 503 and twin.error.startswith(f"data-parallel replica {dead}: "), twin.events

    for prompt in PROMPTS:
        response = httpx.post(f"{server.url}/v1/completions", json=request(prompt, 4), timeout=60)
        assert response.status_code == 200, response.text
    samples = scrape(server.url)
    assert f"strata_num_requests_running{{replica={dead}}}" not in samples
    assert f"strata_num_requests_running{{replica={1 - dead}}}" in samples
    assert cluster.pids(victim) == []
