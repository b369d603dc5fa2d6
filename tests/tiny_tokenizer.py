"""A word-level tokenizer the tests build and save beside a tiny model: with or without a BOS
token added to every encoded text, and a chat template that writes its own BOS."""

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<unk>", "<s>", "</s>"]
WORDS = ["user", "assistant", ":", "hello", "world", "the", "sea", "is", "blue"]
BOS_ID = SPECIAL.index("<s>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def save_tiny_tokenizer(path: Path, adds_bos: bool) -> PreTrainedTokenizerFast:
    """Save to ``path`` a tokenizer over ``SPECIAL + WORDS`` (ids in that order); with
    ``adds_bos``, encoding a text with special tokens puts ``<s>`` first, as Llama's does."""
    vocab = {token: index for index, token in enumerate(SPECIAL + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    if adds_bos:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=CHAT_TEMPLATE
    )
    tokenizer.save_pretrained(path)
    return tokenizer
