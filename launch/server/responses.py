"""``POST /v1/responses``, OpenAI's Responses API, served over the chat path.

A request is translated into the chat completion it amounts to (``chat_request_of``): the
instructions and input items become messages (function calls an assistant's ``tool_calls``,
their outputs ``tool`` messages), the flat tools chat's, ``text.format`` a
``response_format``. ``ChatCompletions`` then builds the engine job exactly as for chat:
template, tools and their grammar, reasoning, sampling, limits. What differs is the answer:
the choice's text, read by the job's ``ChoiceParser`` into reasoning, content and tool calls,
becomes output items (``reasoning``, ``message``, ``function_call``), whole or as the typed
events of a stream (``OutputItems``).

Nothing is stored: ``store`` is accepted and the response says ``store: false``;
``previous_response_id`` is a 400 (send the whole conversation as ``input``, as the Agents SDK
and LangChain do). Fields that would change the answer but cannot be honoured are 400s
naming them.
"""

import itertools
import uuid
from collections.abc import AsyncGenerator, Iterator
from typing import TypeVar

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from strata.launch.outputs import CompletionOutput
from strata.launch.server.completions import ChatCompletions
from strata.launch.server.protocol import APIError, ChatCompletionRequest, SamplingFields
from strata.launch.server.reasoning_parsers import tokens_covering
from strata.launch.server.responses_protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ErrorEvent,
    FunctionCallItem,
    FunctionCallOutputItem,
    IncompleteDetails,
    InputText,
    ItemEvent,
    MessageItem,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTextPart,
    OutputTokensDetails,
    PartEvent,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningText,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
    TextFormat,
    StreamEvent,
)
from strata.launch.server.streams import ChoiceParser, EngineRun, Job, ParsedChoice, answer, sse
from strata.launch.server.tool_parsers import CallDelta

# Request fields chat takes under the same name and meaning.
CHAT_FIELDS = ("model", "stream", "parallel_tool_calls", *SamplingFields.model_fields)
# Chat's names for the fields its errors name, and what the Responses API calls them.
RESPONSES_PARAM = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}
_WHITESPACE = " \t\r\n"
EventT = TypeVar("EventT", bound=StreamEvent)


class Responses:
    """Serves ``POST /v1/responses`` with ``chat``'s engine, model and parsers."""

    def __init__(self, chat: ChatCompletions) -> None:
        self.chat = chat

    async def handle(self, body: ResponsesRequest, request: Request, tenant_salt: str | None = None) -> Response:
        """Answer ``body``: one response object, or a stream of typed events."""
        job = await self.chat.engine.off_loop(self._job, body, tenant_salt)
        run = EngineRun(self.chat.engine, self.chat.metrics, job)
        return await answer(
            request, job, run, lambda: self._whole(body, job, run.completion(0)), lambda: self._events(body, job, run)
        )

    def _job(self, body: ResponsesRequest, tenant_salt: str | None) -> Job:
        try:
            job = self.chat.job(chat_request_of(body), tenant_salt)
        except APIError as error:
            info = error.body.error
            info.param = RESPONSES_PARAM.get(info.param or "", info.param)
            raise
        job.request_id = f"resp_{uuid.uuid4().hex}"
        return job

    def _whole(self, body: ResponsesRequest, job: Job, completion: CompletionOutput) -> ResponseObject:
        parser = job.new_parser()
        items = OutputItems(itertools.count())
        items.add(parser.whole(completion.text))
        items.close(_item_status(completion))
        return self._finished(body, job, items, completion, parser)

    async def _events(self, body: ResponsesRequest, job: Job, run: EngineRun) -> AsyncGenerator[bytes, None]:
        sequence = itertools.count()
        items = OutputItems(sequence)
        parser = job.parser(0)
        try:
            for kind in ("response.created", "response.in_progress"):
                started = self._response(body, job, [], "in_progress")
                yield _frame(ResponseEvent(type=kind, sequence_number=next(sequence), response=started))
            async for delta in run.deltas():
                parsed = parser.feed(delta.text)
                if delta.finish_reason is not None:
                    parsed.extend(parser.finish())
                for event in items.add(parsed):
                    yield _frame(event)
            completion = run.completion(0)
            for event in items.close(_item_status(completion)):
                yield _frame(event)
            finished = self._finished(body, job, items, completion, parser)
            kind = f"response.{finished.status}"
            yield _frame(ResponseEvent(type=kind, sequence_number=next(sequence), response=finished))
        except APIError as error:  # headers are sent: the error goes in the stream
            info = error.body.error
            failure = ErrorEvent(sequence_number=next(sequence), code=info.code, message=info.message, param=info.param)
            yield _frame(failure)
        finally:
            await run.close()

    def _finished(
        self, body: ResponsesRequest, job: Job, items: "OutputItems", completion: CompletionOutput,
        parser: ChoiceParser,
    ) -> ResponseObject:
        incomplete = completion.finish_reason == "length"
        reasoning_tokens = tokens_covering(self.chat.engine.tokenizer, completion.token_ids, parser.reasoning_chars)
        input_tokens, output_tokens = len(job.prompts[0]), len(completion.token_ids)
        usage = ResponseUsage(
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
            total_tokens=input_tokens + output_tokens,
        )
        response = self._response(body, job, items.output, "incomplete" if incomplete else "completed", usage)
        if incomplete:
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        return response

    def _response(
        self, body: ResponsesRequest, job: Job, output: list[OutputItem], status: str,
        usage: ResponseUsage | None = None,
    ) -> ResponseObject:
        return ResponseObject(
            id=job.request_id,
            created_at=job.created,
            status=status,
            model=job.model,
            output=output,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            metadata=body.metadata or {},
            parallel_tool_calls=body.parallel_tool_calls is not False,
            temperature=body.temperature,
            top_p=body.top_p,
            text=body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {"format": {"type": "text"}},
            tool_choice=body.tool_choice or ("auto" if body.tools else "none"),
            tools=body.tools or [],
            user=body.user,
            usage=usage,
        )


class OutputItems:
    """A response's output items, built as its parsed text arrives, and the stream events that
    tell a client so. One item is open at a time: text of another kind closes it and opens the
    next (reasoning, then a message, then function calls). Whitespace that would open a
    message waits until it is followed by text, so a call written after a newline is not
    preceded by an empty message."""

    def __init__(self, sequence: Iterator[int]) -> None:
        self.output: list[OutputItem] = []
        self._sequence = sequence
        self._open: OutputItem | None = None
        self._held_space = ""
        self._calls: dict[int, OutputFunctionCall] = {}  # by the parser's call index

    def add(self, parsed: ParsedChoice) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if parsed.reasoning:
            events += self._reasoning(parsed.reasoning)
        if parsed.content:
            events += self._content(parsed.content)
        for call in parsed.tool_calls:
            events += self._call(call)
        return events

    def close(self, status: str) -> list[StreamEvent]:
        """The events that end the output; ``status`` is every item's that is still open. An
        output with no item gets one message (with whatever text there was)."""
        events: list[StreamEvent] = []
        if not self.output:
            events += self._open_message()
        return events + self._close_open(status)

    def _reasoning(self, text: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        item = self._open
        if not isinstance(item, OutputReasoning):
            events += self._close_open("completed")
            item = OutputReasoning(id=f"rs_{uuid.uuid4().hex}", status="in_progress", content=[])
            events += self._added(item)
            events.append(self._part("response.content_part.added", item, ReasoningText(text="")))
            item.content.append(ReasoningText(text=""))
        item.content[0].text += text
        index = self._index()
        events.append(self._event(ReasoningDeltaEvent, item_id=item.id, output_index=index, delta=text))
        return events

    def _content(self, text: str) -> list[StreamEvent]:
        if isinstance(self._open, OutputMessage):
            return self._append_text(self._open, text)
        self._held_space += text
        if not self._held_space.strip(_WHITESPACE):
            return []
        return self._open_message()

    def _open_message(self) -> list[StreamEvent]:
        events = self._close_open("completed")
        item = OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="in_progress", content=[])
        events += self._added(item)
        events.append(self._part("response.content_part.added", item, OutputText(text="")))
        item.content.append(OutputText(text=""))
        text, self._held_space = self._held_space, ""
        return events + (self._append_text(item, text) if text else [])

    def _append_text(self, item: OutputMessage, text: str) -> list[StreamEvent]:
        item.content[0].text += text
        return [self._event(TextDeltaEvent, item_id=item.id, output_index=self._index(), delta=text)]

    def _call(self, call: CallDelta) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if call.id is not None:  # a call's header: its own item
            events += self._close_open("completed")
            self._held_space = ""
            item = OutputFunctionCall(
                id=f"fc_{uuid.uuid4().hex}", status="in_progress", call_id=call.id, name=call.name or "",
                arguments="",
            )
            self._calls[call.index] = item
            events += self._added(item)
        if call.arguments:
            item = self._calls[call.index]
            item.arguments += call.arguments
            index = self.output.index(item)
            events.append(self._event(ArgumentsDeltaEvent, item_id=item.id, output_index=index, delta=call.arguments))
        return events

    def _added(self, item: OutputItem) -> list[StreamEvent]:
        self.output.append(item)
        self._open = item
        # A copy: the item goes on filling before the event is sent.
        added = item.model_copy(deep=True)
        return [self._event(ItemEvent, type="response.output_item.added", output_index=self._index(), item=added)]

    def _close_open(self, status: str) -> list[StreamEvent]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        index = self.output.index(item)
        events: list[StreamEvent] = []
        if isinstance(item, OutputReasoning):
            text = item.content[0].text
            events.append(self._event(ReasoningDoneEvent, item_id=item.id, output_index=index, text=text))
            events.append(self._part("response.content_part.done", item, ReasoningText(text=text)))
        elif isinstance(item, OutputMessage):
            text = item.content[0].text
            events.append(self._event(TextDoneEvent, item_id=item.id, output_index=index, text=text))
            events.append(self._part("response.content_part.done", item, OutputText(text=text)))
        else:
            done_fields = {"item_id": item.id, "output_index": index, "name": item.name, "arguments": item.arguments}
            events.append(self._event(ArgumentsDoneEvent, **done_fields))
        done = item.model_copy(deep=True)
        events.append(self._event(ItemEvent, type="response.output_item.done", output_index=index, item=done))
        return events

    def _part(self, kind: str, item: OutputMessage | OutputReasoning, part: OutputText | ReasoningText) -> PartEvent:
        index = self.output.index(item)
        return self._event(PartEvent, type=kind, item_id=item.id, output_index=index, part=part)

    def _index(self) -> int:
        return len(self.output) - 1

    def _event(self, kind: type[EventT], **fields: object) -> EventT:
        return kind(sequence_number=next(self._sequence), **fields)


def chat_request_of(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion ``body`` amounts to; a 400 naming the field for what cannot be served."""
    _refuse_unsupported(body)
    fields = {name: value for name in CHAT_FIELDS if (value := getattr(body, name)) is not None}
    fields["messages"] = _messages(body)
    if body.max_output_tokens is not None:
        fields["max_completion_tokens"] = body.max_output_tokens
    if body.tools is not None:
        fields["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in body.tools
        ]
    if body.tool_choice is not None:
        choice = body.tool_choice
        if not isinstance(choice, str):
            choice = {"type": "function", "function": {"name": choice.name}}
        fields["tool_choice"] = choice
    response_format = _response_format(body.text.format if body.text is not None else None)
    if response_format is not None:
        fields["response_format"] = response_format
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:  # what the Responses shapes let through but chat's do not
        problem = error.errors(include_url=False, include_input=False)[0]
        raise APIError(400, f"input: {problem['msg']}", param="input") from None


def _refuse_unsupported(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise APIError(
            400, "previous_response_id is not supported: this server stores no responses; send the whole "
            "conversation as input", param="previous_response_id",
        )
    if body.truncation == "auto":
        raise APIError(
            400, "truncation 'auto' is not supported: a conversation longer than the context is refused, "
            "never cut", param="truncation",
        )
    if body.top_logprobs:
        raise APIError(
            400, "top_logprobs is not supported by /v1/responses (chat completions have logprobs)", param="top_logprobs"
        )
    if "message.output_text.logprobs" in (body.include or ()):
        raise APIError(
            400, "include 'message.output_text.logprobs' is not supported: no logprobs are computed", param="include"
        )
    if body.max_tool_calls is not None:
        raise APIError(400, "max_tool_calls is not supported", param="max_tool_calls")
    if body.background:
        raise APIError(
            400, "background responses are not supported: nothing is stored to fetch later", param="background"
        )
    if body.reasoning is not None and body.reasoning.model_dump(exclude_none=True):
        raise APIError(
            400, "reasoning effort and summaries are not supported: a model reasons as it was trained to, and "
            "--reasoning-parser returns its reasoning as written", param="reasoning",
        )
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise APIError(400, "text.verbosity other than 'medium' is not supported", param="text")


def _messages(body: ResponsesRequest) -> list[dict]:
    messages: list[dict] = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            if messages and messages[-1]["role"] == "assistant":  # the same turn: one assistant message
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        # Reasoning items are left out: chat templates drop earlier turns' reasoning too.
    if not messages:
        raise APIError(400, "input holds no message", param="input")
    return messages


def _text(content: str | list[InputText | OutputTextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _response_format(text_format: TextFormat | None) -> dict | None:
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return {"type": "json_object"}
    if text_format.name is None or text_format.schema_ is None:
        raise APIError(400, "text.format json_schema needs a name and a schema", param="text")
    json_schema = {"name": text_format.name, "schema": text_format.schema_}
    json_schema |= text_format.model_dump(include={"description", "strict"}, exclude_none=True)
    return {"type": "json_schema", "json_schema": json_schema}


def _item_status(completion: CompletionOutput) -> str:
    return "incomplete" if completion.finish_reason == "length" else "completed"


def _frame(event: StreamEvent) -> bytes:
    """One server-sent event, named by its type as OpenAI names them."""
    return sse(event, event=event.type)
