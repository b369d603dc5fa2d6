"""``strata bench soak``: run ``strata serve`` under mixed traffic for a while, then check that
nothing leaked.

The server runs with the CPU offload tier and the debug endpoint on. ``concurrency`` clients
send, until the time is up, a seeded mix of: streamed completions (n of 1 to 3), whole chat
completions, streams the client leaves after a few events (an abort), whole requests the client
gives up on while waiting (a disconnect), and bad requests (which must get a 400); prompts are
short or long, some sharing a long prefix. Afterwards the engine must be idle with every KV
block free and its invariants intact, and the resident memory of every process of the server
must have grown less than ``max_rss_growth`` between the end of the first fifth of the run and
the end of the traffic. The result is one JSON object; ``passed`` says whether all checks held.
"""

import asyncio
import json
import random
import signal
import sys
import time
from contextlib import aclosing
from dataclasses import asdict, dataclass, field

import httpx
import psutil

from strata.launch.bench.serve import _WORDS, stream_events
from strata.launch.bench.server_process import ServerProcess, free_port, strata_serve_command

KINDS = ("stream", "chat", "abort", "disconnect", "bad")
DEFAULT_OFFLOAD_BYTES = 256 << 20
DRAIN_TIMEOUT_S = 120.0
RSS_SAMPLE_S = 2.0
BAD_BODIES = (
    {"prompt": "Hello", "top_p": 5},
    {"prompt": ""},
    {"prompt": "Hello", "max_tokens": "5"},
    {"prompt": "Hello", "prompt_logprobs": 1, "stream": True},  # prompt logprobs are not streamed
    {"prompt": "Hello", "cache_salt": ""},
)


@dataclass(frozen=True)
class Soak:
    """How long and how hard. ``serve_flags`` go to ``strata serve`` (model, executor, ...);
    the offload tier is turned on unless they size it."""

    duration_s: float = 1800.0
    concurrency: int = 16
    seed: int = 0
    max_rss_growth: float = 0.05
    long_prompt_words: int = 600
    serve_flags: tuple[str, ...] = ()


@dataclass
class _Tally:
    sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    unexpected: list[str] = field(default_factory=list)
    output_tokens: int = 0


def run(soak: Soak) -> dict:
    port = free_port()
    flags = ["--enable-debug-endpoints", "--served-model-name", "soak", *soak.serve_flags]
    if "--kv-offload-cpu-bytes" not in flags:
        flags += ["--kv-offload-cpu-bytes", str(DEFAULT_OFFLOAD_BYTES)]
    # SIGTERM (a CI timeout) unwinds through the with that stops the server, as Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    with ServerProcess(strata_serve_command(port, flags), port) as server:
        server.wait_healthy()
        _log(f"server healthy; traffic for {soak.duration_s:.0f} s")
        return asyncio.run(_soak(soak, server.url, psutil.Process(server.process.pid)))


async def _soak(soak: Soak, url: str, server: psutil.Process) -> dict:
    rng = random.Random(soak.seed)
    tally = _Tally()
    samples: list[tuple[float, dict[str, int]]] = []
    started = time.monotonic()
    deadline = started + soak.duration_s
    prefix = " ".join(rng.choice(_WORDS) for _ in range(soak.long_prompt_words // 2))
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as client:
        sampler = asyncio.create_task(_sample_rss(server, started, samples))
        seeds = [rng.getrandbits(32) for _ in range(soak.concurrency)]
        await asyncio.gather(*(_client(client, random.Random(s), soak, prefix, deadline, tally) for s in seeds))
        samples.append((time.monotonic() - started, _rss_by_process(server)))
        sampler.cancel()
        _log(f"traffic done: {tally.sent}; draining")
        state = await _drain(client)
    growth = _rss_growth(samples, soak.duration_s / 5)
    failures = list(tally.unexpected[:10])
    if state.get("num_requests") != 0 or state.get("num_free_blocks") != state.get("num_blocks"):
        failures.append(f"engine not idle after the run: {state}")
    if state.get("invariants") != "ok":
        failures.append(f"invariants: {state.get('invariants')}")
    failures += [f"{name}: RSS grew {value:.1%}" for name, value in growth.items() if value >= soak.max_rss_growth]
    return {
        "soak": asdict(soak),
        "elapsed_s": round(time.monotonic() - started, 1),
        "requests_sent": tally.sent,
        "output_tokens": tally.output_tokens,
        "unexpected_outcomes": len(tally.unexpected),
        "final_state": {key: state.get(key) for key in ("num_requests", "num_free_blocks", "num_blocks", "invariants",
                                                         "num_preemptions", "prefix_cache_hits", "offload_hit_tokens")},
        "rss_mb_after_first_fifth": {k: round(v / 2**20, 1) for k, v in _rss_at(samples, soak.duration_s / 5).items()},
        "rss_mb_at_end": {k: round(v / 2**20, 1) for k, v in samples[-1][1].items()},
        "rss_growth": {name: round(value, 4) for name, value in growth.items()},
        "failures": failures,
        "passed": not failures,
    }


async def _client(client: httpx.AsyncClient, rng: random.Random, soak: Soak, prefix: str, deadline: float, tally: _Tally):
    while time.monotonic() < deadline:
        kind = rng.choices(KINDS, weights=(4, 2, 2, 1, 1))[0]
        tally.sent[kind] += 1
        prompt = _prompt(rng, soak.long_prompt_words, prefix)
        try:
            await _send(client, rng, kind, prompt, tally)
        except (httpx.HTTPError, ValueError) as error:
            tally.unexpected.append(f"{kind}: {type(error).__name__}: {error}")


async def _send(client: httpx.AsyncClient, rng: random.Random, kind: str, prompt: str, tally: _Tally) -> None:
    max_tokens = rng.randint(4, 48)
    if kind == "bad":
        response = await client.post("/v1/completions", json={"model": "soak", **rng.choice(BAD_BODIES)})
        if response.status_code != 400:
            tally.unexpected.append(f"bad request answered {response.status_code}")
        return
    if kind == "chat":
        body = {"model": "soak", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "n": rng.randint(1, 2), "temperature": rng.choice([0, 0.8])}
        response = await client.post("/v1/chat/completions", json=body)
        _expect_ok(response, kind, tally)
        if response.status_code == 200:
            tally.output_tokens += response.json()["usage"]["completion_tokens"]
        return
    body = {"model": "soak", "prompt": prompt, "max_tokens": max_tokens, "n": rng.randint(1, 3), "ignore_eos": True}
    if kind == "disconnect":
        try:  # the client gives up while the server is still working on it
            await client.post("/v1/completions", json={**body, "max_tokens": 48}, timeout=rng.uniform(0.05, 0.5))
        except httpx.TimeoutException:
            pass
        return
    leave_after = rng.randint(1, 3) if kind == "abort" else None
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            _expect_ok(response, kind, tally)
            return
        events = 0
        async with aclosing(stream_events(response)) as stream:
            async for event in stream:
                if "error" in event:
                    tally.unexpected.append(f"{kind}: error event {event['error']}")
                events += 1
                if leave_after is not None and events >= leave_after:
                    return  # leaving the block closes the connection: the server aborts the request
        tally.output_tokens += events


def _expect_ok(response: httpx.Response, kind: str, tally: _Tally) -> None:
    if response.status_code != 200:
        tally.unexpected.append(f"{kind}: HTTP {response.status_code}")


def _prompt(rng: random.Random, long_words: int, prefix: str) -> str:
    shape = rng.choice(("short", "long", "shared-prefix"))
    if shape == "short":
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 30)))
    if shape == "long":
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(long_words // 2, long_words)))
    return prefix + " " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, long_words // 4)))


async def _drain(client: httpx.AsyncClient) -> dict:
    """The engine's state once it holds no request and every block is free (or the timeout)."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        state = (await client.get("/debug/state")).json()
        idle = state["num_requests"] == 0 and state["num_free_blocks"] == state["num_blocks"]
        if idle or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.5)


async def _sample_rss(server: psutil.Process, started: float, samples: list) -> None:
    while True:
        samples.append((time.monotonic() - started, _rss_by_process(server)))
        await asyncio.sleep(RSS_SAMPLE_S)


def _rss_by_process(server: psutil.Process) -> dict[str, int]:
    """Resident bytes of the server and each process under it, named by role."""
    rss = {"server": server.memory_info().rss}
    workers = 0
    for child in server.children(recursive=True):
        try:
            command = " ".join(child.cmdline())
            if "core_process" in command:
                name = "engine-core"
            elif "worker_process" in command:
                name, workers = f"worker-{workers}", workers + 1
            else:
                continue
            rss[name] = child.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return rss


def _rss_at(samples: list[tuple[float, dict[str, int]]], at_s: float) -> dict[str, int]:
    return min(samples, key=lambda sample: abs(sample[0] - at_s))[1]


def _rss_growth(samples: list[tuple[float, dict[str, int]]], after_s: float) -> dict[str, float]:
    """Growth of each process's RSS from the end of the warm-up to the end of the traffic."""
    baseline, end = _rss_at(samples, after_s), samples[-1][1]
    return {name: end[name] / baseline[name] - 1 for name in baseline if name in end}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _log(message: str) -> None:
    print(f"soak: {message}", file=sys.stderr, flush=True)


def format_result(result: dict) -> str:
    return json.dumps(result, indent=2)
