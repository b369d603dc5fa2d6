"""The OpenAI completions and chat completions endpoints over the ``AsyncEngine``.

One path serves both endpoints, streaming or not: a request becomes a ``Job`` (the token ids
of its prompts, one engine request each, and ``SamplingParams``), and the engine's deltas,
merged and numbered as choices (``launch/server/streams.py``), become SSE chunks as they
arrive, or one response at the end. ``Completions`` and ``ChatCompletions`` supply only what
differs: how prompts are read (chat: with its tools, ``launch/server/tool_calls.py``) and how
text, logprobs and tool calls (``launch/server/tool_parsers.py``) are rendered.
"""

import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Iterable
from typing import Generic, TypeVar

import jinja2
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from transformers import PreTrainedTokenizerBase

from strata.engine_core.sampling_params import SamplingParams, StructuredOutputsParams
from strata.launch.async_engine import AsyncEngine
from strata.launch.server.metrics import ServerMetrics
from strata.launch.server.models import served_adapter
from strata.launch.server.reasoning_parsers import reasoning_format
from strata.launch.server.streams import DONE, ChoiceParser, EngineRun, Job, answer, sse
from strata.launch.server.structured import logit_bias_of, structured_outputs_of
from strata.launch.server.tool_calls import ToolPlan, template_messages, tool_plan
from strata.launch.server.tool_parsers import collect
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
    ChatPrompt,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    FunctionCall,
    FunctionCallDelta,
    GenerationRequest,
    PromptLogprobsList,
    PromptTokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from strata.launch.output_processor import CompletionDelta
from strata.launch.prompts import encode_chat

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Request fields passed to SamplingParams under the same name when given.
SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "ignore_eos",
)

RequestT = TypeVar("RequestT", bound=GenerationRequest)


class OpenAIEndpoint(ABC, Generic[RequestT]):
    """Serves one OpenAI generation endpoint; subclasses read prompts and render outputs."""

    id_prefix: str
    prompt_param: str  # the request field named in errors about the prompt

    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics

    async def handle(self, body: RequestT, request: Request, tenant_salt: str | None = None) -> Response:
        """Answer ``body``: one JSON response, or an SSE stream of chunks ending ``[DONE]``.
        ``tenant_salt`` (per-API-key isolation) goes before the body's own ``cache_salt``."""
        job = await self.engine.off_loop(self._job, body, tenant_salt)
        run = EngineRun(self.engine, self.metrics, job)
        return await answer(request, job, run, lambda: self.response(job, run), lambda: self._events(job, run))

    # ---- what subclasses supply ----

    @abstractmethod
    def _job(self, body: RequestT, tenant_salt: str | None) -> Job:
        """The request for the engine (built with ``_new_job``), or an ``APIError``."""

    @abstractmethod
    def max_tokens(self, body: RequestT, room: int) -> int:
        """The request's max_tokens; ``room`` is what max_model_len leaves after the prompt."""

    @abstractmethod
    def num_logprobs(self, body: RequestT) -> int | None:
        """SamplingParams.logprobs: None for none, else how many top alternatives."""

    def num_prompt_logprobs(self, body: RequestT) -> int | None:
        """SamplingParams.prompt_logprobs: vLLM's ``prompt_logprobs`` field."""
        return body.prompt_logprobs

    def opening_chunks(self, job: Job) -> Iterable[BaseModel]:
        return ()

    @abstractmethod
    def chunk(self, job: Job, delta: CompletionDelta, run: EngineRun) -> BaseModel | None:
        """The stream chunk for one delta (``run.completion(delta.index)`` is its choice so
        far), or None if it carries nothing to send."""

    @abstractmethod
    def usage_chunk(self, job: Job, usage: Usage) -> BaseModel: ...

    @abstractmethod
    def response(self, job: Job, run: EngineRun) -> BaseModel:
        """The whole response, once ``run`` has collected every choice (``run.completion(i)``
        is choice ``i``; its own ``index`` is within its prompt)."""

    # ---- shared ----

    def envelope(self, job: Job) -> dict:
        """The fields every response and chunk starts with."""
        return {"id": job.request_id, "created": job.created, "model": job.model}

    def token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def rendered_prompt_logprobs(self, job: Job, run: EngineRun, index: int) -> PromptLogprobsList | None:
        """Choice ``index``'s prompt logprobs in vLLM's shape, if the request asked for them."""
        entries = run.prompt_logprobs(index)
        if job.params.prompt_logprobs is None or entries is None:
            return None
        return [
            None if entry is None else {
                token: PromptTokenLogprob(logprob=value, decoded_token=self.token_text(token))
                for token, value in entry.items()
            }
            for entry in entries
        ]

    def _new_job(
        self, body: RequestT, tenant_salt: str | None, prompts: list[list[int]],
        constraint: StructuredOutputsParams | None, tools: ToolPlan | None = None,
    ) -> Job:
        lora = served_adapter(self.engine, self.model_name, body.model)
        if not all(prompts):
            raise APIError(400, "the prompt is empty", param=self.prompt_param)
        longest = max(len(prompt) for prompt in prompts)
        max_model_len = self.engine.max_model_len
        room = max_model_len - longest
        max_tokens = self.max_tokens(body, room)
        if room < 1 and not (room == 0 and max_tokens == 0):  # max_tokens 0: the prompt alone
            raise APIError(
                400, f"the prompt has {longest} tokens, which leaves no room to generate within "
                f"max_model_len ({max_model_len})", param=self.prompt_param,
            )
        if max_tokens > room:
            raise APIError(
                400, f"the prompt ({longest} tokens) plus max_tokens ({max_tokens}) exceed max_model_len "
                f"({max_model_len})", param="max_tokens",
            )
        stream = bool(body.stream)
        if stream and body.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs are not available when streaming", param="prompt_logprobs")
        return Job(
            request_id=f"{self.id_prefix}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=body.model,
            prompts=prompts,
            params=self._sampling_params(body, max_tokens, constraint),
            stream=stream,
            include_usage=stream and body.stream_options is not None and bool(body.stream_options.include_usage),
            cache_salt=_cache_salt(tenant_salt, body.cache_salt),
            lora=lora,
            priority=body.priority or 0,
            tools=tools,
        )

    def _sampling_params(
        self, body: RequestT, max_tokens: int, constraint: StructuredOutputsParams | None
    ) -> SamplingParams:
        given = {name: value for name in SAMPLING_FIELDS if (value := getattr(body, name)) is not None}
        # top-k over at least the whole vocabulary is no top-k (and the sampler's topk would fail).
        if given.get("top_k", -1) >= len(self.engine.tokenizer):
            given["top_k"] = -1
        try:
            return SamplingParams(
                **given,
                max_tokens=max_tokens,
                logprobs=self.num_logprobs(body),
                prompt_logprobs=self.num_prompt_logprobs(body),
                structured_outputs=constraint,
                logit_bias=logit_bias_of(body),
            )
        except ValueError as error:
            # SamplingParams' messages start with the field's name.
            field = str(error).split(" ", 1)[0]
            param = field if field in SamplingParams.__struct_fields__ else None
            raise APIError(400, str(error), param=param) from None

    async def _events(self, job: Job, run: EngineRun) -> AsyncGenerator[bytes, None]:
        try:
            for chunk in self.opening_chunks(job):
                yield sse(chunk)
            async for delta in run.deltas():
                chunk = self.chunk(job, delta, run)
                if chunk is not None:
                    yield sse(chunk)
            if job.include_usage:
                yield sse(self.usage_chunk(job, run.usage()))
        except APIError as error:  # headers are sent: the error goes in the stream, as OpenAI does
            yield sse(error.body)
        finally:
            await run.close()
        yield DONE


class Completions(OpenAIEndpoint[CompletionRequest]):
    id_prefix = "cmpl"
    prompt_param = "prompt"

    def _job(self, body: CompletionRequest, tenant_salt: str | None) -> Job:
        given = _prompts(body.prompt)
        if not given:
            raise APIError(400, "the prompt list is empty", param="prompt")
        prompts = [self.engine.tokenize(prompt) if isinstance(prompt, str) else list(prompt) for prompt in given]
        job = self._new_job(body, tenant_salt, prompts, structured_outputs_of(body))
        if body.echo:
            job.echo = [
                prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(prompt) for prompt in given
            ]
        return job

    def max_tokens(self, body: CompletionRequest, room: int) -> int:
        for value in (body.max_completion_tokens, body.max_tokens):
            if value is not None:
                return value
        return DEFAULT_COMPLETION_MAX_TOKENS

    def num_logprobs(self, body: CompletionRequest) -> int | None:
        return body.logprobs

    def num_prompt_logprobs(self, body: CompletionRequest) -> int | None:
        # Echo with logprobs scores the echoed prompt too.
        wanted = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
        return max(wanted, default=None)

    def chunk(self, job: Job, delta: CompletionDelta, run: EngineRun) -> CompletionResponse | None:
        completion = run.completion(delta.index)
        # Echo puts the prompt in the choice's first chunk, with its logprobs, which the
        # engine has computed by then.
        first = len(completion.token_ids) == len(delta.token_ids)
        echoed = job.echo[delta.index // job.params.n] if job.echo is not None else ""
        echo_now = first and echoed
        if not (echo_now or delta.text or delta.logprobs or delta.finish_reason):
            return None
        logprobs = None
        if job.params.logprobs is not None:
            token_ids, entries = delta.token_ids, delta.logprobs or []
            if echo_now:
                token_ids, entries = self._with_prompt(job, run, delta.index, token_ids, entries)
            offset = 0 if echo_now else len(echoed) + len(completion.text) - len(delta.text)
            logprobs = self._logprobs(token_ids, entries, offset, job.params.logprobs)
        choice = CompletionChoice(
            index=delta.index, text=(echoed if echo_now else "") + delta.text, logprobs=logprobs,
            finish_reason=delta.finish_reason,
        )
        return CompletionResponse(**self.envelope(job), choices=[choice])

    def usage_chunk(self, job: Job, usage: Usage) -> CompletionResponse:
        return CompletionResponse(**self.envelope(job), choices=[], usage=usage)

    def response(self, job: Job, run: EngineRun) -> CompletionResponse:
        rendered = []
        choices = [run.completion(index) for index in range(job.num_choices)]
        for index, completion in enumerate(choices):
            echoed = "" if job.echo is None else job.echo[index // job.params.n]
            logprobs = None
            if completion.logprobs is not None:
                token_ids, entries = completion.token_ids, completion.logprobs
                if job.echo is not None:
                    token_ids, entries = self._with_prompt(job, run, index, token_ids, entries)
                logprobs = self._logprobs(token_ids, entries, 0, job.params.logprobs)
            rendered.append(
                CompletionChoice(
                    index=index,
                    text=echoed + completion.text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    prompt_logprobs=self.rendered_prompt_logprobs(job, run, index),
                )
            )
        return CompletionResponse(**self.envelope(job), choices=rendered, usage=job.usage(choices))

    @staticmethod
    def _with_prompt(
        job: Job, run: EngineRun, index: int, token_ids: list[int], entries: list[dict[int, float]]
    ) -> tuple[list[int], list[dict[int, float] | None]]:
        """The choice's tokens and logprob entries with its prompt's before them (echo)."""
        prompt_entries = run.prompt_logprobs(index)
        assert prompt_entries is not None, "echo with logprobs asks the engine for prompt logprobs"
        return job.prompts[index // job.params.n] + token_ids, prompt_entries + entries

    def _logprobs(
        self, token_ids: list[int], entries: list[dict[int, float] | None], text_offset: int, top: int
    ) -> CompletionLogprobs:
        """OpenAI's legacy shape: per token its text, logprob (None for the prompt's first),
        start offset in the choice's text, and a {text: logprob} map of the token and the
        ``top`` most likely."""
        logprobs = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for token_id, entry in zip(token_ids, entries):
            token = self.token_text(token_id)
            logprobs.tokens.append(token)
            logprobs.text_offset.append(text_offset)
            text_offset += len(token)
            if entry is None:
                logprobs.token_logprobs.append(None)
                logprobs.top_logprobs.append(None)
                continue
            logprobs.token_logprobs.append(entry[token_id])
            best = sorted(entry.items(), key=lambda item: item[1], reverse=True)[:top]
            logprobs.top_logprobs.append({self.token_text(t): value for t, value in [(token_id, entry[token_id]), *best]})
        return logprobs


class ChatCompletions(OpenAIEndpoint[ChatCompletionRequest]):
    """Chat completions, with the reasoning split off by ``reasoning_parser``
    (``launch/server/reasoning_parsers.py``) when one is set, and tool calls read out of the
    rest by ``tool_call_parser`` (``launch/server/tool_parsers.py``) when the request's tools
    allow them."""

    id_prefix = "chatcmpl"
    prompt_param = "messages"

    def __init__(
        self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics, tool_call_parser: str,
        reasoning_parser: str | None = None,
    ) -> None:
        super().__init__(engine, model_name, metrics)
        self.tool_call_parser = tool_call_parser
        self.reasoning = reasoning_format(reasoning_parser)

    def _job(self, body: ChatCompletionRequest, tenant_salt: str | None) -> Job:
        tools = tool_plan(body, self.tool_call_parser)
        prompt = chat_prompt_ids(self.engine.tokenizer, body, tools)
        constraint, tool_constraint = structured_outputs_of(body), tools.constraint()
        if constraint is not None and tool_constraint is not None:
            raise APIError(
                400, f"tool_choice {body.tool_choice if isinstance(body.tool_choice, str) else 'naming a function'} "
                "already constrains the output: drop response_format and guided_*", param="tool_choice",
            )
        constraint = constraint or tool_constraint
        if constraint is not None and self.reasoning is not None:
            constraint = self.reasoning.constrain(constraint)
        job = self._new_job(body, tenant_salt, [prompt], constraint, tools)
        job.reasoning = self.reasoning
        return job

    def job(self, body: ChatCompletionRequest, tenant_salt: str | None) -> Job:
        """The engine job of ``body``, as ``handle`` runs it: for endpoints built on chat."""
        return self._job(body, tenant_salt)

    def max_tokens(self, body: ChatCompletionRequest, room: int) -> int:
        for value in (body.max_completion_tokens, body.max_tokens):
            if value is not None:
                return value
        return max(room, 1)  # a full context leaves no room, rather than asking for nothing

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

    def chunk(self, job: Job, delta: CompletionDelta, run: EngineRun) -> ChatCompletionChunk | None:
        parser = job.parser(delta.index)
        parsed = parser.feed(delta.text)
        if delta.finish_reason is not None:
            parsed.extend(parser.finish())
        calls = parsed.tool_calls
        if not (parsed.reasoning or parsed.content or calls or delta.logprobs or delta.finish_reason):
            return None
        choice = ChatChunkChoice(
            index=delta.index,
            delta=ChatDelta(
                reasoning_content=parsed.reasoning or None,
                content=parsed.content or None,
                tool_calls=[
                    ToolCallDelta(
                        index=call.index, id=call.id, type=None if call.id is None else "function",
                        function=FunctionCallDelta(name=call.name, arguments=call.arguments),
                    )
                    for call in calls
                ] or None,
            ),
            logprobs=None if delta.logprobs is None else self._logprobs(delta.logprobs, job.params.logprobs),
            finish_reason=_finish_reason(delta.finish_reason, parser),
        )
        return ChatCompletionChunk(**self.envelope(job), choices=[choice])

    def usage_chunk(self, job: Job, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.envelope(job), choices=[], usage=usage)

    def response(self, job: Job, run: EngineRun) -> ChatCompletionResponse:
        top = job.params.logprobs
        rendered = []
        choices = [run.completion(index) for index in range(job.num_choices)]
        for completion in choices:
            parser = job.new_parser()
            parsed = parser.whole(completion.text)
            content, calls = collect(parsed)
            message = AssistantMessage(
                content=content if content.strip() or not (calls or parsed.reasoning) else None,
                reasoning_content=parsed.reasoning or None,
                tool_calls=[
                    ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
                    for call in calls
                ] or None,
            )
            rendered.append(
                ChatChoice(
                    index=completion.index,
                    message=message,
                    logprobs=None if completion.logprobs is None else self._logprobs(completion.logprobs, top),
                    finish_reason=_finish_reason(completion.finish_reason, parser),
                )
            )
        return ChatCompletionResponse(
            **self.envelope(job), choices=rendered, usage=job.usage(choices),
            prompt_logprobs=self.rendered_prompt_logprobs(job, run, 0),
        )

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


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    body: ChatPrompt,
    tools: ToolPlan,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
) -> list[int]:
    """The token ids the chat template makes of ``body``'s messages and ``tools`` (by default
    what a chat completion prompts the model with); a 400 if the template rejects them."""
    messages, tool_definitions = template_messages(body.messages, tools, tokenizer)
    try:
        return encode_chat(
            tokenizer, messages, tool_definitions, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, add_special_tokens=add_special_tokens,
        )
    # e.g. a template that demands alternating roles, or a final message it cannot leave open
    except (jinja2.TemplateError, ValueError) as error:
        raise APIError(400, f"the chat template rejected the messages: {error}", param="messages") from None


def _prompts(prompt: str | list) -> list[str | list[int]]:
    """The request's prompts: one text or token-id list, or a list of them."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def _finish_reason(reason: str | None, parser: ChoiceParser) -> str | None:
    if reason == "stop" and parser.calls_started:
        return "tool_calls"
    return reason


def _cache_salt(tenant_salt: str | None, request_salt: str | None) -> str | None:
    if tenant_salt is None:
        return request_salt
    # The tenant part has a fixed form and length, so no request salt can forge another's.
    return tenant_salt if request_salt is None else f"{tenant_salt}/{request_salt}"
