"""``--load-format dummy`` from a bare config.json: the engine starts without a checkpoint or a
tokenizer, generates from token ids, and TP=2 computes what TP=1 does."""

import pytest

from strata import LLM, SamplingParams

from model_factory import random_prompts, tiny_llama_config

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def config_json(tmp_path):
    # Head counts that split over two ranks, an odd vocabulary that pads the last rank's shard.
    tiny_llama_config(num_key_value_heads=4).save_pretrained(tmp_path)
    return str(tmp_path / "config.json")


def greedy_tokens(config_json: str, prompts: list[list[int]], **engine_args) -> list[list[int]]:
    with LLM(config_json, load_format="dummy", skip_tokenizer=True, dtype="float32", **engine_args) as llm:
        return [output.outputs[0].token_ids for output in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_dummy_weights_tp2_equal_tp1_from_a_bare_config(config_json):
    prompts = random_prompts([5, 23], vocab_size=97)
    single = greedy_tokens(config_json, prompts, executor="uni")
    assert all(len(tokens) == GREEDY.max_tokens for tokens in single)
    assert len({token for tokens in single for token in tokens}) > 1  # not a constant stream
    assert greedy_tokens(config_json, prompts, executor="mp", tensor_parallel_size=2) == single


def test_without_a_tokenizer_text_prompts_are_refused_and_outputs_have_no_text(config_json):
    with LLM(config_json, load_format="dummy", skip_tokenizer=True, executor="uni") as llm:
        with pytest.raises(ValueError, match="need a tokenizer"):
            llm.generate("hello", GREEDY, use_tqdm=False)
        output = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0]
    assert output.text == "" and len(output.token_ids) == GREEDY.max_tokens


def test_a_bare_config_without_dummy_weights_asks_for_a_tokenizer_or_weights(config_json):
    with pytest.raises((ValueError, FileNotFoundError), match="tokenizer|safetensors"):
        LLM(config_json, executor="uni")
