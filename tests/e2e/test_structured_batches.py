"""Constrained and unconstrained requests share steps without touching each other (greedy)."""

import json

import pytest

from strata import LLM, SamplingParams
from strata.engine_core.sampling_params import StructuredOutputsParams

PROMPTS = ["The capital of France is", "Once upon a time"]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    with LLM(executor="uni", dtype="float32", max_num_seqs=8) as llm:
        yield llm


def test_unconstrained_tokens_are_the_same_with_constrained_requests_in_the_batch(llm):
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    constrained = [
        SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA))),
        SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
    ]
    mixed = llm.generate(["A number as JSON:", "Yes or no?"] + PROMPTS, constrained + [plain, plain], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[2:]] == [o.outputs[0].token_ids for o in alone]
    if mixed[0].outputs[0].finish_reason == "stop":
        assert set(json.loads(mixed[0].outputs[0].text)) == {"n"}
    assert mixed[1].outputs[0].text in ("yes", "no")
    assert mixed[1].outputs[0].finish_reason == "stop"


def test_drafts_are_cut_where_the_grammar_refuses_them_or_would_end(default_model_path):
    from transformers import AutoTokenizer

    from strata.engine_core.structured_output import StructuredOutputs

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    structured = StructuredOutputs(str(default_model_path / "tokenizer.json"), len(tokenizer), tokenizer.eos_token_id)
    structured.submit("r", StructuredOutputsParams(regex="ab(c|d)e"))
    structured.wait_for_compile(30)
    assert structured.take_compiled() == (["r"], [])
    a, b, c, e, x = tokenizer.convert_tokens_to_ids(list("abcex"))
    assert structured.draft_prefix("r", [a, b, x, c]) == 2
    assert structured.draft_prefix("r", [a, b, c, e]) == 3, "the draft that ends the grammar is the model's to sample"
    assert structured.advance("r", a) is None, "the matcher is rolled back after each check"
    structured.shutdown()
