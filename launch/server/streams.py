"""One OpenAI request's streams: the engine's, merged into one stream of choices, and the
client's, server-sent events.

A ``Job`` is the request translated for the engine: one engine request per prompt, each with
``n`` choices. ``EngineRun`` runs it and merges the engine requests' deltas into one stream,
renumbered as the job's choices (choice ``p * n + i`` is prompt ``p``'s ``i``-th). ``answer``
serves a run as one JSON response or as an ``EventStream`` of the events an endpoint
(``launch/server/completions.py``, ``launch/server/responses.py``) renders from its deltas,
each framed by ``sse``; a ``ChoiceParser`` reads a chat choice's text into reasoning, content
and tool calls. ``unless_disconnected`` stops waiting on the engine when the client leaves.
"""

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from strata.engine_core.protocol import LoRAAdapter
from strata.engine_core.sampling_params import SamplingParams
from strata.launch.async_engine import AsyncEngine
from strata.launch.output_processor import CompletionDelta
from strata.launch.outputs import CompletionOutput, RequestOutput
from strata.launch.server.metrics import ServerMetrics
from strata.launch.server.protocol import APIError, Usage
from strata.launch.server.reasoning_parsers import ReasoningDelta, ReasoningFormat, ReasoningParser
from strata.launch.server.tool_calls import ToolPlan
from strata.launch.server.tool_parsers import CallDelta, ParsedDelta, ToolCallParser
from strata.runtime.core_client import EngineDeadError

DONE = b"data: [DONE]\n\n"  # the last event of every stream, as OpenAI sends it

T = TypeVar("T")


@dataclass
class Job:
    """An OpenAI request translated for the engine: one engine request per prompt, whose
    choices are numbered prompt-major (choice ``p * n + i`` is prompt ``p``'s ``i``-th)."""

    request_id: str
    created: int
    model: str  # as the request named it: the base model's name or an adapter's
    prompts: list[list[int]]  # token ids; several only for /v1/completions with a list
    params: SamplingParams
    stream: bool
    include_usage: bool
    cache_salt: str | None = None
    lora: LoRAAdapter | None = None  # the adapter ``model`` names; None: the base model
    priority: int = 0
    echo: list[str] | None = None  # each prompt's text, to put before its choices' text
    tools: ToolPlan | None = None
    reasoning: ReasoningFormat | None = None
    parsers: dict[int, "ChoiceParser"] = field(default_factory=dict)  # per streamed choice

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n

    def new_parser(self) -> "ChoiceParser":
        """A parser for one choice's whole output."""
        return ChoiceParser(
            None if self.reasoning is None else self.reasoning.parser(),
            None if self.tools is None else self.tools.parser(),
            only_first_call=self.tools is not None and not self.tools.parallel,
        )

    def parser(self, index: int) -> "ChoiceParser":
        """The parser of streamed choice ``index``, which keeps its state between deltas."""
        if index not in self.parsers:
            self.parsers[index] = self.new_parser()
        return self.parsers[index]

    def usage(self, choices: list[CompletionOutput]) -> Usage:
        """Token counts of the prompts and of ``choices``."""
        completion_tokens = sum(len(completion.token_ids) for completion in choices)
        prompt_tokens = sum(len(prompt) for prompt in self.prompts)
        return Usage(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
        )


@dataclass
class ParsedChoice(ParsedDelta):
    """What part of a chat choice's text is reasoning, content and tool calls."""

    reasoning: str = ""

    def extend(self, other: ParsedDelta) -> None:
        super().extend(other)
        if isinstance(other, ParsedChoice):
            self.reasoning += other.reasoning


class ChoiceParser:
    """One chat choice's text read as it streams: the reasoning split off first (by the
    ``--reasoning-parser``), then tool calls read out of the rest (by the request's tool
    parser); without either, the text is all content. ``only_first_call``: later calls are
    dropped (``parallel_tool_calls: false``; for ``required`` the grammar allows one anyway)."""

    def __init__(
        self, reasoning: ReasoningParser | None, tools: ToolCallParser | None, only_first_call: bool = False
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.only_first_call = only_first_call

    @property
    def calls_started(self) -> int:
        return 0 if self.tools is None else self.tools.calls_started

    @property
    def reasoning_chars(self) -> int:
        """How much of the text so far, tags included, is reasoning."""
        return 0 if self.reasoning is None else self.reasoning.reasoning_chars

    def feed(self, text: str) -> ParsedChoice:
        """What ``text``, the choice's next delta, adds."""
        return self._read_calls(ReasoningDelta(content=text) if self.reasoning is None else self.reasoning.feed(text))

    def finish(self) -> ParsedChoice:
        """What is left once the choice has ended."""
        parsed = self._read_calls(ReasoningDelta() if self.reasoning is None else self.reasoning.finish())
        if self.tools is not None:
            rest = self.tools.finish()
            parsed.extend(ParsedDelta(rest.content, self._allowed(rest.tool_calls)))
        return parsed

    def whole(self, text: str) -> ParsedChoice:
        """A whole output, read at once (the parser must be fresh)."""
        parsed = self.feed(text)
        parsed.extend(self.finish())
        return parsed

    def _read_calls(self, split: ReasoningDelta) -> ParsedChoice:
        if self.tools is None or not split.content:
            return ParsedChoice(content=split.content, reasoning=split.reasoning)
        calls = self.tools.feed(split.content)
        allowed = self._allowed(calls.tool_calls)
        return ParsedChoice(content=calls.content, tool_calls=allowed, reasoning=split.reasoning)

    def _allowed(self, calls: list[CallDelta]) -> list[CallDelta]:
        return [call for call in calls if call.index == 0] if self.only_first_call else calls


class EngineRun:
    """One job in the engine, one engine request per prompt: their deltas merged, renumbered
    as choices, with failures turned into ``APIError``; their cumulative outputs, which the
    metrics observe when the run is closed."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, job: Job) -> None:
        self._engine = engine
        self._metrics = metrics
        self._job = job
        several = len(job.prompts) > 1
        self._request_ids = [f"{job.request_id}-{p}" if several else job.request_id for p in range(len(job.prompts))]
        self._outputs: list[RequestOutput | None] = [None] * len(job.prompts)
        self._arrivals: asyncio.Queue[tuple[int, CompletionDelta | Exception | None]] = asyncio.Queue()
        self._pumps = [asyncio.ensure_future(self._pump(p)) for p in range(len(job.prompts))]
        self._streaming = len(job.prompts)
        self._first: CompletionDelta | None = None

    async def start(self) -> None:
        """Wait for the first delta. A stream does this before it answers, so that what the
        engine rejects at once (and a dead engine) still gets an HTTP error status."""
        self._first = await self._next()

    async def deltas(self) -> AsyncGenerator[CompletionDelta, None]:
        """The deltas, with ``index`` the choice's."""
        if self._first is not None:
            yield self._first
        while (delta := await self._next()) is not None:
            yield delta

    async def collect(self) -> list[CompletionOutput]:
        async for _ in self.deltas():
            pass
        return [self.completion(index) for index in range(self._job.num_choices)]

    def completion(self, index: int) -> CompletionOutput:
        return self._output(index).outputs[index % self._job.params.n]

    def prompt_logprobs(self, index: int) -> list[dict[int, float] | None] | None:
        """The logprobs of choice ``index``'s prompt (complete once the choice has a delta)."""
        return self._output(index).prompt_logprobs

    def _output(self, index: int) -> RequestOutput:
        output = self._outputs[index // self._job.params.n]
        assert output is not None  # a request yields at least its finishing delta
        return output

    def usage(self) -> Usage:
        return self._job.usage([self.completion(index) for index in range(self._job.num_choices)])

    async def close(self) -> None:
        for pump in self._pumps:
            pump.cancel()  # closes its engine stream, which aborts the request if still running
        # Observed before the first await: a request whose client left is closed from a task
        # being cancelled, where any await may be the last (an unfinished choice counts as abort).
        for output in self._outputs:
            if output is not None:
                self._metrics.observe(output)
        await asyncio.gather(*self._pumps, return_exceptions=True)

    async def _pump(self, prompt_index: int) -> None:
        job, request_id = self._job, self._request_ids[prompt_index]
        deltas = self._engine.generate(
            job.prompts[prompt_index], job.params, request_id, priority=job.priority, cache_salt=job.cache_salt,
            lora=job.lora, stream=job.stream,
        )
        try:
            async for delta in deltas:
                # The engine drops a request's output once its stream ends: keep a reference.
                self._outputs[prompt_index] = self._outputs[prompt_index] or self._engine.output_of(request_id)
                self._arrivals.put_nowait((prompt_index, delta))
        except Exception as error:  # handed to the reader, which raises it
            self._arrivals.put_nowait((prompt_index, error))
        else:
            self._arrivals.put_nowait((prompt_index, None))
        finally:
            await deltas.aclose()

    async def _next(self) -> CompletionDelta | None:
        while self._streaming:
            prompt_index, item = await self._arrivals.get()
            if item is None:
                self._streaming -= 1
                continue
            if isinstance(item, EngineDeadError):
                raise APIError.unavailable(str(item))
            if isinstance(item, Exception):
                raise item
            if item.error is not None:
                # A dead worker or data-parallel replica is the server's failure; only what the
                # engine refused or cut short for the request itself is the client's.
                raise APIError.engine_failed(item.error) if item.engine_fault else APIError(400, item.error)
            return dataclasses.replace(item, index=prompt_index * self._job.params.n + item.index)
        return None


async def answer(
    request: Request,
    job: Job,
    run: EngineRun,
    whole: Callable[[], BaseModel],
    events: Callable[[], AsyncGenerator[bytes, None]],
) -> Response:
    """Serve ``run``: for a streamed ``job`` the ``events`` (once the engine has taken the
    request, so that what it refuses at once still gets an HTTP error status), else one JSON
    body, ``whole()`` once every choice is in. The run is closed however the request ends."""
    if not job.stream:
        try:
            await unless_disconnected(request, run.collect())
        finally:
            await run.close()
        return json_response(whole())
    try:
        await unless_disconnected(request, run.start())
    except BaseException:
        await run.close()
        raise
    return EventStream(events())


def json_response(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


class EventStream(StreamingResponse):
    """An SSE response that closes its events however the response ends, so that a client
    that goes away aborts its request in the engine at once, not when the iterator happens
    to be garbage-collected."""

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


# JSON strings may hold U+0085, U+2028 and U+2029 unescaped, but line readers that split as
# str.splitlines does (httpx's iter_lines among them) end a line at each: a generated text
# holding one would cut its event in two. Escaped, every event's data stays one line.
_RAW_LINE_BREAKS = tuple((char.encode(), f"\\u{ord(char):04x}".encode()) for char in "\u0085\u2028\u2029")


def sse(model: BaseModel, event: str | None = None) -> bytes:
    """One server-sent event whose data is ``model`` as JSON on one line, named ``event`` if
    given."""
    data = model.model_dump_json().encode()
    for raw, escaped in _RAW_LINE_BREAKS:
        data = data.replace(raw, escaped)
    name = b"" if event is None else b"event: " + event.encode() + b"\n"
    return name + b"data: " + data + b"\n\n"


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, but cancel it and raise ``ClientDisconnect`` if the client goes first."""
    work_task = asyncio.ensure_future(work)
    disconnect = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait((work_task, disconnect), return_when=asyncio.FIRST_COMPLETED)
    finally:
        work_task.cancel()
        disconnect.cancel()
        # Both must be over before the caller closes the run the work was iterating.
        await asyncio.wait((work_task, disconnect))
    if work_task in done:
        return work_task.result()
    raise ClientDisconnect()


async def _disconnected(request: Request) -> None:
    # The body has been read: the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
