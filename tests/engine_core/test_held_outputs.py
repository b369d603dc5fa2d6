"""Requests that do not stream: the EngineCore holds their tokens, logprobs and prompt logprobs
and hands them over whole with the finish record, stamped with when it took the first and last
tokens; a streamed twin of the same request gets the same results step by step."""

from strata.engine_core.core import EngineCore
from strata.engine_core.protocol import EngineCoreOutputs, EngineCoreRequest, FinishedRequest, TokenLogprobs
from strata.engine_core.held_outputs import HeldOutputs
from strata.engine_core.sampling_params import SamplingParams
from strata.engine_core.scheduler import SchedulerConfig
from fake_runner import FakeExecutor

PROMPT = list(range(5, 35))


def request(request_id: str, stream: bool, **params) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, PROMPT, SamplingParams(max_tokens=6, seed=1, **params), None, 0.0, stream=stream)


def test_a_held_request_gets_in_its_last_step_what_its_streamed_twin_got_step_by_step():
    # A budget of 8 tokens a step splits each 30-token prompt into prefill chunks.
    core = EngineCore(SchedulerConfig(max_num_batched_tokens=8, block_size=4), FakeExecutor())
    core.add_request(request("held", stream=False, prompt_logprobs=1))
    core.add_request(request("streamed", stream=True, prompt_logprobs=1))
    got = {"held": [], "streamed": []}
    prompt_scores = {"held": [], "streamed": []}
    steps_with_held_results = 0
    finished: dict[str, FinishedRequest] = {}
    while core.has_work():
        outputs = core.step()
        for request_id, token in zip(outputs.request_ids, outputs.new_token_ids):
            got[request_id].append(token)
        for request_id, scores in outputs.prompt_logprobs.items():
            prompt_scores[request_id] += scores.entries()
        steps_with_held_results += "held" in outputs.request_ids or "held" in outputs.prompt_logprobs
        finished.update((record.request_id, record) for record in outputs.finished)
    assert steps_with_held_results == 1
    assert len(got["held"]) == 6 and got["held"] == got["streamed"]
    assert len(prompt_scores["held"]) == len(PROMPT) - 1 and prompt_scores["held"] == prompt_scores["streamed"]
    held = finished["held"]
    assert held.first_token_time is not None and held.first_token_time <= held.last_token_time
    assert finished["streamed"].first_token_time is None


def test_held_token_logprobs_come_in_token_order_with_the_finish():
    held = HeldOutputs()
    held.hold("r")
    entries = [TokenLogprobs([token], [-0.5 * token]) for token in (11, 12, 13)]
    first = held.filter(EngineCoreOutputs(["r", "s"], [11, 90], {"r": entries[:1]}))
    assert (first.request_ids, first.new_token_ids, first.logprobs) == (["s"], [90], {})
    last = held.filter(EngineCoreOutputs(["r", "r"], [12, 13], {"r": entries[1:]}, [FinishedRequest("r", "length")]))
    assert (last.request_ids, last.new_token_ids, last.logprobs) == (["r"] * 3, [11, 12, 13], {"r": entries})


def test_failing_everything_hands_over_what_a_held_request_had_generated():
    core = EngineCore(SchedulerConfig(block_size=4), FakeExecutor())
    core.add_request(request("held", stream=False))
    first, second = core.step(), core.step()
    assert first.request_ids == second.request_ids == []
    ending = core.abort_everything("worker rank 0 died")
    assert len(ending.request_ids) == 2 and set(ending.request_ids) == {"held"}
    (record,) = ending.finished
    assert record.engine_fault and record.first_token_time is not None
