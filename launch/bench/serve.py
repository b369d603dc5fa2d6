"""``strata bench serve``: load a running server with streaming completions and time it.

Like ``vllm bench serve``: seeded synthetic prompts go out as streaming ``/v1/completions``
requests (greedy, EOS ignored, so each yields exactly ``max_tokens`` tokens), all at once or
at a Poisson request rate, with an optional cap on requests in flight. Reported: throughput
and the time to first token (TTFT), per output token after the first (TPOT) and end to end,
and from the server's ``/metrics`` the prompt tokens it prefilled and its prefix-cache hit
rate over the run. ``workload="multi-tenant"``: ``tenants`` long system prompts, each
opening the prompts of many short conversations, which arrive interleaved (each request's
tenant drawn at random, seeded): the load a cache-aware router is for. ``structured=
"json-schema"``: the load runs twice on the same server, without and then with a JSON schema
on every request (``guided_json``), each after one warm-up request of its kind (the first
constrained request builds the grammar engine's tokenizer) and under its own ``cache_salt``
(so the second run finds none of the first's prompts cached); the result adds their output
tokens/s ratio and the EngineCore's grammar-mask time per constrained step (from ``/metrics``).
Only loopback URLs are accepted: a load generator must not hit another machine by mistake.
"""

import asyncio
import ipaddress
import json
import math
import random
import re
import time
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

_WORDS = (
    "the quick brown fox jumps over a lazy dog while seven curious engineers measure latency of "
    "streaming tokens across busy servers under heavy load and quiet nights with coffee rain music "
    "river mountain garden library window paper orbit signal memory cache block batch queue"
).split()
PROMPT_WORDS = (24, 40)  # words per prompt, uniformly drawn
WORKLOADS = ("random", "multi-tenant")
STRUCTURED = ("json-schema",)
# Records with free-text fields in an open-ended array: a small model keeps writing records
# rather than closing the object, so constrained requests run about as long as the others.
RECORDS_SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["id", "name", "tags"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["records"],
    "additionalProperties": False,
}
REQUEST_TIMEOUT_S = 600.0  # a request that takes longer counts as failed
_MAX_REPORTED_ERRORS = 5


@dataclass(frozen=True)
class Load:
    """What to send. ``request_rate=inf`` sends every request at once; ``max_concurrency=None``
    puts no cap on requests in flight."""

    url: str = "http://127.0.0.1:8000"
    num_prompts: int = 64
    request_rate: float = math.inf
    max_concurrency: int | None = None
    max_tokens: int = 64
    seed: int = 0
    workload: str = "random"
    tenants: int = 8
    system_prompt_words: int = 400
    structured: str | None = None

    def __post_init__(self) -> None:
        _check_loopback(self.url)
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        if self.tenants < 1 or self.system_prompt_words < 1:
            raise ValueError(f"tenants and system_prompt_words must be >= 1, got {self.tenants}, {self.system_prompt_words}")
        if self.structured is not None and self.structured not in STRUCTURED:
            raise ValueError(f"structured must be one of {', '.join(STRUCTURED)}, got {self.structured!r}")


@dataclass
class _Sample:
    """One request's outcome; times in seconds from when it was sent."""

    error: str | None = None
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0


def make_prompts(num_prompts: int, seed: int) -> list[str]:
    """``num_prompts`` strings of random words from a fixed list; the same for the same seed."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(_WORDS, k=rng.randint(*PROMPT_WORDS))) for _ in range(num_prompts)]


def make_multi_tenant_prompts(num_prompts: int, tenants: int, system_prompt_words: int, seed: int) -> list[str]:
    """Each prompt: a random tenant's system prompt, then a short conversation of its own."""
    rng = random.Random(seed)
    systems = [
        f"You are assistant number {tenant}. " + " ".join(rng.choices(_WORDS, k=system_prompt_words))
        for tenant in range(tenants)
    ]
    return [f"{rng.choice(systems)}\nUser: {question}" for question in make_prompts(num_prompts, seed + 1)]


def _prompts(load: Load) -> list[str]:
    if load.workload == "multi-tenant":
        return make_multi_tenant_prompts(load.num_prompts, load.tenants, load.system_prompt_words, load.seed)
    return make_prompts(load.num_prompts, load.seed)


def run(load: Load) -> dict:
    """Send the load and return the figures (see ``format_result``); with ``structured``, the
    unconstrained run's figures with the constrained run's under ``"structured"``."""
    if load.structured is None:
        return asyncio.run(_run(load))
    plain = asyncio.run(_run(load, {"cache_salt": "bench-unconstrained"}, warm_up=True))
    constrained = asyncio.run(
        _run(load, {"cache_salt": "bench-structured", "guided_json": RECORDS_SCHEMA}, warm_up=True)
    )
    plain["structured"] = constrained
    plain["structured_output_tokens_per_s_ratio"] = constrained["output_tokens_per_s"] / plain["output_tokens_per_s"]
    return plain


async def _run(load: Load, extra: dict | None = None, warm_up: bool = False) -> dict:
    """One run of the load; ``extra``: request fields added to every request."""
    in_flight = load.max_concurrency or load.num_prompts
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    arrivals = random.Random(load.seed)
    async with httpx.AsyncClient(
        base_url=load.url, limits=limits, timeout=REQUEST_TIMEOUT_S, trust_env=False
    ) as client:
        model = await _model_name(client)
        if warm_up:
            warm_up_extra = {**(extra or {}), "cache_salt": "warm-up"}
            sample = await _request(client, asyncio.Semaphore(1), model, "warm up", 1, warm_up_extra)
            if sample.error is not None:
                raise RuntimeError(f"the warm-up request failed: {sample.error}")
        before = await _cache_counters(client)
        gate = asyncio.Semaphore(in_flight)
        started = time.perf_counter()
        tasks = []
        for prompt in _prompts(load):
            tasks.append(asyncio.create_task(_request(client, gate, model, prompt, load.max_tokens, extra)))
            if math.isfinite(load.request_rate):
                await asyncio.sleep(arrivals.expovariate(load.request_rate))
        samples = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
        after = await _cache_counters(client)
    result = _summarize(load, model, samples, elapsed)
    grown = {name: after[name] - before.get(name, 0.0) for name in after}
    result["prefill_tokens"] = int(grown.get("strata_prompt_tokens_computed_total", 0))
    queries = grown.get("strata_prefix_cache_queries_total", 0.0)
    result["prefix_hit_rate"] = grown.get("strata_prefix_cache_hits_total", 0.0) / queries if queries else None
    mask_steps = grown.get("strata_grammar_mask_steps_total", 0.0)
    result["grammar_mask_steps"] = int(mask_steps)
    mask_seconds = grown.get("strata_grammar_mask_seconds_total", 0.0)
    result["grammar_mask_ms_per_step"] = mask_seconds / mask_steps * 1000 if mask_steps else None
    return result


async def _cache_counters(client: httpx.AsyncClient) -> dict[str, float]:
    """The server's prefill and prefix-cache counters, summed over replicas."""
    response = await client.get("/metrics")
    response.raise_for_status()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name in _CACHE_COUNTERS:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


_CACHE_COUNTERS = (
    "strata_prompt_tokens_computed_total", "strata_prefix_cache_queries_total", "strata_prefix_cache_hits_total",
    "strata_grammar_mask_seconds_total", "strata_grammar_mask_steps_total",
)


async def _model_name(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def _request(
    client: httpx.AsyncClient, gate: asyncio.Semaphore, model: str, prompt: str, max_tokens: int,
    extra: dict | None,
) -> _Sample:
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}, **(extra or {}),
    }
    async with gate:
        sample = _Sample()
        sent = time.perf_counter()
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    sample.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')}"
                    return sample
                async with aclosing(stream_events(response)) as events:
                    async for event in events:
                        if "error" in event:
                            sample.error = event["error"]["message"]
                            return sample
                        if event["choices"] and not sample.ttft:
                            sample.ttft = time.perf_counter() - sent
                        if event.get("usage"):
                            sample.output_tokens = event["usage"]["completion_tokens"]
        except httpx.HTTPError as error:
            sample.error = f"{type(error).__name__}: {error}"
            return sample
        sample.latency = time.perf_counter() - sent
        if not sample.output_tokens:
            sample.error = "the stream ended without a usage chunk"
        return sample


# Where server-sent events end a line (CR, LF or CRLF), and nowhere else: httpx's aiter_lines
# also splits at U+0085, U+2028 and U+2029, which a JSON string may carry raw (vLLM's server sends
# them so), and would cut such an event in two.
_SSE_LINE_END = re.compile(r"\r\n|\r|\n")


async def stream_events(response: httpx.Response) -> AsyncIterator[dict]:
    """The JSON data of each event of a streamed OpenAI response, up to its ``[DONE]``."""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = _SSE_LINE_END.split(pending + text)
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[len("data: "):])


def _summarize(load: Load, model: str, samples: list[_Sample], elapsed: float) -> dict:
    done = [sample for sample in samples if sample.error is None]
    output_tokens = sum(sample.output_tokens for sample in done)
    result = {
        "url": load.url,
        "model": model,
        "num_prompts": load.num_prompts,
        "request_rate": load.request_rate if math.isfinite(load.request_rate) else "inf",
        "max_concurrency": load.max_concurrency,
        "max_tokens": load.max_tokens,
        "workload": load.workload,
        "completed": len(done),
        "failed": len(samples) - len(done),
        "errors": [sample.error for sample in samples if sample.error is not None][:_MAX_REPORTED_ERRORS],
        "duration_s": elapsed,
        "requests_per_s": len(done) / elapsed,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / elapsed,
    }
    tpots = [(s.latency - s.ttft) / (s.output_tokens - 1) for s in done if s.output_tokens > 1]
    for name, values in (("ttft", [s.ttft for s in done]), ("tpot", tpots), ("e2e", [s.latency for s in done])):
        milliseconds = np.asarray(values, dtype=float) * 1000
        for stat, value in (("mean", np.mean), ("median", np.median), ("p99", lambda v: np.percentile(v, 99))):
            result[f"{stat}_{name}_ms"] = float(value(milliseconds)) if len(milliseconds) else None
    return result


def format_result(result: dict) -> str:
    """``run``'s figures as a few lines of text."""
    lines = [
        f"{result['completed']} of {result['num_prompts']} requests completed ({result['failed']} failed) "
        f"in {result['duration_s']:.2f} s; request rate {result['request_rate']}, "
        f"max concurrency {result['max_concurrency'] or 'unlimited'}",
        f"throughput: {result['requests_per_s']:.2f} requests/s, {result['output_tokens_per_s']:.1f} output tokens/s",
    ]
    for name in ("ttft", "tpot", "e2e"):
        if result[f"mean_{name}_ms"] is not None:
            lines.append(
                f"{name.upper()} ms: mean {result[f'mean_{name}_ms']:.1f}, median {result[f'median_{name}_ms']:.1f}, "
                f"p99 {result[f'p99_{name}_ms']:.1f}"
            )
    hit_rate = result.get("prefix_hit_rate")
    lines.append(
        f"prefill: {result.get('prefill_tokens')} prompt tokens computed; prefix-cache hit rate "
        + ("n/a" if hit_rate is None else f"{hit_rate:.1%}")
    )
    lines += [f"error: {error}" for error in result["errors"]]
    if "structured" in result:
        constrained = result["structured"]
        mask = constrained["grammar_mask_ms_per_step"]
        lines += [
            "with a JSON schema on every request:",
            format_result(constrained),
            f"structured / unconstrained output tokens/s: {result['structured_output_tokens_per_s_ratio']:.1%}; "
            f"grammar masks: " + ("n/a" if mask is None else f"{mask:.2f} ms per constrained step"),
        ]
    return "\n".join(lines)


def _check_loopback(url: str) -> None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must look like http://127.0.0.1:8000, got {url!r}")
    if parts.hostname == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(parts.hostname).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"url must point at a loopback address (127.0.0.1, ::1, localhost), got {parts.hostname!r}")
