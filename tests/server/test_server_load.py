"""Many concurrent streams through one server: none is lost, each gets every token, and
``/metrics`` counts exactly what was served. Also ``strata bench serve`` against it."""

import asyncio
import json
import subprocess
import sys

import httpx
import pytest
from server_helpers import running_server, scrape

MODEL = "load-model"
NUM_REQUESTS = 256
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(log_dir):
    # Generous worker timeout: other jobs may share this machine's two cores.
    with running_server(log_dir, "--served-model-name", MODEL, "--worker-timeout-s", "300") as server:
        yield server


async def stream_completion(client: httpx.AsyncClient, index: int) -> dict:
    """One streaming completion; what arrived: tokens (via their logprobs), finish reasons,
    the usage chunk, and whether the stream was closed with [DONE]."""
    body = {
        "model": MODEL, "prompt": f"Request {index}: count slowly,", "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "logprobs": 0, "stream": True, "stream_options": {"include_usage": True},
    }
    seen = {"tokens": 0, "finish_reasons": [], "usage": None, "done": False}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                seen["done"] = True
            elif line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                for choice in event["choices"]:
                    seen["tokens"] += len(choice["logprobs"]["tokens"]) if choice["logprobs"] else 0
                    if choice["finish_reason"]:
                        seen["finish_reasons"].append(choice["finish_reason"])
                seen["usage"] = event["usage"] or seen["usage"]
    return seen


async def stream_all(url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=NUM_REQUESTS)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        return await asyncio.gather(*(stream_completion(client, index) for index in range(NUM_REQUESTS)))


def test_256_concurrent_streams_all_finish_with_every_token_and_are_counted(server):
    before = scrape(server.url)
    results = asyncio.run(stream_all(server.url))
    after = scrape(server.url)
    assert len(results) == NUM_REQUESTS
    for seen in results:
        assert seen["done"] and seen["finish_reasons"] == ["length"]
        assert seen["tokens"] == MAX_TOKENS == seen["usage"]["completion_tokens"]
    def grew(name: str) -> float:
        return after[name] - before.get(name, 0)

    assert grew("strata_requests_finished_total{finish_reason=length}") == NUM_REQUESTS
    assert grew("strata_generation_tokens_total") == NUM_REQUESTS * MAX_TOKENS
    assert grew("strata_e2e_request_latency_seconds_count") == NUM_REQUESTS
    assert after["strata_num_requests_running{replica=0}"] == after["strata_num_requests_waiting{replica=0}"] == 0
    assert after["strata_kv_cache_usage_ratio{replica=0}"] == 0


def test_bench_serve_cli_completes_every_request(server):
    command = [
        sys.executable, "-m", "strata.launch.cli", "bench", "serve", "--url", server.url, "--num-prompts", "12",
        "--max-tokens", "4", "--max-concurrency", "4", "--request-rate", "50", "--json",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert (figures["completed"], figures["failed"], figures["output_tokens"]) == (12, 0, 48)
    assert figures["model"] == MODEL
    assert 0 < figures["median_ttft_ms"] <= figures["p99_ttft_ms"] and figures["mean_tpot_ms"] > 0
    assert figures["requests_per_s"] > 0 and figures["output_tokens_per_s"] > 0


def test_bench_serve_structured_compares_with_and_without_a_schema_and_times_the_masks(server):
    command = [
        sys.executable, "-m", "strata.launch.cli", "bench", "serve", "--url", server.url, "--num-prompts", "4",
        "--max-tokens", "6", "--structured", "json-schema", "--json",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    constrained = figures["structured"]
    assert (figures["failed"], constrained["failed"], figures["grammar_mask_steps"]) == (0, 0, 0)
    assert constrained["grammar_mask_steps"] > 0 and constrained["grammar_mask_ms_per_step"] > 0
    assert figures["structured_output_tokens_per_s_ratio"] > 0
