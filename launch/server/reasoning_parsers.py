"""Reasoning split out of a model's text as it streams: the ``--reasoning-parser`` formats.

Reasoning models write their thinking between ``<think>`` and ``</think>`` before the answer.
A parser is fed one choice's text delta by delta and answers what of it is reasoning and what
is content (the answer, which the tool-call parsers then read); a tag split across deltas is
held back until it is whole. The formats:

- ``qwen3``: reasoning only when the output opens with ``<think>`` (after optional
  whitespace); otherwise the whole output is content.
- ``deepseek_r1``: the output starts inside the reasoning, since the chat template opens
  ``<think>`` in the prompt; a ``<think>`` the model writes itself is dropped. Without a
  ``</think>`` the whole output is reasoning.

The whitespace between ``</think>`` and the answer is dropped. A structured-output constraint
(``response_format``, ``guided_*``, a forced tool call) applies to the answer only:
``constrain`` gives the engine the reasoning block's markers, so its grammar leaves the
reasoning free and starts after ``</think>``.
"""

from dataclasses import dataclass

import msgspec
from transformers import PreTrainedTokenizerBase

from strata.engine_core.sampling_params import StructuredOutputsParams
from strata.launch.server.tool_parsers import partial_suffix

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_WHITESPACE = " \t\r\n"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Splits one choice's text into reasoning and content, incrementally.
    ``starts_inside``: the output begins in the reasoning block (``deepseek_r1``)."""

    def __init__(self, starts_inside: bool) -> None:
        self._starts_inside = starts_inside
        self._state = "opening"  # then "reasoning", "separating" (after </think>) or "content"
        self._buffer = ""
        self._fed = 0  # characters of the output fed so far
        self.reasoning_chars = 0  # how much of the output (tags included) is reasoning

    def feed(self, text: str) -> ReasoningDelta:
        """What ``text``, the choice's next delta, adds."""
        self._buffer += text
        self._fed += len(text)
        delta = ReasoningDelta()
        if self._state == "opening":
            head = self._buffer.lstrip(_WHITESPACE)
            if head.startswith(THINK_OPEN):
                self._buffer = head[len(THINK_OPEN) :]
                self._state = "reasoning"
            elif THINK_OPEN.startswith(head):  # the tag may still be coming
                return delta
            else:
                self._state = "reasoning" if self._starts_inside else "content"
        if self._state == "reasoning":
            end = self._buffer.find(THINK_CLOSE)
            if end < 0:
                keep = partial_suffix(self._buffer, THINK_CLOSE)
                delta.reasoning = self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep :]
                self.reasoning_chars = self._fed - keep
                return delta
            delta.reasoning = self._buffer[:end]
            self._buffer = self._buffer[end + len(THINK_CLOSE) :]
            self.reasoning_chars = self._fed - len(self._buffer)
            self._state = "separating"
        if self._state == "separating":
            self._buffer = self._buffer.lstrip(_WHITESPACE)
            if not self._buffer:
                return delta
            self._state = "content"
        delta.content, self._buffer = self._buffer, ""
        return delta

    def finish(self) -> ReasoningDelta:
        """What is left once the choice has ended (text held back in case it began a tag)."""
        rest, self._buffer = self._buffer, ""
        in_reasoning = self._state == "reasoning" or (self._state == "opening" and self._starts_inside)
        if in_reasoning:
            self.reasoning_chars = self._fed
            return ReasoningDelta(reasoning=rest)
        return ReasoningDelta(content=rest)


@dataclass(frozen=True)
class ReasoningFormat:
    """A ``--reasoning-parser``: how its models mark reasoning."""

    name: str

    def parser(self) -> ReasoningParser:
        return ReasoningParser(starts_inside=self.name == "deepseek_r1")

    def constrain(self, constraint: StructuredOutputsParams) -> StructuredOutputsParams:
        """``constraint`` applied to the answer after the reasoning, not to the whole output."""
        start = None if self.name == "deepseek_r1" else THINK_OPEN
        return msgspec.structs.replace(constraint, reasoning_start=start, reasoning_end=THINK_CLOSE)


def reasoning_format(name: str | None) -> ReasoningFormat | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}")
    return ReasoningFormat(name)


def tokens_covering(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], chars: int) -> int:
    """How many of ``token_ids`` it takes to write the first ``chars`` characters of their text
    (the fewest whose decoded text is at least that long): the reasoning's token count."""
    if chars <= 0:
        return 0
    low, high = 1, len(token_ids)
    while low < high:
        middle = (low + high) // 2
        if len(tokenizer.decode(token_ids[:middle])) >= chars:
            high = middle
        else:
            low = middle + 1
    return high
