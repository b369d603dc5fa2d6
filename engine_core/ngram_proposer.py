"""Speculative decoding's n-gram proposer (prompt lookup): a request's next tokens guessed as
the ones that followed the most recent earlier occurrence of its last n tokens.

Runs in the EngineCore, which holds every request's tokens and decides how many tokens a step
schedules; the guesses ("drafts") go to the workers in the step's message and are verified in
one forward. The search is ``bytes.rfind`` over the request's tokens packed as int32, so a
request whose last n-gram never occurred before costs one C-speed scan per step.
"""

from array import array

from strata.engine_core.protocol import TOKEN_TYPECODE
from strata.engine_core.request import Request
from strata.engine_core.speculative import SpeculativeConfig

TOKEN_BYTES = array(TOKEN_TYPECODE).itemsize


class NgramProposer:
    """Proposes drafts for one request at a time; keeps each request's packed tokens
    (appended to as the request grows) until ``forget``."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._packed: dict[str, bytearray] = {}

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        """Up to ``min(max_drafts, num_speculative_tokens)`` tokens that followed the latest
        earlier occurrence of the longest matching suffix; none if no suffix occurred before."""
        limit = min(max_drafts, self.config.num_speculative_tokens)
        tokens = request.all_token_ids
        if limit < 1 or len(tokens) < self.config.ngram_min + 1:
            return []
        packed = self._packed_tokens(request)
        searched_end = len(packed) - TOKEN_BYTES  # a match must end before the last token
        for n in range(min(self.config.ngram_max, len(tokens) - 1), self.config.ngram_min - 1, -1):
            start = _aligned_rfind(packed, packed[-n * TOKEN_BYTES :], searched_end)
            if start >= 0:
                follow = start // TOKEN_BYTES + n
                return tokens[follow : follow + limit]
        return []

    def forget(self, request_id: str) -> None:
        self._packed.pop(request_id, None)

    def _packed_tokens(self, request: Request) -> bytearray:
        packed = self._packed.setdefault(request.request_id, bytearray())
        known = len(packed) // TOKEN_BYTES
        if known < len(request.all_token_ids):
            packed += array(TOKEN_TYPECODE, request.all_token_ids[known:]).tobytes()
        return packed


def _aligned_rfind(haystack: bytearray, needle: bytes, end: int) -> int:
    """The last byte offset, a multiple of the token size, where ``needle`` lies wholly
    inside ``haystack[:end]``; -1 if none."""
    while True:
        start = haystack.rfind(needle, 0, end)
        if start < 0 or start % TOKEN_BYTES == 0:
            return start
        end = start + len(needle) - 1  # look again, left of this misaligned match
