"""Grammar state of the EngineCore: compiling constraints, token bitmasks, advancing matchers.

Built on llguidance, which is torch-free (Rust, with numpy helpers). Compilation runs on one
background thread, off the step path, behind a cache keyed by the constraint: a request whose
grammar is not ready waits here, outside the scheduler, while the others run. Each step's
mask is packed int32, ``ceil(vocab / 32)`` words per constrained row (bit ``t % 32`` of word
``t // 32`` allows token ``t``), filled on llguidance's thread pool.
"""

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy as llguidance_numpy
import numpy as np

from strata.engine_core.request import Request
from strata.engine_core.sampling_params import StructuredOutputsParams
from strata.engine_core.speculative import Proposer

logger = logging.getLogger(__name__)

COMPILE_CACHE_SIZE = 256
MASK_THREADS = 2


class GrammarError(ValueError):
    """A constraint the engine cannot compile; the message names the problem."""


class StructuredOutputs:
    """Compiles constraints for a model's tokenizer and holds one matcher per request.

    ``submit`` starts a request's grammar; ``take_compiled`` hands back the requests whose
    grammar is ready (or failed); ``draft_prefix`` says how many of a request's speculative
    drafts its grammar accepts; ``fill_bitmask`` computes the next-token masks of a batch (one
    per position a row samples); ``advance`` feeds each matcher its sampled token.
    """

    def __init__(self, tokenizer_json_path: str, vocab_size: int, eos_token_id: int | None) -> None:
        self.vocab_size = vocab_size
        self.words_per_row = (vocab_size + 31) // 32
        self._tokenizer_json_path = tokenizer_json_path
        self._eos_token_id = eos_token_id
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._mask_pool = llguidance.LLExecutor(MASK_THREADS)
        self._cache: OrderedDict[tuple[str, str, str | None, str | None], Future] = OrderedDict()  # of pristine matchers
        self._lock = threading.Lock()
        self._compiling: dict[str, Future] = {}  # request id -> its compilation
        self.matchers: dict[str, llguidance.LLMatcher] = {}  # request id -> its matcher
        self.mask_seconds = 0.0  # time spent filling masks, for benchmarks
        self.mask_steps = 0

    # ---- compilation ----------------------------------------------------------------------

    def submit(self, request_id: str, params: StructuredOutputsParams) -> None:
        key = (params.kind, params.spec, params.reasoning_start, params.reasoning_end)
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._compiler.submit(self._compile, params)
                self._cache[key] = future
                if len(self._cache) > COMPILE_CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        self._compiling[request_id] = future

    def wait_for_compile(self, timeout_s: float) -> None:
        """Block until some compilation finishes, at most ``timeout_s`` (nothing else to do)."""
        pending = next((f for f in self._compiling.values() if not f.done()), None)
        if pending is not None:
            try:
                pending.exception(timeout=timeout_s)
            except TimeoutError:
                pass

    def take_compiled(self) -> tuple[list[str], list[tuple[str, str]]]:
        """Requests whose grammar is now ready (their matcher installed), and those whose grammar
        failed, with the reason."""
        ready, failed = [], []
        for request_id, future in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            error = future.exception()
            if error is None:
                self.matchers[request_id] = future.result().deep_copy()
                ready.append(request_id)
            else:
                reason = str(error) if isinstance(error, GrammarError) else f"the grammar failed to compile: {error!r}"
                failed.append((request_id, reason))
        return ready, failed

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        if self._tokenizer is None:
            with open(self._tokenizer_json_path, encoding="utf-8") as file:
                self._tokenizer = llguidance.LLTokenizer(
                    file.read(), n_vocab=self.vocab_size, eos_token=self._eos_token_id
                )
        grammar = _grammar(params)
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise GrammarError(f"invalid {params.kind} constraint: {_first_lines(error)}")
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {params.kind} constraint: {_first_lines(matcher.get_error())}")
        return matcher

    # ---- per step -------------------------------------------------------------------------

    def draft_prefix(self, request_id: str, drafts: list[int]) -> int:
        """How many of ``drafts`` the request may verify: the longest prefix its grammar
        accepts, short of a draft that completes the grammar (the token after it, which the
        step would produce, is one the grammar forbids; the model samples that draft itself).
        The matcher is left as it was."""
        matcher = self.matchers[request_id]
        consumed = 0
        for token in drafts[: matcher.validate_tokens(drafts)]:
            matcher.consume_token(token)
            consumed += 1
            if matcher.is_stopped():
                matcher.rollback(consumed)
                return consumed - 1
        matcher.rollback(consumed)
        return consumed

    def fill_bitmask(self, rows: list[tuple[str, list[int]]]) -> bytes:
        """The packed next-token masks of these (request id, drafts) rows, in this order: for
        each, ``1 + len(drafts)`` masks, the one after its tokens, then the one after each of
        its drafts (which ``draft_prefix`` accepted)."""
        plain, drafted, start = [], [], 0
        for request_id, drafts in rows:
            # llguidance's draft variant refuses an empty draft list.
            if drafts:
                drafted.append((self.matchers[request_id], start, drafts))
            else:
                plain.append((self.matchers[request_id], start))
            start += 1 + len(drafts)
        bitmask = np.empty((start, self.words_per_row), dtype=np.int32)
        if plain:
            llguidance_numpy.fill_next_token_bitmask_par(self._mask_pool, plain, bitmask)
        if drafted:
            llguidance_numpy.fill_next_token_bitmask_par_with_draft_tokens(self._mask_pool, drafted, bitmask)
        return bitmask.tobytes()

    def advance(self, request_id: str, token_id: int) -> str | None:
        """Feed a sampled token to the request's matcher. Returns "stop" when the grammar is
        complete (nothing may follow), "error" with the matcher's reason when the token broke
        it, else None."""
        matcher = self.matchers[request_id]
        if not matcher.consume_token(token_id):
            return "error"
        return "stop" if matcher.is_stopped() else None

    def error_of(self, request_id: str) -> str:
        return _first_lines(self.matchers[request_id].get_error())

    def remove(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
        self._compiling.pop(request_id, None)

    def shutdown(self) -> None:
        self._compiler.shutdown(wait=False, cancel_futures=True)


class GrammarCheckedProposer:
    """The scheduler's proposer for an engine with grammars: a request under one gets only the
    drafts its grammar accepts (``StructuredOutputs.draft_prefix``), so that each draft
    position has a mask to sample under."""

    def __init__(self, proposer: Proposer, structured: StructuredOutputs) -> None:
        self.proposer = proposer
        self.structured = structured

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        drafts = self.proposer.propose(request, max_drafts)
        if drafts and request.request_id in self.structured.matchers:
            return drafts[: self.structured.draft_prefix(request.request_id, drafts)]
        return drafts

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)


def _grammar(params: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar, after its reasoning block if it has one."""
    answer = _answer_grammar(params)
    if params.reasoning_end is None:
        return answer
    # choice and grammar are Lark text; the others llguidance's JSON form of grammars.
    grammars = [{"lark_grammar": answer}] if params.kind in ("choice", "grammar") else json.loads(answer)["grammars"]
    return _after_reasoning(grammars, params.reasoning_start, params.reasoning_end)


def _after_reasoning(answer_grammars: list[dict], start: str | None, end: str) -> str:
    """The answer's grammars after free text that ends at the first ``end`` (a lazy lexeme, so
    ``end`` cannot occur inside the block), and optional whitespace. llguidance composes
    grammars by reference: the wrapper calls the answer ``@answer``."""
    answer_grammars[0]["name"] = "answer"
    reasoned = "reasoning SPACE? @answer"
    if start is not None:
        reasoned = f"{json.dumps(start)} {reasoned} | @answer"
    wrapper = (
        f"start: {reasoned}\n"
        f"reasoning[stop={json.dumps(end)}]: /(.|\\n)*/\n"
        "SPACE: /[ \\t\\r\\n]+/\n"
    )
    return json.dumps({"grammars": [{"name": "reasoned", "lark_grammar": wrapper}, *answer_grammars]})


def _answer_grammar(params: StructuredOutputsParams) -> str:
    """The constraint itself as an llguidance grammar (JSON compact: no free whitespace)."""
    if params.json is not None or params.json_object:
        schema = params.json if params.json is not None else json.dumps({"type": "object"})
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
        except ValueError as error:
            raise GrammarError(f"invalid json constraint: {_first_lines(str(error))}") from None
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        # JSON string literals are Lark string literals: each choice is matched exactly.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    assert params.grammar is not None
    return llguidance.LLMatcher.grammar_from_lark(params.grammar)


def _first_lines(message: str, limit: int = 400) -> str:
    message = " ".join(line.strip() for line in message.strip().splitlines()[:3])
    return message if len(message) <= limit else message[: limit - 3] + "..."
