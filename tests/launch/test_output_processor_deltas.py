"""The output processor's deltas when a step brings a request several tokens (verified drafts):
one delta per request per step, with every token and its text, and nothing past a stop string."""

from transformers import AutoTokenizer

from strata.engine_core.protocol import EngineCoreOutputs
from strata.engine_core.sampling_params import SamplingParams
from strata.launch.output_processor import OutputProcessor
from strata.worker.model_loader import resolve_model_path


def processor_with(stop: list[str] | None = None) -> tuple[OutputProcessor, list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(None))
    processor = OutputProcessor(tokenizer, tokenizer.eos_token_id)
    processor.add_request("r", "Hello", tokenizer.encode("Hello"), SamplingParams(max_tokens=20, stop=stop))
    return processor, tokenizer.encode(" one two three four", add_special_tokens=False)


def test_several_tokens_of_one_request_in_a_step_make_one_delta_with_all_of_them():
    processor, tokens = processor_with()
    deltas, to_abort = processor.process(EngineCoreOutputs(request_ids=["r"] * len(tokens), new_token_ids=tokens))
    (delta,) = deltas
    assert (delta.text, delta.token_ids, to_abort) == (" one two three four", tokens, [])


def test_a_stop_string_inside_a_steps_tokens_drops_the_tokens_after_it():
    processor, tokens = processor_with(stop=[" two"])
    deltas, to_abort = processor.process(EngineCoreOutputs(request_ids=["r"] * len(tokens), new_token_ids=tokens))
    (delta,) = deltas
    assert (delta.text, delta.finish_reason, to_abort) == (" one", "stop", ["r"])
    assert processor.outputs["r"].outputs[0].text == " one"
