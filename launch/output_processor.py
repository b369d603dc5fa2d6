"""Turns the EngineCore's per-step token columns into text, per completion.

Fans a prompt with ``n`` completions out into ``n`` engine requests, detokenizes each one's
tokens incrementally, applies stop strings (asking the engine to abort a request whose text
hit one) and keeps the cumulative ``RequestOutput`` of every prompt.
"""

import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
from transformers import PreTrainedTokenizerBase

from strata.engine_core.protocol import EngineCoreOutputs, EngineCoreRequest, LoRAAdapter
from strata.engine_core.sampling_params import SamplingParams
from strata.launch.detokenizer import IncrementalDetokenizer
from strata.launch.outputs import CompletionOutput, RequestMetrics, RequestOutput
from strata.launch.tokenizer import generation_eos_token_ids


@dataclass
class CompletionDelta:
    """What one completion gained in one step (for streaming)."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    error: str | None = None
    engine_fault: bool = False  # the error is the engine's (a replica or worker died), not the request's


@dataclass
class _Completion:
    output: RequestOutput
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer
    want_logprobs: bool


class OutputProcessor:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        eos_token_id: int | None,
        extra_eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        """``tokenizer=None``: outputs carry token ids and no text, and stop strings are refused.
        ``extra_eos_token_ids`` (the generation config's other EOS ids) become stop token ids of
        every request that does not ignore EOS."""
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.extra_eos_token_ids = extra_eos_token_ids
        self._completions: dict[str, _Completion] = {}
        self.outputs: dict[str, RequestOutput] = {}

    @classmethod
    def for_model(cls, tokenizer: PreTrainedTokenizerBase | None, model_path: Path) -> "OutputProcessor":
        """The processor for the model in ``model_path``, with its tokenizer's and generation config's EOS ids."""
        eos_token_id = None if tokenizer is None else tokenizer.eos_token_id
        return cls(tokenizer, eos_token_id, generation_eos_token_ids(model_path, eos_token_id))

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        lora: LoRAAdapter | None = None,
        stream: bool = True,
    ) -> list[EngineCoreRequest]:
        """Register a prompt and return the engine requests for its ``n`` completions.
        ``cache_salt``: requests share prefix-cache blocks only with requests of the same salt.
        ``lora``: the adapter its completions run with (None: the base model). ``stream``:
        False when only the finished completions are wanted, which lets the EngineCore hold
        their tokens until then (unless stop strings need the text as it grows)."""
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a string or None, got {type(cache_salt).__name__}")
        if cache_salt == "":
            raise ValueError("cache_salt must not be empty (None means no salt)")
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{index}" for index in range(params.n)]
        if request_id in self.outputs or any(child in self._completions for child in child_ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer (the engine runs with skip_tokenizer)")
        now = time.time()
        output = RequestOutput(
            request_id, prompt, prompt_token_ids, [CompletionOutput(i) for i in range(params.n)], RequestMetrics(now),
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
        )
        self.outputs[request_id] = output
        if self.extra_eos_token_ids and not params.ignore_eos:
            stop_token_ids = list(dict.fromkeys([*(params.stop_token_ids or []), *self.extra_eos_token_ids]))
            params = msgspec.structs.replace(params, stop_token_ids=stop_token_ids)
        requests = []
        for index, (child_id, completion) in enumerate(zip(child_ids, output.outputs)):
            child_params = params
            if params.n > 1:
                # Wrapped into int64: the workers keep seeds in int64 arrays.
                seed = None if params.seed is None else (params.seed + index + 2**63) % 2**64 - 2**63
                # The prompt is the same for every completion: the first scores it.
                prompt_logprobs = params.prompt_logprobs if index == 0 else None
                child_params = msgspec.structs.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)
            completion.logprobs = [] if params.logprobs is not None else None
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.stop or [], params.include_stop_str_in_output,
                params.skip_special_tokens,
            )
            self._completions[child_id] = _Completion(output, completion, detokenizer, params.logprobs is not None)
            requests.append(
                EngineCoreRequest(
                    child_id, prompt_token_ids, child_params, self.eos_token_id, now, priority, cache_salt, lora,
                    stream=stream or bool(params.stop),
                )
            )
        return requests

    def child_ids(self, request_id: str) -> list[str]:
        """The engine request ids of a prompt's unfinished completions."""
        return [child for child, state in self._completions.items() if state.output.request_id == request_id]

    def forget(self, request_id: str) -> None:
        """Drop a prompt's unfinished completions (its consumer is gone)."""
        for child in self.child_ids(request_id):
            del self._completions[child]

    def pop_finished(self, request_id: str) -> RequestOutput:
        return self.outputs.pop(request_id)

    def process(self, outputs: EngineCoreOutputs) -> tuple[list[CompletionDelta], list[str]]:
        """Apply one step. Returns the deltas and the engine requests to abort (stop strings)."""
        now = time.time()
        # Tokens held in the EngineCore come with their finish record, stamped there.
        held_times = {
            finished.request_id: (finished.first_token_time, finished.last_token_time)
            for finished in outputs.finished
            if finished.first_token_time is not None
        }
        deltas: dict[str, CompletionDelta] = {}
        to_abort: list[str] = []
        for request_id, prompt_logprobs in outputs.prompt_logprobs.items():
            state = self._completions.get(request_id)
            if state is not None and state.output.prompt_logprobs is not None:
                state.output.prompt_logprobs.extend(prompt_logprobs.entries())
        for request_id, token in zip(outputs.request_ids, outputs.new_token_ids):
            state = self._completions.get(request_id)
            if state is None:
                continue  # stopped by a stop string; the engine has not heard of it yet
            completion = state.completion
            completion.token_ids.append(token)
            metrics = state.output.metrics
            first, last = held_times.get(request_id, (now, now))
            # The earliest first token and the latest last one over the prompt's completions.
            metrics.first_token_time = min(metrics.first_token_time or first, first)
            metrics.last_token_time = max(metrics.last_token_time or last, last)
            metrics.num_generated_tokens += 1
            text = state.detokenizer.append(token)
            completion.text += text
            entries = outputs.logprobs.get(request_id) if state.want_logprobs else None
            delta = deltas.get(request_id)
            if delta is None:  # its first token this step (verified drafts bring several)
                delta = deltas[request_id] = CompletionDelta(
                    state.output.request_id, completion.index, "", [], None if entries is None else [], None
                )
            if entries is not None and delta.logprobs is not None:
                entry = entries[len(delta.token_ids)]  # one per token of this request this step, in order
                logprob = dict(zip(entry.token_ids, entry.logprobs))
                completion.logprobs.append(logprob)
                delta.logprobs.append(logprob)
            delta.text += text
            delta.token_ids.append(token)
            if state.detokenizer.stop_reason is not None:
                self._finish(request_id, delta, "stop", state.detokenizer.stop_reason)
                to_abort.append(request_id)
        for finished in outputs.finished:
            if finished.request_id not in self._completions:
                continue
            state = self._completions[finished.request_id]
            delta = deltas.get(finished.request_id) or CompletionDelta(
                state.output.request_id, state.completion.index, "", [], None, None
            )
            deltas[finished.request_id] = delta
            self._finish(finished.request_id, delta, finished.finish_reason, finished.stop_token_id, finished.message)
            delta.engine_fault = finished.engine_fault
        return list(deltas.values()), to_abort

    def _finish(
        self, request_id: str, delta: CompletionDelta, reason: str, stop_reason: str | int | None,
        error: str | None = None,
    ) -> None:
        state = self._completions.pop(request_id)
        tail = state.detokenizer.flush()
        completion = state.completion
        completion.text += tail
        completion.finish_reason, completion.stop_reason, completion.error = reason, stop_reason, error
        delta.text += tail
        delta.finish_reason, delta.stop_reason, delta.error = reason, stop_reason, error
