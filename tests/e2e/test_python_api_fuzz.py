"""Hostile values through the Python API: every bad ``SamplingParams`` field and every bad
``LLM.generate`` argument raises ValueError or TypeError naming the field, leaves nothing
behind, and the engine keeps serving. A tiny model in one process keeps it fast."""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata import LLM, SamplingParams

from conftest import save_tiny_model_with_tokenizer

VOCAB_SIZE = 97  # the tiny model's
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GOOD = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory, default_model_path):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_model_with_tokenizer("llama", path, default_model_path)
    with LLM(str(path), executor="uni", dtype="float32", max_model_len=128, num_gpu_blocks=64) as llm:
        yield llm


def assert_serving(llm: LLM) -> None:
    assert llm.processor.outputs == {}, "a refused call left requests behind"
    (output,) = llm.generate([[5, 6, 7]], GOOD, use_tqdm=False)
    assert output.outputs[0].finish_reason == "length" and len(output.outputs[0].token_ids) == 3


scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
anything = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return (is_int(value) or isinstance(value, float)) and not (isinstance(value, float) and not math.isfinite(value))


not_an_int = anything.filter(lambda v: not is_int(v))
not_a_number = anything.filter(lambda v: not is_number(v))  # includes NaN and infinities
not_a_bool = anything.filter(lambda v: not isinstance(v, bool))
BAD_VALUES = {
    "n": not_an_int | st.integers(max_value=0),
    "temperature": not_a_number | st.floats(max_value=-1e-9, allow_infinity=False) | st.integers(max_value=-1),
    "top_p": not_a_number | st.floats(max_value=0, allow_infinity=False) | st.floats(min_value=1.0000001, allow_infinity=False),
    "top_k": not_an_int | st.just(0) | st.integers(max_value=-2),
    "min_p": not_a_number | st.floats(max_value=-1e-9, allow_infinity=False) | st.floats(min_value=1.0000001, allow_infinity=False),
    "seed": not_an_int.filter(lambda v: v is not None) | st.integers(min_value=2**63) | st.integers(max_value=-(2**63) - 1),
    "max_tokens": not_an_int | st.integers(max_value=-1),  # 0 is valid: prompt logprobs without generating
    "min_tokens": not_an_int | st.integers(max_value=-1) | st.integers(min_value=17),  # above max_tokens (16)
    "stop": anything.filter(lambda v: v is not None and not isinstance(v, str | list))
    | st.lists(anything.filter(lambda v: not isinstance(v, str)), min_size=1, max_size=3) | st.just("") | st.just(["a", ""]),
    "stop_token_ids": anything.filter(lambda v: v is not None and not isinstance(v, list))
    | st.lists(not_an_int | st.integers(max_value=-1), min_size=1, max_size=3),
    "include_stop_str_in_output": not_a_bool,
    "ignore_eos": not_a_bool,
    "skip_special_tokens": not_a_bool,
    "logprobs": not_an_int.filter(lambda v: v is not None) | st.integers(max_value=-1),
    "presence_penalty": not_a_number | st.floats(min_value=2.0000001, allow_infinity=False) | st.floats(max_value=-2.0000001, allow_infinity=False),
    "frequency_penalty": not_a_number | st.floats(min_value=2.0000001, allow_infinity=False) | st.integers(max_value=-3),
    "repetition_penalty": not_a_number | st.floats(max_value=0, allow_infinity=False),
}


@st.composite
def one_bad_field(draw) -> tuple[str, object]:
    field = draw(st.sampled_from(sorted(BAD_VALUES)))
    return field, draw(BAD_VALUES[field])


@FUZZ
@given(one_bad_field())
def test_bad_sampling_params_field_raises_naming_it(llm, field_and_value):
    field, value = field_and_value
    with pytest.raises((ValueError, TypeError)) as error:
        llm.generate([[5, 6, 7]], SamplingParams(**{field: value}), use_tqdm=False)
    assert field in str(error.value)
    assert llm.processor.outputs == {}


bad_prompts = (
    anything.filter(lambda v: v is not None and not isinstance(v, str | list))
    | st.just([[]])
    | st.lists(st.lists(st.floats() | st.booleans() | st.text(max_size=3), min_size=1, max_size=3), min_size=1, max_size=3)
)


@FUZZ
@given(
    st.sampled_from(["prompts", "sampling_params", "cache_salt"]),
    bad_prompts,
    anything.filter(lambda v: v is not None and not isinstance(v, SamplingParams)),
    anything.filter(lambda v: v is not None and not isinstance(v, str)) | st.just(""),
)
def test_bad_generate_argument_raises_naming_it(llm, field, prompts, sampling_params, cache_salt):
    arguments = {"prompts": [[5, 6, 7], [8, 9]], "sampling_params": GOOD, "cache_salt": None}
    arguments[field] = {"prompts": prompts, "sampling_params": sampling_params, "cache_salt": cache_salt}[field]
    with pytest.raises((ValueError, TypeError)) as error:
        llm.generate(arguments["prompts"], arguments["sampling_params"], use_tqdm=False, cache_salt=arguments["cache_salt"])
    assert field in str(error.value)
    assert llm.processor.outputs == {}


def test_engine_serves_after_the_fuzzing(llm):
    assert_serving(llm)


def test_stop_token_id_outside_the_vocabulary_fails_its_request_not_the_engine(llm):
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=2, stop_token_ids=[VOCAB_SIZE + 3])
    (output,) = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert output.outputs[0].finish_reason == "error" and "stop_token_ids" in output.outputs[0].error
    assert_serving(llm)
