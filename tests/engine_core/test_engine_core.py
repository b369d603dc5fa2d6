"""The EngineCore's own checks, with a model-free executor: every token id that would reach a
worker is checked against the vocabulary before the request is queued; when the engine fails
(its executor lost a worker), the requests it fails are marked as its fault, a refusal is not."""

from strata.engine_core.core import EngineCore
from strata.engine_core.protocol import EngineCoreRequest
from strata.engine_core.sampling_params import SamplingParams
from strata.engine_core.scheduler import SchedulerConfig
from fake_runner import FakeExecutor

VOCAB_SIZE = FakeExecutor.vocab_size


def make_request(request_id: str, eos_token_id: int | None = None, **params) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [5, 6, 7, 8], SamplingParams(max_tokens=4, **params), eos_token_id, 0.0)


def run(core: EngineCore) -> dict[str, tuple[str, str | None]]:
    finished = {}
    while core.has_work():
        for request in core.step().finished:
            finished[request.request_id] = (request.finish_reason, request.message)
    return finished


def test_stop_token_id_outside_the_vocabulary_is_refused_and_others_still_run():
    core = EngineCore(SchedulerConfig(), FakeExecutor())
    core.add_request(make_request("bad", stop_token_ids=[3, VOCAB_SIZE], min_tokens=2))
    core.add_request(make_request("good", stop_token_ids=[3], min_tokens=2))
    finished = run(core)
    reason, message = finished["bad"]
    assert reason == "error" and "stop_token_ids" in message and str(VOCAB_SIZE) in message
    assert finished["good"] == ("length", None)


def test_eos_token_id_outside_the_vocabulary_is_refused():
    core = EngineCore(SchedulerConfig(), FakeExecutor())
    core.add_request(make_request("bad", eos_token_id=VOCAB_SIZE + 7))
    reason, message = run(core)["bad"]
    assert reason == "error" and "eos_token_id" in message


def test_prompt_token_id_outside_the_vocabulary_is_refused():
    core = EngineCore(SchedulerConfig(), FakeExecutor())
    core.add_request(EngineCoreRequest("bad", [5, -1], SamplingParams(), None, 0.0))
    reason, message = run(core)["bad"]
    assert reason == "error" and "prompt token id -1" in message


def test_failing_everything_marks_the_engines_fault_but_not_an_earlier_refusal():
    core = EngineCore(SchedulerConfig(), FakeExecutor())
    core.add_request(make_request("running"))
    core.step()
    core.add_request(make_request("refused", eos_token_id=VOCAB_SIZE))
    finished = {request.request_id: request for request in core.abort_everything("worker rank 1 died").finished}
    assert (finished["running"].finish_reason, finished["running"].message) == ("error", "worker rank 1 died")
    assert finished["running"].engine_fault
    assert finished["refused"].finish_reason == "error" and not finished["refused"].engine_fault
