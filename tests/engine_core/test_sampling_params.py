import msgspec
import pytest

from strata.engine_core.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", -1),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", -2),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("n", 0),
        ("logprobs", -1),
        ("prompt_logprobs", -1),
        ("presence_penalty", 2.5),
        ("repetition_penalty", 0.0),
        ("max_tokens", "16"),
        ("temperature", float("nan")),
    ],
)
def test_out_of_range_value_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("stop", [5, [1, 2], ["ok", None], [""]])
def test_unknown_stop_types_are_rejected(stop):
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=stop)


@pytest.mark.parametrize("ids", [["a"], [-1], 3, [True]])
def test_stop_token_ids_must_be_non_negative_integers(ids):
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=ids)


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]


def test_decoding_validates_too():
    data = msgspec.msgpack.encode({"top_p": 3.0})
    with pytest.raises(ValueError, match="top_p"):
        msgspec.msgpack.decode(data, type=SamplingParams)
