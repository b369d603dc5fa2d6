"""The mp executor schedules each step while the workers run the one before (asynchronous
scheduling, on by default): the default model's outputs equal the in-process engine's, which
runs one step at a time: greedy and seeded tokens, stop tokens, lengths, logprobs, and a
request under a grammar among plain ones."""

import json

import pytest

from strata import LLM, SamplingParams
from strata.engine_core.sampling_params import StructuredOutputsParams

PROMPTS = [
    "The capital of France is",
    "Write one short sentence about the sea.",
    "def quicksort(items):",
    "Answer yes or no: is water wet?",
]
# EOS not ignored: some requests stop on it while their next step is already on its way.
PARAMS = [
    SamplingParams(temperature=0, max_tokens=40),
    SamplingParams(temperature=0, max_tokens=60, logprobs=2),
    SamplingParams(temperature=0.8, seed=7, max_tokens=30),
    SamplingParams(temperature=0, max_tokens=3),
]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
CONSTRAINED = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA)))


def outputs(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[tuple]:
    return [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs)
        for o in llm.generate(prompts, params, use_tqdm=False)
    ]


@pytest.fixture(scope="module")
def one_step_at_a_time() -> dict[str, list[tuple]]:
    with LLM(executor="uni", dtype="float32") as llm:
        return {
            "plain": outputs(llm, PROMPTS, PARAMS),
            "constrained": outputs(llm, ["A number as JSON:"] + PROMPTS[:2], [CONSTRAINED] + PARAMS[:2]),
        }


def assert_same(ahead: list[tuple], expected: list[tuple]) -> None:
    for (tokens, reason, logprobs), (tokens_1, reason_1, logprobs_1) in zip(ahead, expected, strict=True):
        assert (tokens, reason) == (tokens_1, reason_1)
        assert (logprobs is None) == (logprobs_1 is None)
        for position, position_1 in zip(logprobs or [], logprobs_1 or [], strict=True):
            assert position.keys() == position_1.keys()
            assert list(position.values()) == pytest.approx(list(position_1.values()), abs=1e-4)


def test_mp_scheduling_ahead_gives_the_outputs_of_one_step_at_a_time(one_step_at_a_time):
    with LLM(executor="mp", dtype="float32") as llm:
        ahead = outputs(llm, PROMPTS, PARAMS)
    assert_same(ahead, one_step_at_a_time["plain"])
    assert {reason for _, reason, _ in ahead} == {"stop", "length"}


def test_mp_with_a_request_under_a_grammar_gives_the_outputs_of_one_step_at_a_time(one_step_at_a_time):
    with LLM(executor="mp", dtype="float32") as llm:
        mixed = outputs(llm, ["A number as JSON:"] + PROMPTS[:2], [CONSTRAINED] + PARAMS[:2])
    assert_same(mixed, one_step_at_a_time["constrained"])
