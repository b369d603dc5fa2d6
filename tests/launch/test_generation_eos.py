"""A model's generation config may list EOS ids beside its tokenizer's (a chat model's end of
turn): requests stop on them, as in vLLM and HF ``generate``, unless they ignore EOS."""

import json
from pathlib import Path

from strata.engine_core.sampling_params import SamplingParams
from strata.launch.output_processor import OutputProcessor
from strata.launch.tokenizer import generation_eos_token_ids


def write_generation_config(model_dir: Path, eos_token_id: object) -> Path:
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_token_id}))
    return model_dir


def test_generation_config_eos_ids_other_than_the_tokenizers_are_extra(tmp_path: Path) -> None:
    assert generation_eos_token_ids(write_generation_config(tmp_path, [1, 106, 106]), 1) == (106,)


def test_single_eos_id_equal_to_the_tokenizers_adds_nothing(tmp_path: Path) -> None:
    assert generation_eos_token_ids(write_generation_config(tmp_path, 2), 2) == ()


def test_model_without_generation_config_has_no_extra_eos_ids(tmp_path: Path) -> None:
    assert generation_eos_token_ids(tmp_path, 2) == ()


def test_extra_eos_ids_join_the_requests_stop_token_ids() -> None:
    processor = OutputProcessor(None, 1, (106,))
    [request] = processor.add_request("a", None, [5, 6], SamplingParams(stop_token_ids=[7, 106]))
    assert request.sampling_params.stop_token_ids == [7, 106]
    [request] = processor.add_request("b", None, [5, 6], SamplingParams(max_tokens=3))
    assert request.eos_token_id == 1 and request.sampling_params.stop_token_ids == [106]


def test_requests_that_ignore_eos_do_not_stop_on_extra_eos_ids() -> None:
    processor = OutputProcessor(None, 1, (106,))
    [request] = processor.add_request("a", None, [5, 6], SamplingParams(ignore_eos=True))
    assert not request.sampling_params.stop_token_ids
