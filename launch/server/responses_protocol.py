"""The wire format of ``POST /v1/responses`` (OpenAI's Responses API): the request, the
response object, its output items and the typed stream events.

Requests are parsed as strictly as chat's (``protocol.py``): unknown fields are a 400 naming
them. Items a client sends back as it received them (assistant messages, function calls,
reasoning) carry fields such as ``id``, ``status`` or ``annotations`` that say nothing to the
model: those are ignored, not refused.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from strata.launch.server.protocol import (
    MAX_TOOLS,
    FunctionDefinition,
    NamedFunction,
    PlatformFields,
    SamplingFields,
    StrictModel,
)


class _Echoed(BaseModel):
    """An item as a client got it from an earlier response: fields beyond these are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


# ---- request -----------------------------------------------------------------------------


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str


class OutputTextPart(_Echoed):
    """An assistant message's text, sent back (its ``annotations`` and ``logprobs`` ignored)."""

    type: Literal["output_text"]
    text: str


ContentPart = Annotated[InputText | OutputTextPart, Field(discriminator="type")]


class MessageItem(_Echoed):
    """A message of the conversation; ``type`` may be left out (OpenAI's easy input message)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]


class FunctionCallItem(_Echoed):
    """A call the model made in an earlier turn, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text of an object


class FunctionCallOutputItem(_Echoed):
    """The client's result of the call ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]


class ReasoningInputItem(_Echoed):
    """Reasoning of an earlier turn; not shown to the model, as chat templates drop it too."""

    type: Literal["reasoning"]


def _item_type(item: Any) -> str | None:
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningInputItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(FunctionDefinition):
    """A function the model may call, in the Responses API's flat shape: chat's definition
    with the tool's ``type`` beside it."""

    type: Literal["function"]


class FunctionToolChoice(NamedFunction):
    """``tool_choice`` naming the one function the model must call."""

    type: Literal["function"]


class TextFormat(StrictModel):
    """``text.format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(max_length=64)] | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(StrictModel):
    """OpenAI's reasoning settings: only their absence is supported (see ``responses.py``)."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesStreamOptions(StrictModel):
    include_obfuscation: bool | None = None  # no obfuscation padding is ever added


class ResponsesRequest(SamplingFields, PlatformFields):
    """``POST /v1/responses``. Beyond OpenAI's fields, chat's sampling extensions (``seed``,
    ``top_k``, ``min_p``, penalties, ``logit_bias``, ``priority``, ``cache_salt``)."""

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    # Accepted, and change nothing in the answer.
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Checked by the endpoint, which refuses what it cannot honour.
    include: list[str] | None = None  # extra data: logprobs are refused, the rest is data no item here has
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    background: bool | None = None


# ---- response ----------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: ItemStatus
    call_id: str
    name: str
    arguments: str


class OutputReasoning(BaseModel):
    """Reasoning the ``--reasoning-parser`` split off: its text in ``content``; no summary is
    written, so ``summary`` is empty."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    status: ItemStatus
    summary: list = Field(default_factory=list)
    content: list[ReasoningText]


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # the engine does not report its prefix-cache hits per request
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """A response: whole, or (in stream events) as it stands."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem]
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: None = None
    temperature: float | None
    top_p: float | None
    text: dict  # the request's, as it gave it
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice
    tools: list[FunctionTool]
    truncation: Literal["disabled"] = "disabled"
    store: bool = False  # nothing is stored, whatever the request said
    user: str | None
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    usage: ResponseUsage | None = None


# ---- stream events -----------------------------------------------------------------------


class StreamEvent(BaseModel):
    """One event of a streamed response; ``sequence_number`` counts the stream's events."""

    type: str
    sequence_number: int


class ResponseEvent(StreamEvent):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete"]
    response: ResponseObject


class ItemEvent(StreamEvent):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ItemUpdateEvent(StreamEvent):
    """An event about the output item at ``output_index``."""

    item_id: str
    output_index: int


class ContentUpdateEvent(ItemUpdateEvent):
    """An event about one content part of an item (each item here has one)."""

    content_index: int = 0


class PartEvent(ContentUpdateEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    part: OutputText | ReasoningText


class TextDeltaEvent(ContentUpdateEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str
    logprobs: list = Field(default_factory=list)


class TextDoneEvent(ContentUpdateEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    text: str
    logprobs: list = Field(default_factory=list)


class ReasoningDeltaEvent(ContentUpdateEvent):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    delta: str


class ReasoningDoneEvent(ContentUpdateEvent):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    text: str


class ArgumentsDeltaEvent(ItemUpdateEvent):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    delta: str


class ArgumentsDoneEvent(ItemUpdateEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    name: str
    arguments: str


class ErrorEvent(StreamEvent):
    """A failure after the stream began (the status line was already sent)."""

    type: Literal["error"] = "error"
    code: str | None
    message: str
    param: str | None
