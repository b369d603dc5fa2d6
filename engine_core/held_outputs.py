"""Outputs held in the EngineCore for requests that do not stream.

A frontend that returns only whole completions (the offline ``LLM``, a server request without
``stream``) has nothing to do with a token before its request ends. Sending every step's token
anyway wakes the frontend once a step to decode a message and detokenize; on a machine whose
cores all run the model, that wake-up preempts the workers' threads, which wait for each other
at every barrier (a single stream under ``--executor mp`` on 2 cores lost 9-10% to it). Such a
request's tokens, logprobs and prompt logprobs are kept here and go out together with its
finish record, stamped with when the EngineCore took its first and last tokens.
"""

import time
from dataclasses import dataclass, field

from strata.engine_core.protocol import EngineCoreOutputs, PromptLogprobs, TokenLogprobs


@dataclass
class _Held:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None


class HeldOutputs:
    """The outputs of the requests that do not stream, until each finishes."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def hold(self, request_id: str) -> None:
        # A request id already held (a duplicate the EngineCore will refuse) keeps its outputs.
        self._held.setdefault(request_id, _Held())

    def filter(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        """``outputs`` without the held requests' results, except those of the requests it
        finishes: everything held for them, in order, with their finish records."""
        if not self._held:
            return outputs
        now = time.time()
        request_ids: list[str] = []
        new_token_ids: list[int] = []
        for request_id, token in zip(outputs.request_ids, outputs.new_token_ids):
            held = self._held.get(request_id)
            if held is None:
                request_ids.append(request_id)
                new_token_ids.append(token)
                continue
            held.token_ids.append(token)
            held.first_token_time = held.first_token_time or now
            held.last_token_time = now
        for request_id in [r for r in outputs.logprobs if r in self._held]:
            self._held[request_id].logprobs.extend(outputs.logprobs.pop(request_id))
        for request_id in [r for r in outputs.prompt_logprobs if r in self._held]:
            self._held[request_id].prompt_logprobs.append(outputs.prompt_logprobs.pop(request_id))
        for finished in outputs.finished:
            held = self._held.pop(finished.request_id, None)
            if held is None:
                continue
            request_ids.extend([finished.request_id] * len(held.token_ids))
            new_token_ids.extend(held.token_ids)
            if held.logprobs:
                outputs.logprobs[finished.request_id] = held.logprobs
            if held.prompt_logprobs:
                outputs.prompt_logprobs[finished.request_id] = _joined(held.prompt_logprobs)
            finished.first_token_time, finished.last_token_time = held.first_token_time, held.last_token_time
        outputs.request_ids, outputs.new_token_ids = request_ids, new_token_ids
        return outputs


def _joined(chunks: list[PromptLogprobs]) -> PromptLogprobs:
    """One request's prompt logprobs from the chunks its prefill steps computed, in order."""
    first = chunks[0]
    return PromptLogprobs(
        first.first_position,
        first.width,
        b"".join(chunk.token_ids for chunk in chunks),
        b"".join(chunk.logprobs for chunk in chunks),
    )
