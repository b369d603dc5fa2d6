"""Tool calls read out of a model's text as it streams: the ``--tool-call-parser`` formats.

A parser is fed the text of one choice delta by delta and answers what of it is content and
what belongs to tool calls: a call's header (its index, id and name) once the name is
complete, then fragments of its ``arguments`` JSON as they arrive, so a stream can forward
them at once. A whole response is the same, fed in one piece: both paths give the same calls.

The formats:
- ``hermes`` (Hermes, Qwen): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number of them, with content around them.
- ``llama3_json`` (Llama 3.x): the whole output is ``{"name": ..., "parameters": {...}}``,
  several separated by ``;``, optionally after ``<|python_tag|>``; an output that does not
  open with ``{`` is content.
- for ``tool_choice`` ``required`` and a named function, what the grammars of
  ``launch/server/tool_calls.py`` force: one call object or a JSON array of them; the named
  function's arguments object.
"""

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_WHITESPACE = " \t\r\n"


@dataclass
class CallDelta:
    """A call's header (``id`` and ``name`` set, ``arguments`` empty) or a fragment of its
    arguments (``id`` and ``name`` None)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[CallDelta] = field(default_factory=list)

    def extend(self, other: "ParsedDelta") -> None:
        self.content += other.content
        self.tool_calls += other.tool_calls


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as the model wrote it


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def collect(deltas: ParsedDelta) -> tuple[str, list[ParsedCall]]:
    """Content and whole calls from the deltas of a whole output."""
    calls: list[ParsedCall] = []
    for delta in deltas.tool_calls:
        if delta.id is not None:
            calls.append(ParsedCall(delta.id, delta.name or "", ""))
        calls[delta.index].arguments += delta.arguments
    return deltas.content, calls


class ToolCallParser(ABC):
    """Splits one choice's text into content and tool calls, incrementally."""

    def __init__(self) -> None:
        self.calls_started = 0

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta:
        """What ``text``, the choice's next delta, adds."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """What is left once the choice has ended (text held back in case it began a call)."""


def parser_named(name: str) -> ToolCallParser:
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {name!r}")


class _CallObject:
    """One ``{"name": ..., <arguments key>: {...}}`` object arriving as text: its header once
    the name is complete, then its arguments' text as it comes."""

    def __init__(self, index: int, argument_keys: tuple[str, ...]) -> None:
        self.index = index
        self.argument_keys = argument_keys
        self.announced = False
        self.sent = 0  # characters of the arguments already sent
        self.complete = False

    def advance(self, text: str) -> tuple[list[CallDelta], int | None]:
        """The deltas the object's text so far allows, and where the object ends in ``text``
        (None while it is open). Raises ValueError if the text cannot be a call object."""
        members, end = _members(text)
        deltas = []
        name = members.get("name")
        if not self.announced and name is not None and name[1] is not None:
            value = json.loads(text[name[0] : name[1]])
            if not isinstance(value, str):
                raise ValueError("a tool call's name is not a string")
            deltas.append(CallDelta(self.index, id=new_call_id(), name=value))
            self.announced = True
        arguments = next((members[key] for key in self.argument_keys if key in members), None)
        if self.announced and arguments is not None:
            start, stop = arguments
            if text[start] != "{":
                raise ValueError("a tool call's arguments are not an object")
            fragment = text[start + self.sent : len(text) if stop is None else stop]
            if fragment:
                deltas.append(CallDelta(self.index, arguments=fragment))
                self.sent += len(fragment)
        if end is not None and not self.complete:
            if not self.announced:
                raise ValueError("a tool call without a name")
            if arguments is None:
                deltas.append(CallDelta(self.index, arguments="{}"))
            self.complete = True
        return deltas, end


class HermesParser(ToolCallParser):
    """``<tool_call>{json}</tool_call>`` blocks among content. A block that is not a call
    object is given back as content, if nothing of it was sent as a call yet."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._call: _CallObject | None = None  # the open block's call

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        parsed = ParsedDelta()
        while True:
            if self._call is None:
                start = self._buffer.find(self.OPEN)
                if start < 0:
                    keep = partial_suffix(self._buffer, self.OPEN)
                    parsed.content += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return parsed
                parsed.content += self._buffer[:start]
                self._buffer = self._buffer[start + len(self.OPEN) :]
                self._call = _CallObject(self.calls_started, ("arguments", "parameters"))
            close = self._buffer.find(self.CLOSE)
            body = self._buffer if close < 0 else self._buffer[:close]
            parsed.extend(self._advance(body, closed=close >= 0))
            if close < 0:
                return parsed
            self._buffer = self._buffer[close + len(self.CLOSE) :]

    def finish(self) -> ParsedDelta:
        if self._call is None:
            rest, self._buffer = self._buffer, ""
            return ParsedDelta(content=rest)
        return self._advance(self._buffer, closed=True)  # cut short: what there is of the block

    def _advance(self, body: str, closed: bool) -> ParsedDelta:
        assert self._call is not None
        call = self._call
        stripped = body.lstrip(_WHITESPACE)
        try:
            deltas, end = call.advance(stripped) if stripped else ([], None)
            if closed and (end is None or stripped[end:].strip(_WHITESPACE)):
                raise ValueError("the block is not one call object")
        except ValueError:
            if not closed:
                return ParsedDelta()  # the close may still come; decide then
            self._call = None
            if call.announced:  # already streamed as a call: what was sent of it stands
                return ParsedDelta()
            return ParsedDelta(content=f"{self.OPEN}{body}{self.CLOSE}")
        if call.announced and call.index == self.calls_started:
            self.calls_started += 1
        if closed:
            self._call = None
        return ParsedDelta(tool_calls=deltas)


class _JsonCallsParser(ToolCallParser):
    """Call objects one after another, with separators from ``separators`` between them."""

    argument_keys: tuple[str, ...]
    separators: str

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._call: _CallObject | None = None

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        parsed = ParsedDelta()
        while True:
            if self._call is None:
                self._buffer = self._buffer.lstrip(self.separators)
                if not self._buffer:
                    return parsed
                if self._buffer[0] != "{":
                    raise ValueError(f"expected a tool call object, got {self._buffer[:16]!r}")
                self._call = _CallObject(self.calls_started, self.argument_keys)
            deltas, end = self._call.advance(self._buffer)
            if self._call.announced and self._call.index == self.calls_started:
                self.calls_started += 1
            parsed.tool_calls += deltas
            if end is None:
                return parsed
            self._buffer = self._buffer[end:]
            self._call = None

    def finish(self) -> ParsedDelta:
        return ParsedDelta()


class RequiredCallsParser(_JsonCallsParser):
    """What ``tool_choice: required`` makes the model write: a call, or an array of them."""

    argument_keys = ("arguments",)
    separators = _WHITESPACE + "[],"


class NamedCallParser(ToolCallParser):
    """What a named ``tool_choice`` makes the model write: the function's arguments object."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def feed(self, text: str) -> ParsedDelta:
        parsed = ParsedDelta()
        if not self.calls_started:
            parsed.tool_calls.append(CallDelta(0, id=new_call_id(), name=self._name))
            self.calls_started = 1
        if text:
            parsed.tool_calls.append(CallDelta(0, arguments=text))
        return parsed

    def finish(self) -> ParsedDelta:
        return ParsedDelta()


class Llama3JsonParser(ToolCallParser):
    """Llama 3's JSON calls. An output that does not open with a call object is all content;
    text after the calls that is not one is dropped (the calls were already sent)."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._calls: _Llama3Calls | None = None
        self._seen = ""  # the output so far, while it may still turn out to be content
        self._state = "undecided"  # then "calls", "content" or "dropping"

    def feed(self, text: str) -> ParsedDelta:
        if self._state == "content":
            return ParsedDelta(content=text)
        if self._state == "dropping":
            return ParsedDelta()
        if self._state == "undecided":
            self._seen += text
            head = self._seen.lstrip(_WHITESPACE)
            if head.startswith(self.PYTHON_TAG):
                head = head[len(self.PYTHON_TAG) :].lstrip(_WHITESPACE)
            elif self.PYTHON_TAG.startswith(head):
                return ParsedDelta()
            if not head:
                return ParsedDelta()
            if head[0] != "{":
                return self._as_content()
            self._calls, self._state, text = _Llama3Calls(), "calls", head
        elif self.calls_started == 0:
            self._seen += text
        assert self._calls is not None
        try:
            parsed = self._calls.feed(text)
        except ValueError:
            if self.calls_started == 0:
                return self._as_content()
            self._state = "dropping"
            return ParsedDelta()
        self.calls_started = self._calls.calls_started
        return parsed

    def finish(self) -> ParsedDelta:
        if self._state == "undecided" or (self._state == "calls" and self.calls_started == 0):
            return self._as_content()
        return ParsedDelta()

    def _as_content(self) -> ParsedDelta:
        self._state = "content"
        seen, self._seen = self._seen, ""
        return ParsedDelta(content=seen)


class _Llama3Calls(_JsonCallsParser):
    argument_keys = ("parameters", "arguments")
    separators = _WHITESPACE + ";"


def partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def _members(text: str) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The members of the JSON object ``text`` opens with, as far as it goes: key -> (value
    start, value end or None while the value is open), and the object's end (None while it
    is open). Raises ValueError at the first character that cannot belong to an object."""
    if not text.startswith("{"):
        raise ValueError("a tool call is not a JSON object")
    members: dict[str, tuple[int, int | None]] = {}
    at = _skip(text, 1)
    if text.startswith("}", at):
        return members, at + 1
    while at < len(text):
        key_end = _value_end(text, at) if text[at] == '"' else -1
        if key_end == -1:
            raise ValueError("a tool call object's key is not a string")
        if key_end is None:
            return members, None
        key = json.loads(text[at:key_end])
        at = _skip(text, key_end)
        if at == len(text):
            return members, None
        if text[at] != ":":
            raise ValueError("expected ':' in a tool call object")
        start = _skip(text, at + 1)
        if start == len(text):
            return members, None
        end = _value_end(text, start)
        if end == -1:
            raise ValueError("a tool call object holds a value that is not JSON")
        members[key] = (start, end)
        if end is None:
            return members, None
        at = _skip(text, end)
        if at == len(text):
            return members, None
        if text[at] == "}":
            return members, at + 1
        if text[at] != ",":
            raise ValueError("expected ',' or '}' in a tool call object")
        at = _skip(text, at + 1)
    return members, None


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in _WHITESPACE:
        at += 1
    return at


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON value at ``start`` ends: None if ``text`` ends first, -1 if it is not
    JSON. Containers and strings are delimited by scanning; scalars are checked by parsing."""
    first = text[start]
    if first == '"' or first in "{[":
        depth, in_string, escaped = 0, False, False
        for at in range(start, len(text)):
            char = text[at]
            if in_string:
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    in_string = False
                    if depth == 0:
                        return at + 1
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    end = at + 1
                    return end if _is_json(text[start:end]) else -1
        return None
    at = start
    while at < len(text) and text[at] not in ",}] \t\r\n":
        at += 1
    if at == len(text):
        return None  # a number may go on
    return at if _is_json(text[start:at]) else -1


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
