"""Request fields that constrain or bias sampling: ``response_format``, the vLLM-style
``guided_*`` extras and ``logit_bias``, turned into ``SamplingParams`` fields.

Only what can be checked without the tokenizer is checked here (one constraint per request,
a schema that is JSON of bounded size and depth); whether it compiles is the EngineCore's to
say, and a failure comes back as a 400 with its reason.
"""

import json
from strata.engine_core.sampling_params import MAX_GRAMMAR_CHARS, StructuredOutputsParams
from strata.launch.server.protocol import APIError, GenerationRequest

MAX_SCHEMA_DEPTH = 64  # deeper schemas are refused before anything recurses over them


def structured_outputs_of(body: GenerationRequest) -> StructuredOutputsParams | None:
    """The request's one output constraint, or None; a 400 naming the field if it is malformed."""
    given: dict[str, object] = {}
    response_format = body.response_format
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            given["response_format"] = {"json_object": True}
        elif response_format.json_schema is None or response_format.json_schema.schema_ is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
        else:
            given["response_format"] = {"json": schema_text(response_format.json_schema.schema_, "response_format")}
    if body.guided_json is not None:
        given["guided_json"] = {"json": schema_text(body.guided_json, "guided_json")}
    if body.guided_regex is not None:
        given["guided_regex"] = {"regex": body.guided_regex}
    if body.guided_choice is not None:
        given["guided_choice"] = {"choice": body.guided_choice}
    if body.guided_grammar is not None:
        given["guided_grammar"] = {"grammar": body.guided_grammar}
    if not given:
        return None
    if len(given) > 1:
        raise APIError(400, f"give at most one output constraint, got {', '.join(given)}", param=next(iter(given)))
    field, fields = next(iter(given.items()))
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as error:
        raise APIError(400, f"{field}: {error}", param=field) from None


def logit_bias_of(body: GenerationRequest) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys, so as strings."""
    if body.logit_bias is None:
        return None
    bias = {}
    for key, value in body.logit_bias.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 10:
            raise APIError(400, f"logit_bias keys must be token ids, got {key[:32]!r}", param="logit_bias")
        bias[int(key)] = value
    return bias


def schema_text(schema: dict, field: str) -> str:
    """The schema as JSON text; a 400 naming ``field`` if it nests too deep or is too long."""
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise APIError(400, f"{field}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels", param=field)
    text = json.dumps(schema)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise APIError(400, f"{field}: the schema is longer than {MAX_GRAMMAR_CHARS} characters", param=field)
    return text


def _depth(value: object) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_SCHEMA_DEPTH:
            return depth
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return deepest
