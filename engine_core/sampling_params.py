"""Per-request sampling parameters, validated the moment they are built (or decoded)."""

import json
import math

import msgspec

MAX_GRAMMAR_CHARS = 64 * 1024  # a schema, regex or grammar longer than this is refused
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """A constraint on the output (all of it, unless a reasoning block comes first); exactly one
    of ``json``, ``json_object``, ``regex``, ``choice`` and ``grammar`` is set.

    ``json``: a JSON schema (its text); ``json_object``: any JSON object; ``regex``: the output
    matches it; ``choice``: the output is one of these strings; ``grammar``: a Lark-style EBNF
    grammar (llguidance's dialect, whose rule ``start`` is the output). Whether the engine can
    compile it is known only when it tries: a failure ends that request with an ``error``.

    ``reasoning_end`` puts a reasoning block before the constrained answer: the text up to and
    including the first ``reasoning_end`` is free, then optional whitespace, then the answer.
    With ``reasoning_start`` the block is optional and must open with it; without, the output
    starts inside the block (the prompt opened it).
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    reasoning_start: str | None = None
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of json, json_object, regex, choice, grammar; got {given or 'none'}"
            )
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        if len(self.spec) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured_outputs.{given[0]} is longer than {MAX_GRAMMAR_CHARS} characters")
        if self.reasoning_start is not None and self.reasoning_end is None:
            raise ValueError("structured_outputs.reasoning_start needs reasoning_end")
        if "" in (self.reasoning_start, self.reasoning_end):
            raise ValueError("structured_outputs.reasoning_start and reasoning_end must not be empty")
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except ValueError as error:
                raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")

    @property
    def spec(self) -> str:
        """The constraint as one string: with the kind, the key of the engine's compile cache."""
        if self.choice is not None:
            return json.dumps(self.choice)
        return self.json or self.regex or self.grammar or ""

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """How to pick each next token and when to stop.

    ``top_k=-1`` disables top-k; ``temperature=0`` is greedy. ``stop`` strings are matched
    by the frontend on detokenized text; ``stop_token_ids`` by the scheduler. ``logprobs=k``
    returns the sampled token's logprob plus the ``k`` most likely tokens; ``prompt_logprobs=k``
    the same for every prompt token after the first (the request then computes its whole
    prompt: prefix-cache hits never computed those logprobs). ``max_tokens=0`` computes the
    prompt and generates nothing (with ``prompt_logprobs``, scoring). Invalid values raise
    ``ValueError`` naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_int("max_tokens", self.max_tokens, minimum=0)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1)
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1, got 0")
        _check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=-(2**63))
            if self.seed >= 2**63:
                raise ValueError(f"seed must fit in 64 signed bits, got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=0)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {type(getattr(self, name)).__name__}")
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _stop_token_ids(self.stop_token_ids)
        if self.logit_bias is not None:
            _check_logit_bias(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_number(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _stop_strings(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ValueError("stop must be a string or a list of strings")
    if any(s == "" for s in stop):
        raise ValueError("stop strings must not be empty")
    return stop


def _check_logit_bias(bias: object) -> None:
    """Bounded like OpenAI's: ids are checked against the vocabulary by the EngineCore."""
    if not isinstance(bias, dict):
        raise ValueError("logit_bias must map token ids to numbers")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias has {len(bias)} entries, more than {MAX_LOGIT_BIAS_ENTRIES}")
    for token, value in bias.items():
        _check_int("logit_bias token id", token, minimum=0)
        _check_number("logit_bias value", value)
        if not -100 <= value <= 100:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {token}")


def _stop_token_ids(ids: object) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError("stop_token_ids must be a list of non-negative integers")
    return ids
