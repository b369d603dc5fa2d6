"""Tool calling in chat completions: checking ``tools``, ``tool_choice`` and the calls in the
history, rendering them for the chat template, and the grammar that enforces a call.

``tool_choice``:
- ``none`` (the default without tools): the model sees no tools; its output is content.
- ``auto`` (the default with tools): the model sees the tools and its output is read by the
  ``--tool-call-parser`` (``launch/server/tool_parsers.py``); what is not a call is content.
- ``required``: the output is forced by a JSON schema to be calls of the given tools, an array
  of them unless ``parallel_tool_calls`` is false (then exactly one).
- a named function: the output is forced to be that function's arguments object.

A chat template that mentions ``tools`` gets them, and the history's calls and results, in
the form Hugging Face templates take. Templates that ignore tools (SmolLM2's) get a system
preamble describing the tools and the call format, the history's calls written in that format
and the tool results as user messages, so the model reads them as text.
"""

import functools
import json
from dataclasses import dataclass

import llguidance
from transformers import PreTrainedTokenizerBase

from strata.engine_core.sampling_params import StructuredOutputsParams
from strata.launch.server.protocol import APIError, ChatMessage, ChatPrompt, Tool
from strata.launch.server.structured import schema_text
from strata.launch.server.tool_parsers import (
    NamedCallParser,
    RequiredCallsParser,
    ToolCallParser,
    parser_named,
)

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
SCHEMA_CHECK_CACHE_SIZE = 1024


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request's tools mean for its prompt, its constraint and its output."""

    tools: tuple[Tool, ...]  # the tools the model is shown (none with tool_choice "none")
    choice: str  # "none", "auto", "required" or "named"
    parser_name: str  # the --tool-call-parser, for "auto"
    named: str | None = None
    parallel: bool = True

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that forces the output to be a call, for ``required`` and named."""
        if self.choice == "named":
            function = next(tool.function for tool in self.tools if tool.function.name == self.named)
            return StructuredOutputsParams(json=json.dumps(_parameters(function.parameters)))
        if self.choice == "required":
            call = {"anyOf": [_call_schema(tool) for tool in self.tools]}
            schema = {"type": "array", "minItems": 1, "items": call} if self.parallel else call
            return StructuredOutputsParams(json=json.dumps(schema))
        return None

    def parser(self) -> ToolCallParser | None:
        """A fresh parser for one choice's output (None: the output is all content)."""
        if self.choice == "named":
            assert self.named is not None
            return NamedCallParser(self.named)
        if self.choice == "required":
            return RequiredCallsParser()
        if self.choice == "auto":
            return parser_named(self.parser_name)
        return None


def tool_plan(body: ChatPrompt, parser_name: str) -> ToolPlan:
    """The request's plan; a 400 naming the field for tools, choices or history that are wrong."""
    tools = tuple(body.tools or ())
    _check_tools(tools)
    _check_history(body.messages)
    choice = body.tool_choice
    parallel = body.parallel_tool_calls is not False
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan((), "none", parser_name, parallel=parallel)
    if not tools:
        raise APIError(400, f"tool_choice {_choice_text(choice)} needs tools", param="tool_choice")
    if isinstance(choice, str):
        return ToolPlan(tools, choice, parser_name, parallel=parallel)
    names = [tool.function.name for tool in tools]
    if choice.function.name not in names:
        raise APIError(
            400, f"tool_choice names the function {choice.function.name!r}, which is not among the tools "
            f"({', '.join(names)})", param="tool_choice",
        )
    return ToolPlan(tools, "named", parser_name, named=choice.function.name, parallel=parallel)


def template_messages(
    messages: list[ChatMessage], plan: ToolPlan, tokenizer: PreTrainedTokenizerBase
) -> tuple[list[dict], list[dict] | None]:
    """The messages for ``apply_chat_template`` and its ``tools`` argument."""
    if "tools" in (tokenizer.chat_template or ""):
        tools = [tool.model_dump(exclude_none=True) for tool in plan.tools] or None
        return [_native_message(message) for message in messages], tools
    rendered: list[dict] = []
    for index, message in enumerate(messages):
        if message.role == "tool":
            result = f"<tool_response>\n{_text(message)}\n</tool_response>"
            if index and messages[index - 1].role == "tool":  # results of one turn: one message
                rendered[-1]["content"] += "\n" + result
            else:
                rendered.append({"role": "user", "content": result})
            continue
        content = _text(message)
        if message.tool_calls:
            calls = [_call_text(plan.parser_name, call.function.name, call.function.arguments) for call in message.tool_calls]
            content = "\n".join(([content] if content else []) + calls)
        rendered.append({"role": _role(message), "content": content})
    if plan.tools:
        preamble = _preamble(plan)
        if rendered[0]["role"] == "system":
            rendered[0]["content"] = f"{rendered[0]['content']}\n\n{preamble}"
        else:
            rendered.insert(0, {"role": "system", "content": preamble})
    return rendered, None


def _check_tools(tools: tuple[Tool, ...]) -> None:
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        field = f"tools[{index}].function"
        name = tool.function.name
        if name in seen:
            raise APIError(400, f"{field}.name: the function {name!r} is defined twice", param="tools")
        seen.add(name)
        parameters = tool.function.parameters
        if parameters is None:
            continue
        if parameters.get("type", "object") != "object":
            raise APIError(400, f"{field}.parameters must be a schema of type object", param="tools")
        error = _schema_error(schema_text(parameters, f"{field}.parameters"))
        if error:
            raise APIError(400, f"{field}.parameters is not a usable JSON schema: {error}", param="tools")


@functools.lru_cache(maxsize=SCHEMA_CHECK_CACHE_SIZE)
def _schema_error(text: str) -> str:
    """Why the grammar engine cannot compile the JSON schema ``text`` ("" if it can). Cached:
    clients send the same tools with every request, and checking one takes about a millisecond."""
    try:
        return llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(text))
    except (ValueError, TypeError) as error:
        return str(error)


def _check_history(messages: list[ChatMessage]) -> None:
    call_ids: set[str] = set()
    for index, message in enumerate(messages):
        field = f"messages[{index}]"
        if message.tool_calls is not None and message.role != "assistant":
            raise APIError(400, f"{field}: only assistant messages carry tool_calls", param="messages")
        if message.tool_call_id is not None and message.role != "tool":
            raise APIError(400, f"{field}: only tool messages carry tool_call_id", param="messages")
        for number, call in enumerate(message.tool_calls or ()):
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise APIError(
                    400, f"{field}.tool_calls[{number}].function.arguments is not a JSON object", param="messages"
                )
            call_ids.add(call.id)
        if message.role == "tool":
            if message.tool_call_id is None:
                raise APIError(400, f"{field}: a tool message needs tool_call_id", param="messages")
            if message.tool_call_id not in call_ids:
                raise APIError(
                    400, f"{field}: tool_call_id {message.tool_call_id!r} answers no earlier assistant tool call",
                    param="messages",
                )


def _choice_text(choice: object) -> str:
    return repr(choice) if isinstance(choice, str) else "naming a function"


def _parameters(parameters: dict | None) -> dict:
    return EMPTY_PARAMETERS if parameters is None else parameters


def _call_schema(tool: Tool) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": _parameters(tool.function.parameters)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _preamble(plan: ToolPlan) -> str:
    signatures = "\n".join(json.dumps(tool.model_dump(exclude_none=True)) for tool in plan.tools)
    if plan.parser_name == "llama3_json":
        how = (
            'To call a function, reply with only a JSON object {"name": <function name>, "parameters": '
            "<arguments object>}; separate several calls with \";\"."
        )
    else:
        how = (
            "To call a function, reply with a <tool_call></tool_call> block holding a JSON object with the "
            'function\'s name and arguments, one block per call:\n<tool_call>\n{"name": <function name>, '
            '"arguments": <arguments object>}\n</tool_call>'
        )
    return f"You may call these functions; their parameters are JSON schemas:\n<tools>\n{signatures}\n</tools>\n{how}"


def _call_text(parser_name: str, name: str, arguments: str) -> str:
    if parser_name == "llama3_json":
        return f'{{"name": {json.dumps(name)}, "parameters": {arguments}}}'
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'


def _native_message(message: ChatMessage) -> dict:
    rendered: dict = {"role": _role(message), "content": _text(message)}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _role(message: ChatMessage) -> str:
    # "developer" is OpenAI's new name for "system"; chat templates know only the latter.
    return "system" if message.role == "developer" else message.role


def _text(message: ChatMessage) -> str:
    content = message.content
    if isinstance(content, list):
        return "".join(part.text for part in content)
    return content or ""
