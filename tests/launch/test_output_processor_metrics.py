"""What the output processor asks of the EngineCore and how it times a request: a caller that
wants only whole completions gets its tokens held (unless stop strings need the text as it
grows), and held tokens are timed by the EngineCore's stamps, not by when they arrived."""

import pytest
from transformers import AutoTokenizer

from strata.engine_core.protocol import EngineCoreOutputs, FinishedRequest
from strata.engine_core.sampling_params import SamplingParams
from strata.launch.output_processor import OutputProcessor
from strata.worker.model_loader import resolve_model_path


def make_processor() -> tuple[OutputProcessor, list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(None))
    return OutputProcessor(tokenizer, tokenizer.eos_token_id), tokenizer.encode("Hello")


def test_only_whole_completions_are_held_unless_stop_strings_must_be_watched():
    processor, prompt = make_processor()
    (held,) = processor.add_request("a", "Hello", prompt, SamplingParams(), stream=False)
    (watched,) = processor.add_request("b", "Hello", prompt, SamplingParams(stop=["."]), stream=False)
    (streamed,) = processor.add_request("c", "Hello", prompt, SamplingParams())
    assert (held.stream, watched.stream, streamed.stream) == (False, True, True)


def test_held_tokens_take_their_times_from_the_finish_record():
    processor, prompt = make_processor()
    processor.add_request("r", "Hello", prompt, SamplingParams(max_tokens=3), stream=False)
    arrival = processor.outputs["r"].metrics.arrival_time
    record = FinishedRequest("r", "length", first_token_time=arrival + 0.25, last_token_time=arrival + 0.75)
    processor.process(EngineCoreOutputs(["r"] * 3, [11, 12, 13], finished=[record]))
    metrics = processor.outputs["r"].metrics
    assert metrics.time_to_first_token == pytest.approx(0.25)
    assert metrics.time_per_output_token == pytest.approx(0.25)
    assert metrics.num_generated_tokens == 3
