"""OpenAI completions and chat completions over the ``AsyncEngine``.

One path serves both endpoints, streaming or not: a request becomes a ``Job`` (prompt token
ids and ``SamplingParams``), and the engine's deltas become SSE chunks as they arrive, or one
response at the end. ``Completions`` and ``ChatCompletions`` supply only what differs: how the
prompt is read and how text and logprobs are rendered.
"""

import asyncio
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

import jinja2
from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from strata.engine_core.sampling_params import SamplingParams
from strata.launch.async_engine import AsyncEngine
from strata.launch.engine.core_client import EngineDeadError
from strata.launch.server.metrics import ServerMetrics
from strata.launch.server.protocol import (
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    GenerationRequest,
    TopLogprob,
    Usage,
)
from strata.launch.output_processor import CompletionDelta
from strata.launch.outputs import CompletionOutput, RequestOutput
from strata.launch.prompts import encode_chat

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Request fields passed to SamplingParams under the same name when given.
SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "ignore_eos",
)
_DONE = b"data: [DONE]\n\n"

RequestT = TypeVar("RequestT", bound=GenerationRequest)
T = TypeVar("T")


@dataclass
class Job:
    """An OpenAI request translated for the engine."""

    request_id: str
    created: int
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool


class OpenAIEndpoint(ABC, Generic[RequestT]):
    """Serves one OpenAI generation endpoint; subclasses read prompts and render outputs."""

    id_prefix: str
    prompt_param: str  # the request field named in errors about the prompt

    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics

    async def handle(self, body: RequestT, request: Request) -> Response:
        """Answer ``body``: one JSON response, or an SSE stream of chunks ending ``[DONE]``."""
        job = await self.engine.off_loop(self._job, body)
        run = _EngineRun(self.engine, self.metrics, job)
        if not job.stream:
            try:
                output = await _unless_disconnected(request, run.collect())
            finally:
                await run.close()
            return json_response(self.response(job, output))
        try:
            await _unless_disconnected(request, run.start())
        except BaseException:
            await run.close()
            raise
        return _EventStream(self._events(job, run))

    # ---- what subclasses supply ----

    @abstractmethod
    def prompt_token_ids(self, body: RequestT) -> list[int]: ...

    @abstractmethod
    def max_tokens(self, body: RequestT, room: int) -> int:
        """The request's max_tokens; ``room`` is what max_model_len leaves after the prompt."""

    @abstractmethod
    def num_logprobs(self, body: RequestT) -> int | None:
        """SamplingParams.logprobs: None for none, else how many top alternatives."""

    def opening_chunks(self, job: Job) -> Iterable[BaseModel]:
        return ()

    @abstractmethod
    def chunk(self, job: Job, delta: CompletionDelta, completion: CompletionOutput) -> BaseModel | None:
        """The stream chunk for one delta (``completion`` is its choice so far), or None if it
        carries nothing to send."""

    @abstractmethod
    def usage_chunk(self, job: Job, usage: Usage) -> BaseModel: ...

    @abstractmethod
    def response(self, job: Job, output: RequestOutput) -> BaseModel: ...

    # ---- shared ----

    def envelope(self, job: Job) -> dict:
        """The fields every response and chunk starts with."""
        return {"id": job.request_id, "created": job.created, "model": self.model_name}

    def token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def _job(self, body: RequestT) -> Job:
        if body.model != self.model_name:
            raise APIError.model_not_found(body.model)
        prompt = self.prompt_token_ids(body)
        if not prompt:
            raise APIError(400, "the prompt is empty", param=self.prompt_param)
        max_model_len = self.engine.max_model_len
        room = max_model_len - len(prompt)
        if room < 1:
            raise APIError(
                400, f"the prompt has {len(prompt)} tokens, which leaves no room to generate within "
                f"max_model_len ({max_model_len})", param=self.prompt_param,
            )
        max_tokens = self.max_tokens(body, room)
        if max_tokens > room:
            raise APIError(
                400, f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceed max_model_len "
                f"({max_model_len})", param="max_tokens",
            )
        stream = bool(body.stream)
        return Job(
            request_id=f"{self.id_prefix}-{uuid.uuid4().hex}",
            created=int(time.time()),
            prompt_token_ids=prompt,
            params=self._sampling_params(body, max_tokens),
            stream=stream,
            include_usage=stream and body.stream_options is not None and bool(body.stream_options.include_usage),
        )

    def _sampling_params(self, body: RequestT, max_tokens: int) -> SamplingParams:
        given = {name: value for name in SAMPLING_FIELDS if (value := getattr(body, name)) is not None}
        # top-k over at least the whole vocabulary is no top-k (and the sampler's topk would fail).
        if given.get("top_k", -1) >= len(self.engine.tokenizer):
            given["top_k"] = -1
        try:
            return SamplingParams(**given, max_tokens=max_tokens, logprobs=self.num_logprobs(body))
        except ValueError as error:
            # SamplingParams' messages start with the field's name.
            field = str(error).split(" ", 1)[0]
            param = field if field in SamplingParams.__struct_fields__ else None
            raise APIError(400, str(error), param=param) from None

    async def _events(self, job: Job, run: "_EngineRun") -> AsyncGenerator[bytes, None]:
        try:
            for chunk in self.opening_chunks(job):
                yield _sse(chunk)
            async for delta in run.deltas():
                chunk = self.chunk(job, delta, run.completion(delta.index))
                if chunk is not None:
                    yield _sse(chunk)
            if job.include_usage:
                yield _sse(self.usage_chunk(job, run.usage()))
        except APIError as error:  # headers are sent: the error goes in the stream, as OpenAI does
            yield _sse(error.body)
        finally:
            await run.close()
        yield _DONE


class Completions(OpenAIEndpoint[CompletionRequest]):
    id_prefix = "cmpl"
    prompt_param = "prompt"

    def prompt_token_ids(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) > 1:
                raise APIError(400, "batches of prompts are not supported: send one request per prompt", param="prompt")
            prompt = prompt[0]
        return self.engine.tokenize(prompt) if isinstance(prompt, str) else list(prompt)

    def max_tokens(self, body: CompletionRequest, room: int) -> int:
        return DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens

    def num_logprobs(self, body: CompletionRequest) -> int | None:
        return body.logprobs

    def chunk(self, job: Job, delta: CompletionDelta, completion: CompletionOutput) -> CompletionResponse | None:
        if not (delta.text or delta.logprobs or delta.finish_reason):
            return None
        logprobs = None
        if delta.logprobs is not None:
            logprobs = self._logprobs(delta.logprobs, text_offset=len(completion.text) - len(delta.text))
        choice = CompletionChoice(
            index=delta.index, text=delta.text, logprobs=logprobs, finish_reason=delta.finish_reason
        )
        return CompletionResponse(**self.envelope(job), choices=[choice])

    def usage_chunk(self, job: Job, usage: Usage) -> CompletionResponse:
        return CompletionResponse(**self.envelope(job), choices=[], usage=usage)

    def response(self, job: Job, output: RequestOutput) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=completion.index,
                text=completion.text,
                logprobs=None if completion.logprobs is None else self._logprobs(completion.logprobs, text_offset=0),
                finish_reason=completion.finish_reason,
            )
            for completion in output.outputs
        ]
        return CompletionResponse(**self.envelope(job), choices=choices, usage=_usage(job, output))

    def _logprobs(self, entries: list[dict[int, float]], text_offset: int) -> CompletionLogprobs:
        """OpenAI's legacy shape: per token its text, logprob, start offset in the completion's
        text, and a {text: logprob} map of the top alternatives (plus the sampled token)."""
        logprobs = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for entry in entries:
            sampled, logprob = next(iter(entry.items()))  # the sampled token comes first
            token = self.token_text(sampled)
            logprobs.tokens.append(token)
            logprobs.token_logprobs.append(logprob)
            logprobs.top_logprobs.append({self.token_text(t): value for t, value in entry.items()})
            logprobs.text_offset.append(text_offset)
            text_offset += len(token)
        return logprobs


class ChatCompletions(OpenAIEndpoint[ChatCompletionRequest]):
    id_prefix = "chatcmpl"
    prompt_param = "messages"

    def prompt_token_ids(self, body: ChatCompletionRequest) -> list[int]:
        try:
            return encode_chat(self.engine.tokenizer, [_template_message(message) for message in body.messages])
        except jinja2.TemplateError as error:  # e.g. a template that demands alternating roles
            raise APIError(400, f"the chat template rejected the messages: {error}", param="messages") from None

    def max_tokens(self, body: ChatCompletionRequest, room: int) -> int:
        for value in (body.max_completion_tokens, body.max_tokens):
            if value is not None:
                return value
        return room

    def num_logprobs(self, body: ChatCompletionRequest) -> int | None:
        if body.logprobs:
            return body.top_logprobs or 0
        if body.top_logprobs is not None:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        return None

    def opening_chunks(self, job: Job) -> Iterable[ChatCompletionChunk]:
        # OpenAI opens each choice with the role; content follows in later chunks.
        for index in range(job.params.n):
            choice = ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))
            yield ChatCompletionChunk(**self.envelope(job), choices=[choice])

    def chunk(self, job: Job, delta: CompletionDelta, completion: CompletionOutput) -> ChatCompletionChunk | None:
        if not (delta.text or delta.logprobs or delta.finish_reason):
            return None
        choice = ChatChunkChoice(
            index=delta.index,
            delta=ChatDelta(content=delta.text or None),
            logprobs=None if delta.logprobs is None else self._logprobs(delta.logprobs, job.params.logprobs),
            finish_reason=delta.finish_reason,
        )
        return ChatCompletionChunk(**self.envelope(job), choices=[choice])

    def usage_chunk(self, job: Job, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.envelope(job), choices=[], usage=usage)

    def response(self, job: Job, output: RequestOutput) -> ChatCompletionResponse:
        top = job.params.logprobs
        choices = [
            ChatChoice(
                index=completion.index,
                message=AssistantMessage(content=completion.text),
                logprobs=None if completion.logprobs is None else self._logprobs(completion.logprobs, top),
                finish_reason=completion.finish_reason,
            )
            for completion in output.outputs
        ]
        return ChatCompletionResponse(**self.envelope(job), choices=choices, usage=_usage(job, output))

    def _logprobs(self, entries: list[dict[int, float]], top: int) -> ChatLogprobs:
        content = []
        for entry in entries:
            sampled, logprob = next(iter(entry.items()))  # the sampled token comes first
            best = sorted(entry.items(), key=lambda item: item[1], reverse=True)[:top]
            content.append(
                ChatTokenLogprob(
                    **self._top_logprob(sampled, logprob).model_dump(),
                    top_logprobs=[self._top_logprob(token, value) for token, value in best],
                )
            )
        return ChatLogprobs(content=content)

    def _top_logprob(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.token_text(token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))


def _template_message(message: ChatMessage) -> dict[str, str]:
    content = message.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    # "developer" is OpenAI's new name for "system"; chat templates know only the latter.
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": content or ""}


class _EngineRun:
    """One job in the engine: its deltas, with failures turned into ``APIError``, and its
    cumulative output, which the metrics observe when the run is closed."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, job: Job) -> None:
        self._engine = engine
        self._metrics = metrics
        self._job = job
        self._deltas = engine.generate(job.prompt_token_ids, job.params, job.request_id)
        self._first: CompletionDelta | None = None
        self._output: RequestOutput | None = None

    async def start(self) -> None:
        """Wait for the first delta. A stream does this before it answers, so that what the
        engine rejects at once (and a dead engine) still gets an HTTP error status."""
        self._first = await self._next()

    async def deltas(self) -> AsyncIterator[CompletionDelta]:
        if self._first is not None:
            yield self._first
        while (delta := await self._next()) is not None:
            yield delta

    async def collect(self) -> RequestOutput:
        async for _ in self.deltas():
            pass
        assert self._output is not None  # a request yields at least its finishing delta
        return self._output

    def completion(self, index: int) -> CompletionOutput:
        assert self._output is not None
        return self._output.outputs[index]

    def usage(self) -> Usage:
        assert self._output is not None
        return _usage(self._job, self._output)

    async def close(self) -> None:
        await self._deltas.aclose()  # aborts the request in the engine if it is still running
        if self._output is not None:
            self._metrics.observe(self._output)

    async def _next(self) -> CompletionDelta | None:
        try:
            delta = await anext(self._deltas, None)
        except EngineDeadError as error:
            raise APIError.unavailable(str(error)) from None
        if delta is None:
            return None
        # The engine drops a request's output once its stream ends: keep a reference.
        self._output = self._output or self._engine.output_of(self._job.request_id)
        if delta.error is not None:
            raise await self._engine_error(delta.error)
        return delta

    async def _engine_error(self, message: str) -> APIError:
        """The engine failed the request: the request's fault (400) if the engine is still
        alive, else the engine's (503). A dying worker fails its requests just before the
        engine reports its own death, so ask the engine rather than trust the order."""
        try:
            await self._engine.check_health()
        except (RuntimeError, TimeoutError):  # EngineDeadError is a RuntimeError
            return APIError.unavailable(message)
        return APIError(400, message)


class _EventStream(StreamingResponse):
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


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
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


def _usage(job: Job, output: RequestOutput) -> Usage:
    completion_tokens = sum(len(completion.token_ids) for completion in output.outputs)
    prompt_tokens = len(job.prompt_token_ids)
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


def _sse(model: BaseModel) -> bytes:
    return b"data: " + model.model_dump_json().encode() + b"\n\n"


def json_response(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")
