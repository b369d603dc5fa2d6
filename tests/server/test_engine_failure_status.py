"""Whose fault a failed request is decides its HTTP status: what the engine refused for the
request itself is a 400, a request lost with its data-parallel replica (or a dead worker) is a
503 naming the replica, in OpenAI's error format. ``EngineRun`` against an engine stand-in that
ends each request with one delta."""

import asyncio
from collections.abc import AsyncGenerator

import pytest

from strata.engine_core.sampling_params import SamplingParams
from strata.launch.output_processor import CompletionDelta
from strata.launch.outputs import CompletionOutput, RequestMetrics, RequestOutput
from strata.launch.server.protocol import APIError
from strata.launch.server.streams import EngineRun, Job

REPLICA_DIED = "data-parallel replica 1 failed: worker rank 0 on node 10.213.0.3 died during step 7"


class OneDeltaEngine:
    """The part of ``AsyncEngine`` an ``EngineRun`` uses, ending every request with ``delta``."""

    def __init__(self, delta: CompletionDelta) -> None:
        self.delta = delta

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str, **_) -> AsyncGenerator:
        yield self.delta

    def output_of(self, request_id: str) -> RequestOutput:
        completion = CompletionOutput(0, finish_reason="error", error=self.delta.error)
        return RequestOutput(request_id, None, [1, 2], [completion], RequestMetrics(0.0))


class NoMetrics:
    def observe(self, output: RequestOutput) -> None:
        pass


def failure(error: str, engine_fault: bool) -> APIError:
    delta = CompletionDelta("r", 0, "", [], None, "error", error=error, engine_fault=engine_fault)
    job = Job("r", 0, "tiny", [[1, 2]], SamplingParams(max_tokens=4), stream=False, include_usage=False)

    async def collect() -> None:
        run = EngineRun(OneDeltaEngine(delta), NoMetrics(), job)
        try:
            await run.collect()
        finally:
            await run.close()

    with pytest.raises(APIError) as raised:
        asyncio.run(collect())
    return raised.value


def test_a_request_lost_with_its_replica_is_a_503_naming_the_replica():
    error = failure(REPLICA_DIED, engine_fault=True)
    assert error.status == 503
    assert error.body.model_dump() == {
        "error": {"message": REPLICA_DIED, "type": "server_error", "param": None, "code": "engine_failed"}
    }


def test_a_request_the_engine_refused_for_itself_stays_a_400():
    error = failure("data-parallel replica 0: prompt token id 99 is outside the vocabulary [0, 97)", engine_fault=False)
    assert error.status == 400 and error.body.error.type == "invalid_request_error"
