"""vLLM's ``/tokenize`` and ``/detokenize``: token ids of a prompt or conversation, and the text
of token ids, with the tokenizer and chat path that serve generation, for clients that budget
their context."""

from strata.launch.async_engine import AsyncEngine
from strata.launch.server.completions import chat_prompt_ids
from strata.launch.server.models import served_adapter
from strata.launch.server.protocol import (
    APIError,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from strata.launch.server.tool_calls import tool_plan

MAX_REPORTED_IDS = 5


class Tokenization:
    """Answers ``/tokenize`` and ``/detokenize`` for the served model. A text prompt is encoded
    as ``/v1/completions`` encodes it (with ``add_special_tokens`` left true), a conversation
    as ``/v1/chat/completions`` does (with the defaults), tools included."""

    def __init__(self, engine: AsyncEngine, model_name: str, tool_call_parser: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tool_call_parser = tool_call_parser

    def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        self._check_model(body.model)
        tokenizer = self.engine.tokenizer
        if isinstance(body, TokenizeCompletionRequest):
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            if body.add_generation_prompt and body.continue_final_message:
                raise APIError(
                    400, "continue_final_message needs add_generation_prompt to be false",
                    param="continue_final_message",
                )
            tokens = chat_prompt_ids(
                tokenizer, body, tool_plan(body, self.tool_call_parser),
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                add_special_tokens=body.add_special_tokens,
            )
        return TokenizeResponse(
            count=len(tokens),
            max_model_len=self.engine.max_model_len,
            tokens=tokens,
            token_strs=tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None,
        )

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(body.model)
        vocab_size = len(self.engine.tokenizer)
        unknown = [token for token in body.tokens if token >= vocab_size]
        if unknown:
            listed = ", ".join(map(str, unknown[:MAX_REPORTED_IDS]))
            if len(unknown) > MAX_REPORTED_IDS:
                listed += ", ..."
            raise APIError(400, f"token ids outside the vocabulary (0 to {vocab_size - 1}): {listed}", param="tokens")
        return DetokenizeResponse(prompt=self.engine.tokenizer.decode(body.tokens))

    def _check_model(self, model: str | None) -> None:
        if model is not None:
            served_adapter(self.engine, self.model_name, model)  # adapters share the base's tokenizer
