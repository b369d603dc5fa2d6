"""How text and chat prompts become token ids, the same way in ``LLM``, the CLI and the server.

A text prompt gets whatever special tokens the model's tokenizer adds by default (a BOS token
for Llama, Mistral or Gemma; nothing for SmolLM2 or Qwen), as HF transformers and vLLM encode
it. A chat prompt is the chat template rendered to text and encoded without them: a template
writes its own BOS where the model wants one, and a second would change the output.
"""

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The token ids of a plain text prompt, with the tokenizer's default special tokens."""
    return tokenizer.encode(text, add_special_tokens=True)


def encode_chat(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict], tools: list[dict] | None = None
) -> list[int]:
    """The token ids of a conversation through the chat template, ready for the assistant's reply.
    ``tools`` (OpenAI tool definitions) go to templates that render them.

    Raises ``jinja2.TemplateError`` if the template rejects the messages.
    """
    text = tokenizer.apply_chat_template(list(messages), tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
