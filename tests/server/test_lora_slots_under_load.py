"""More LoRA adapters than slots on ``strata serve`` under concurrent streams: requests whose
adapter finds no slot wait (none fails), adapters swap in as slots free, greedy outputs are
those of the same requests run one at a time, and ``/metrics`` shows the requests running and
waiting by adapter. One server with one slot and three adapters."""

import openai
import pytest

from server_helpers import BackgroundStream, running_server, scrape

BASE = "tiny-base"
ADAPTERS = {"x": "sql", "y": "chat", "z": "poem"}  # served name -> directory
PROMPT = "the sea is blue"


@pytest.fixture(scope="module")
def server(log_dir, lora_models):
    modules = [f"{name}={lora_models.root / directory}" for name, directory in ADAPTERS.items()]
    flags = (
        "--model", str(lora_models.root / "base"), "--served-model-name", BASE, "--dtype", "float32",
        "--max-loras", "1", "--max-lora-rank", "8", "--lora-modules", *modules,
    )
    with running_server(log_dir, *flags) as server:
        yield server


def test_more_adapters_than_slots_under_concurrent_streams_match_one_at_a_time(client: openai.OpenAI):
    requests = [(model, f"{PROMPT} {index}") for model in (BASE, *ADAPTERS) for index in range(2)]
    alone = [BackgroundStream(client, model, prompt, 12).wait() for model, prompt in requests]
    together = [BackgroundStream(client, model, prompt, 12) for model, prompt in requests]
    for (model, _), single, concurrent in zip(requests, alone, together):
        concurrent.wait()
        assert single.error is None and concurrent.error is None, (model, concurrent.error)
        assert concurrent.finish_reason == "length" and len(concurrent.tokens) == 12, model
        assert concurrent.tokens == single.tokens, model
        assert concurrent.token_logprobs == pytest.approx(single.token_logprobs, abs=1e-3), model


def test_metrics_count_requests_running_and_waiting_by_adapter(server, client: openai.OpenAI):
    running = [BackgroundStream(client, "x", f"{PROMPT} {index}", 240) for index in range(2)]
    for stream in running:
        assert stream.started.wait(300)
    waiting = BackgroundStream(client, "y", PROMPT, 4)  # no slot until x's requests finish
    seen = {}
    while not all(stream.finish_reason for stream in running):
        seen = scrape(server.url)
        if seen.get("strata_lora_requests_waiting{lora_name=y,replica=0}"):
            break
    assert seen["strata_lora_requests_running{lora_name=x,replica=0}"] == 2
    assert seen["strata_lora_requests_waiting{lora_name=y,replica=0}"] == 1
    info = "strata_lora_requests_info{max_lora=1,replica=0,running_lora_adapters=x,waiting_lora_adapters=y}"
    assert seen[info] == 1
    for stream in [*running, waiting]:
        assert stream.wait().error is None and stream.finish_reason == "length"
    idle = scrape(server.url)
    assert not any(name.startswith(("strata_lora_requests_running", "strata_lora_requests_waiting")) for name in idle)
    assert idle["strata_lora_requests_info{max_lora=1,replica=0,running_lora_adapters=,waiting_lora_adapters=}"] == 1
