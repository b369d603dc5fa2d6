"""Streamed text is the tokenizer's own decode of the output, delta by delta, for the packaged
models' tokenizers (the Rust DecodeStream path) and for one that cleans up spaces (decode)."""

import pytest
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel, WordPiece
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from strata.launch.detokenizer import IncrementalDetokenizer
from strata.launch.tokenizer import load_tokenizer
from strata.worker.model_loader import resolve_model_path

# Accents, CJK, emoji (multi-byte characters split over several tokens), digits and punctuation.
TEXT = "Héllo wörld! 漢字かな, naïve café: 3.14 🎉🚀 — «quotes» and\nnew lines\t tabs.  Done"


@pytest.fixture(scope="module", params=[None, "gemma3-270m"], ids=["default-model", "gemma3-270m"])
def tokenizer(request) -> PreTrainedTokenizerBase:
    return load_tokenizer(resolve_model_path(request.param))


def stream(tokenizer: PreTrainedTokenizerBase, prompt: list[int], output: list[int], **options) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, [], **options)
    deltas = [detokenizer.append(token) for token in output] + [detokenizer.flush()]
    assert "".join(deltas) == detokenizer.text
    return deltas


def test_streamed_deltas_join_into_the_decode_of_the_output(tokenizer: PreTrainedTokenizerBase) -> None:
    output = tokenizer.encode(TEXT, add_special_tokens=False)
    deltas = stream(tokenizer, tokenizer.encode("Say it:", add_special_tokens=False), output)
    assert "".join(deltas) == tokenizer.decode(output, skip_special_tokens=True) == TEXT
    assert not any("\ufffd" in delta for delta in deltas)  # a split character waits for its last token


def test_the_first_output_token_keeps_the_space_the_full_text_gives_it(tokenizer: PreTrainedTokenizerBase) -> None:
    assert_output_after_hello_is_space_world(tokenizer)


def test_a_tokenizer_that_drops_a_texts_leading_space_keeps_it_after_the_prompt() -> None:
    # Decoded alone, "▁world" is "world" (as with Llama 2's and Mistral's tokenizers).
    backend = Tokenizer(WordLevel({"[UNK]": 0, "▁Hello": 1, "▁world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    assert_output_after_hello_is_space_world(PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]"))


def assert_output_after_hello_is_space_world(tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    full = tokenizer.encode("Hello world", add_special_tokens=False)
    assert full[: len(prompt)] == prompt
    assert "".join(stream(tokenizer, prompt, full[len(prompt) :])) == " world"


def test_special_tokens_are_left_out_unless_asked_for(tokenizer: PreTrainedTokenizerBase) -> None:
    output = tokenizer.encode("Done.", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert "".join(stream(tokenizer, [], output)) == "Done."
    assert "".join(stream(tokenizer, [], output, skip_special_tokens=False)) == "Done." + tokenizer.eos_token


def test_a_tokenizer_that_cleans_up_spaces_streams_what_its_decode_gives() -> None:
    # The backend decodes "a ." and transformers' clean-up makes it "a.": the backend's own
    # stream would not, so this tokenizer goes through decode.
    vocab = {"[UNK]": 0, "a": 1, "b": 2, ".": 3, ",": 4, "##b": 5}
    backend = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(cleanup=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    output = tokenizer.encode("a b. ab, a.", add_special_tokens=False)
    assert "".join(stream(tokenizer, [], output)) == tokenizer.decode(output) == "a b. ab, a."
