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
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict],
    tools: list[dict] | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
) -> list[int]:
    """The token ids of a conversation through the chat template, by default ready for the
    assistant's reply. ``tools`` (OpenAI tool definitions) go to templates that render them;
    ``continue_final_message`` leaves the last message open for the model to go on with.

    Raises ``jinja2.TemplateError`` if the template rejects the messages, ``ValueError`` if the
    options do not fit them (e.g. no final message to continue).
    """
    text = tokenizer.apply_chat_template(
        list(messages), tools=tools, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, tokenize=False,
    )
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
