"""Speculative decoding's configuration and the two kinds of proposer the scheduler asks for
drafts: one that guesses in the EngineCore (``ngram_proposer.NgramProposer``), and one whose
drafts come from the workers' output (``WorkerDrafts``: a draft model the workers ran after the
step's verification). The scheduler treats both alike: ``propose`` before scheduling a
decoding request, ``forget`` when it finishes."""

from dataclasses import dataclass
from typing import Protocol

from strata.engine_core.request import Request

SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method=None``: no speculation. ``ngram``: match the last ``ngram_max`` down to
    ``ngram_min`` tokens and propose up to ``num_speculative_tokens`` that followed. ``draft``:
    the workers run ``draft_model`` (its first ``draft_layers`` decoder layers if given, e.g.
    the target's own for a self-draft) ``num_speculative_tokens`` times per decoding request.
    ``disable_by_batch_size``: a step with more running requests than this verifies no drafts
    (None: any batch speculates)."""

    method: str | None = None
    num_speculative_tokens: int = 3
    ngram_min: int = 1
    ngram_max: int = 4
    draft_model: str | None = None
    draft_layers: int | None = None
    disable_by_batch_size: int | None = None

    def speculates_at(self, running: int) -> bool:
        """Whether a step with ``running`` requests proposes drafts."""
        return self.method is not None and (self.disable_by_batch_size is None or running <= self.disable_by_batch_size)

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min and ngram_max need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("speculative_method draft needs speculative_model (the draft model's directory or .gguf file)")
        if self.method != "draft" and (self.draft_model is not None or self.draft_layers is not None):
            raise ValueError("speculative_model and speculative_draft_layers need speculative_method draft")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ValueError(f"speculative_draft_layers must be >= 1, got {self.draft_layers}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")


class Proposer(Protocol):
    def propose(self, request: Request, max_drafts: int) -> list[int]:
        """Up to ``max_drafts`` tokens guessed to follow the request's tokens."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop what is kept for a finished request."""
        ...


class WorkerDrafts:
    """Drafts the workers proposed at the end of a request's last step, kept until the request
    is scheduled again. They continue the tokens the request had then, so they are offered only
    while it still has exactly those."""

    def __init__(self) -> None:
        self._drafts: dict[str, tuple[int, list[int]]] = {}  # request id -> (its token count, drafts)

    def receive(self, request: Request, drafts: list[int]) -> None:
        self._drafts[request.request_id] = (len(request.all_token_ids), drafts)

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        num_tokens, drafts = self._drafts.pop(request.request_id, (-1, []))
        return drafts[: max(max_drafts, 0)] if num_tokens == len(request.all_token_ids) else []

    def forget(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)
