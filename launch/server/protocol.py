"""The OpenAI wire format the server speaks: request and response bodies, and the error body.

Field names and types follow OpenAI's API. Requests are parsed strictly (no coercion of
``"5"`` to ``5``, unknown fields rejected, no NaN or infinity), so a malformed body is a 400
that names the field instead of a guess. ``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens`` and ``ignore_eos`` are extensions (as in vLLM). Ranges are checked by
``SamplingParams``; the bounds here are those OpenAI documents or the wire format needs.
"""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 128  # OpenAI's limit on completions per request
MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
MAX_CACHE_SALT_CHARS = 256
MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_TOOLS = 128  # OpenAI's limit on tools per request
MAX_PROMPTS = 128  # prompts in one /v1/completions request
MAX_METADATA = 16  # OpenAI's limit on metadata pairs

# Token ids travel as int32 to the engine; the engine checks them against the vocabulary.
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]


class StrictModel(BaseModel):
    """A request body or part: unknown fields, coercion, NaN and infinity are refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(StrictModel):
    """``include_usage``: end the stream with a chunk that carries only the usage."""

    include_usage: bool | None = None


class JsonSchemaFormat(StrictModel):
    name: Annotated[str, Field(max_length=64)]
    schema_: dict | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(StrictModel):
    """The sampling fields every generation endpoint takes, chat's and the Responses API's
    alike: OpenAI's and the extensions."""

    temperature: float | None = None
    top_p: float | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # Extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    # Requests share prefix-cache blocks only with requests of the same salt (as in vLLM).
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
    priority: Int64 | None = None  # lower runs first, with --scheduling-policy priority
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None


class GenerationRequest(SamplingFields):
    """The fields completions and chat completions share."""

    model: str
    n: Annotated[int, Field(le=MAX_N)] | None = None
    max_tokens: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_completion_tokens: int | None = None
    response_format: ResponseFormat | None = None
    # vLLM-style constraints (one per request, response_format included).
    guided_json: dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: the logprob of every prompt token after the first, with this many alternatives.
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``. A prompt is text or token ids, or a list of such prompts
    (each gets ``n`` choices). ``echo`` puts the prompt's text before each choice's."""

    prompt: str | list[TokenId] | Annotated[list[str], Field(max_length=MAX_PROMPTS)] | Annotated[
        list[list[TokenId]], Field(max_length=MAX_PROMPTS)
    ]
    logprobs: Annotated[int, Field(le=MAX_LOGPROBS)] | None = None
    echo: bool | None = None


class TextPart(StrictModel):
    """One part of a message's content given as a list (only text is supported)."""

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text of an object

    model_config = ConfigDict(strict=True)


class ToolCall(BaseModel):
    """A call the assistant made, in a response or in the history a client sends back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    model_config = ConfigDict(strict=True)


class ChatMessage(BaseModel):
    """One message of the conversation. Extra fields are ignored, not rejected: clients
    append the assistant messages they received, which carry fields such as ``refusal``.
    ``tool_calls`` belong to assistant messages, ``tool_call_id`` to tool messages."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    model_config = ConfigDict(strict=True)


class FunctionDefinition(StrictModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    """``tool_choice`` naming the one function the model must call."""

    type: Literal["function"]
    function: NamedFunction


class ChatPrompt(StrictModel):
    """The fields that decide a chat request's prompt: its messages and the tools it shows."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class PlatformFields(StrictModel):
    """OpenAI platform bookkeeping, accepted and ignored: it changes nothing in the answer.
    Nothing is stored (``store``), tagged (``metadata``) or tiered (``service_tier``)."""

    store: bool | None = None
    metadata: Annotated[dict[str, str], Field(max_length=MAX_METADATA)] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None


class ChatCompletionRequest(ChatPrompt, GenerationRequest, PlatformFields):
    """``POST /v1/chat/completions``."""

    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(le=MAX_LOGPROBS)] | None = None


class TokenizeCompletionRequest(StrictModel):
    """``POST /tokenize`` of a text prompt (vLLM's shape); ``model`` may be left out."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatPrompt):
    """``POST /tokenize`` of a conversation, as ``/v1/chat/completions`` would prompt the model
    with it (vLLM's shape)."""

    model: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
    """``POST /detokenize`` (vLLM's shape)."""

    model: str | None = None
    tokens: list[TokenId]


# ---- responses ---------------------------------------------------------------------------


class Usage(BaseModel):
    """Token counts of a request: the prompt's once, the completions' summed over choices."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token (with ``echo``, the
    prompt's first, whose first token has no logprob: ``None``)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptTokenLogprob(BaseModel):
    """One token's entry in vLLM's ``prompt_logprobs``."""

    logprob: float
    decoded_token: str


# vLLM's shape: per prompt token, {token id: entry} for it and its top alternatives; None first.
PromptLogprobsList = list[dict[int, PromptTokenLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobsList | None = None


class CompletionResponse(BaseModel):
    """A completion, or (streaming) one chunk of it: OpenAI uses the same object for both."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    """A token, its logprob and its UTF-8 bytes (chat completions)."""

    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    """``reasoning_content``: the reasoning a ``--reasoning-parser`` split off (as in vLLM)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    """A whole chat completion; streams send ``ChatCompletionChunk`` instead."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobsList | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str = ""


class ToolCallDelta(BaseModel):
    """A call's first chunk carries its id, type and name; later ones, arguments text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One chunk of a streamed chat completion: each choice carries a ``ChatDelta``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """``GET /v1/models/{id}``; ``max_model_len`` is an extension (as in vLLM), and so are,
    for a LoRA adapter, ``root`` (its directory) and ``parent`` (the base model's name)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "strata"
    max_model_len: int
    root: str | None = None
    parent: str | None = None


class LoadLoRAAdapterRequest(StrictModel):
    """``POST /v1/load_lora_adapter`` (vLLM's): serve the PEFT directory ``lora_path`` as ``lora_name``."""

    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]


class UnloadLoRAAdapterRequest(StrictModel):
    """``POST /v1/unload_lora_adapter``: stop serving ``lora_name``."""

    lora_name: Annotated[str, Field(min_length=1)]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    """``token_strs``: each token's own string, when the request asks for them."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- errors ------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body, for every error the server answers."""

    error: ErrorInfo


class APIError(Exception):
    """An error answered with an HTTP status and an OpenAI error body."""

    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))

    @classmethod
    def model_not_found(cls, model: str) -> "APIError":
        return cls(404, f"the model {model!r} does not exist", param="model", code="model_not_found")

    @classmethod
    def unavailable(cls, reason: str) -> "APIError":
        return cls(503, f"the engine is not available: {reason}", "server_error", code="engine_unavailable")

    @classmethod
    def engine_failed(cls, reason: str) -> "APIError":
        """A request lost to a failure in the engine (its worker or data-parallel replica died);
        the server may serve on with the rest, so this is not ``unavailable``."""
        return cls(503, reason, "server_error", code="engine_failed")
