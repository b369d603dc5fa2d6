"""With data parallelism, ``/health`` stays 200 but says "degraded" while one replica
serves and is 503 once none does; ``/metrics`` has a series per replica. An engine stand-in
answers for the replicas (the replicas themselves are tested in tests/multiproc)."""

from types import SimpleNamespace

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from strata.engine_core.protocol import SchedulerStats
from strata.runtime.core_client import EngineDeadError
from strata.launch.server.app import AppOptions, build_app


class Replicas:
    """The part of ``AsyncEngine`` that ``/health`` and ``/metrics`` read."""

    def __init__(self) -> None:
        self.args = SimpleNamespace(model="/models/tiny", lora_enabled=False, max_loras=1)
        self.max_model_len = 128
        self.states = {0: "ok", 1: "ok"}
        self.stats = {
            0: SchedulerStats(2, 1, 0.5, 100, 40, 0, 60),
            1: SchedulerStats(0, 0, 0.0, 50, 0, 1, 50),
        }

    async def check_health(self) -> dict[int, str]:
        if all(state != "ok" for state in self.states.values()):
            raise EngineDeadError("replica 0: gone; replica 1: gone")
        return dict(self.states)

    def replica_stats(self) -> dict[int, SchedulerStats]:
        return {replica: stats for replica, stats in self.stats.items() if self.states[replica] == "ok"}


def test_health_is_ok_while_every_replica_serves():
    client = TestClient(build_app(Replicas(), AppOptions()))
    response = client.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "replicas": {"0": "ok", "1": "ok"}}


def test_health_is_degraded_but_200_while_one_replica_serves():
    engine = Replicas()
    engine.states[1] = "the EngineCore process exited (code -9)"
    response = TestClient(build_app(engine, AppOptions())).get("/health")
    assert response.status_code == 200
    assert response.json()["status"] == "degraded"
    assert response.json()["replicas"]["1"] == "the EngineCore process exited (code -9)"


def test_health_is_503_once_no_replica_serves():
    engine = Replicas()
    engine.states = {0: "gone", 1: "gone"}
    response = TestClient(build_app(engine, AppOptions())).get("/health")
    assert response.status_code == 503 and "replica 0" in response.json()["error"]["message"]


def test_metrics_have_a_series_per_replica():
    engine = Replicas()
    text = TestClient(build_app(engine, AppOptions())).get("/metrics").text
    samples = {
        (sample.name, sample.labels.get("replica")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert samples[("strata_num_requests_running", "0")] == 2 and samples[("strata_num_requests_running", "1")] == 0
    assert samples[("strata_prompt_tokens_computed_total", "0")] == 60
    assert samples[("strata_prefix_cache_hit_rate", "0")] == 0.4
    engine.states[1] = "gone"
    text = TestClient(build_app(engine, AppOptions())).get("/metrics").text
    assert 'replica="1"' not in text and 'replica="0"' in text
