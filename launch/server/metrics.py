"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own per server.

Two sources: the server observes every request it finishes (counts by finish reason, token
counts, latency histograms), and a collector reads each replica's latest ``SchedulerStats``
at scrape time (queue sizes, KV-cache usage, prefix-cache hits, preemptions, the CPU offload
tier, requests by LoRA adapter), labelled by replica.
"""

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from strata.engine_core.protocol import SchedulerStats
from strata.launch.outputs import RequestOutput

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0)


class ServerMetrics:
    """Everything ``/metrics`` shows. ``observe`` is called once per request, when it ends."""

    def __init__(self, replica_stats: Callable[[], dict[int, SchedulerStats]], max_loras: int = 0) -> None:
        self.registry = CollectorRegistry()
        self.finished = Counter(
            "strata_requests_finished",
            "Completions finished, by finish reason (one per choice: a request with n=2 counts twice; "
            "'abort' is a client that went away).",
            ["finish_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "strata_prompt_tokens", "Prompt tokens of finished requests.", registry=self.registry
        )
        self.generation_tokens = Counter(
            "strata_generation_tokens", "Tokens generated for finished requests.", registry=self.registry
        )
        self.time_to_first_token = Histogram(
            "strata_time_to_first_token_seconds", "From arrival to the first output token.", buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "strata_time_per_output_token_seconds", "Mean gap between output tokens after the first.",
            buckets=TPOT_BUCKETS, registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "strata_e2e_request_latency_seconds", "From arrival to the last output token of a completed request.",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.registry.register(_SchedulerStatsCollector(replica_stats))
        if max_loras:
            self.registry.register(_LoRACollector(replica_stats, max_loras))

    def observe(self, output: RequestOutput) -> None:
        """Count a request that ended (finished, failed or abandoned); time it only if it completed."""
        for completion in output.outputs:
            self.finished.labels(completion.finish_reason or "abort").inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(output.metrics.num_generated_tokens)
        if not all(completion.finish_reason in ("stop", "length") for completion in output.outputs):
            return
        metrics = output.metrics
        if metrics.time_to_first_token is not None:
            self.time_to_first_token.observe(metrics.time_to_first_token)
        if metrics.time_per_output_token is not None:
            self.time_per_output_token.observe(metrics.time_per_output_token)
        if metrics.last_token_time is not None:
            self.e2e_latency.observe(metrics.last_token_time - metrics.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SchedulerStatsCollector(Collector):
    """Each serving replica's state as of its last step (idle from start), labelled
    ``replica`` (``"0"`` without data parallelism)."""

    def __init__(self, replica_stats: Callable[[], dict[int, SchedulerStats]]) -> None:
        self._stats = replica_stats

    def collect(self) -> Iterator[Metric]:
        replicas = sorted(self._stats().items())
        if not replicas:
            return

        def family(kind: type, name: str, documentation: str, value: Callable[[SchedulerStats], float]) -> Metric:
            metric = kind(name, documentation, labels=["replica"])
            for replica, stats in replicas:
                metric.add_metric([str(replica)], value(stats))
            return metric

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield family(gauge, "strata_num_requests_running", "Requests in the running batch.", lambda s: s.num_running)
        yield family(gauge, "strata_num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting)
        yield family(gauge, "strata_kv_cache_usage_ratio", "Fraction of KV blocks in use.", lambda s: s.kv_cache_usage)
        yield family(counter, "strata_num_preemptions", "Requests preempted for KV space.", lambda s: s.num_preemptions)
        yield family(
            counter, "strata_prompt_tokens_computed", "Prompt tokens the model prefilled (cache hits excluded).",
            lambda s: s.prompt_tokens_computed,
        )
        for name, what, queries, hits in (
            ("prefix_cache", "the prefix cache", "prefix_cache_queries", "prefix_cache_hits"),
            ("offload", "the CPU offload tier", "offload_queried_tokens", "offload_hit_tokens"),
        ):
            yield family(counter, f"strata_{name}_queries", f"Prompt tokens looked up in {what}.", _field(queries))
            yield family(counter, f"strata_{name}_hits", f"Prompt tokens found in {what}.", _field(hits))
            yield family(
                gauge, f"strata_{name}_hit_rate", f"Hits / queries of {what}, since start.", _rate(queries, hits)
            )
        yield family(
            counter, "strata_offload_bytes_moved", "KV bytes copied to and from the CPU tier.",
            lambda s: s.offload_bytes_moved,
        )
        yield family(
            counter, "strata_offload_transfer_seconds", "Time spent copying KV to and from the CPU tier.",
            lambda s: s.offload_transfer_seconds,
        )
        yield family(
            gauge, "strata_offload_cpu_usage_ratio", "Fraction of CPU-tier blocks in use.", lambda s: s.offload_cpu_usage
        )
        yield family(
            counter, "strata_grammar_mask_seconds", "Time the EngineCore spent filling grammar masks.",
            lambda s: s.grammar_mask_seconds,
        )
        yield family(
            counter, "strata_grammar_mask_steps", "Steps that filled grammar masks (steps with constrained rows).",
            lambda s: s.grammar_mask_steps,
        )
        yield family(
            counter, "strata_spec_decode_draft_tokens", "Draft tokens verified (speculative decoding).",
            _field("spec_draft_tokens"),
        )
        yield family(
            counter, "strata_spec_decode_accepted_tokens", "Draft tokens accepted.", _field("spec_accepted_tokens")
        )
        yield family(
            counter, "strata_spec_decode_verifications", "Request steps that verified drafts.", _field("spec_verifications")
        )
        by_position = CounterMetricFamily(
            "strata_spec_decode_accepted_tokens_per_position", "Drafts accepted at each position of their step.",
            labels=["replica", "position"],
        )
        for replica, stats in replicas:
            for position, accepted in enumerate(stats.spec_accepted_by_position):
                by_position.add_metric([str(replica), str(position)], accepted)
        yield by_position


class _LoRACollector(Collector):
    """Each replica's running and waiting requests by LoRA adapter (``max_loras`` slots): one
    gauge per adapter with requests, and vLLM's ``lora_requests_info`` shape (the adapters as
    comma-separated label values) for dashboards built on it."""

    def __init__(self, replica_stats: Callable[[], dict[int, SchedulerStats]], max_loras: int) -> None:
        self._stats = replica_stats
        self._max_loras = str(max_loras)

    def collect(self) -> Iterator[Metric]:
        replicas = sorted(self._stats().items())
        by_adapter = {
            state: GaugeMetricFamily(
                f"strata_lora_requests_{state}", f"Requests {state} with each LoRA adapter.", labels=["replica", "lora_name"]
            )
            for state in ("running", "waiting")
        }
        info = GaugeMetricFamily(
            "strata_lora_requests_info", "The LoRA adapters of running and of waiting requests (always 1).",
            labels=["replica", "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        for replica, stats in replicas:
            for state, counts in (("running", stats.lora_running), ("waiting", stats.lora_waiting)):
                for name, count in sorted(counts.items()):
                    by_adapter[state].add_metric([str(replica), name], count)
            running, waiting = ",".join(sorted(stats.lora_running)), ",".join(sorted(stats.lora_waiting))
            info.add_metric([str(replica), running, waiting, self._max_loras], 1)
        yield from by_adapter.values()
        yield info


def _field(name: str) -> Callable[[SchedulerStats], float]:
    return lambda stats: getattr(stats, name)


def _rate(queries: str, hits: str) -> Callable[[SchedulerStats], float]:
    def rate(stats: SchedulerStats) -> float:
        asked = getattr(stats, queries)
        return getattr(stats, hits) / asked if asked else 0.0

    return rate
