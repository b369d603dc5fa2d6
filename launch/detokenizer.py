"""Incremental detokenisation and stop strings, one completion at a time."""

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# Prompt tokens decoded with the first output tokens, so a leading space or a multi-token
# character at the seam comes out as it would in the full text.
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas and cuts the text at a stop string.

    A delta is withheld while it ends in an incomplete UTF-8 sequence (U+FFFD), and while it
    could still be the start of a stop string, so streamed text never has to be taken back.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # The Rust stream where it decodes as the tokenizer does; else _next_piece's decode windows.
        self._stream = DecodeStream(context, skip_special_tokens) if _decodes_as_its_backend(tokenizer) else None
        self._backend = tokenizer.backend_tokenizer if self._stream else None
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # the decoded output, cut at a stop string once one is seen
        self._emitted = 0  # characters of ``text`` already handed out
        self.stop_reason: str | None = None

    def append(self, token_id: int) -> str:
        """Add one token; return the text that may be released now (none without a tokenizer)."""
        if self.tokenizer is None:
            return ""
        piece = self._stream.step(self._backend, token_id) if self._stream else self._next_piece(token_id)
        if piece:
            self.text += piece
            self._check_stop()
        return self._release(final=self.stop_reason is not None)

    def flush(self) -> str:
        """At the end of the stream: release whatever is still held back."""
        return self._release(final=True)

    def _next_piece(self, token_id: int) -> str | None:
        """The text ``token_id`` completes, through ``tokenizer.decode`` of the last few ids; None
        while it ends in an incomplete UTF-8 sequence. (DecodeStream does the same in Rust.)"""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _check_stop(self) -> None:
        if not self.stop:
            return
        longest = max(len(s) for s in self.stop)
        window_start = max(0, self._emitted - longest)
        hits = [(self.text.find(s, window_start), s) for s in self.stop]
        hits = [(index, s) for index, s in hits if index >= 0]
        if hits:
            index, stop = min(hits)
            self.stop_reason = stop
            self.text = self.text[: index + len(stop) if self.include_stop else index]

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final and self.stop:
            # Hold back a tail that might grow into a stop string.
            longest = max(len(s) for s in self.stop)
            end = max(self._emitted, len(self.text) - longest + 1)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta


def _decodes_as_its_backend(tokenizer: PreTrainedTokenizerBase | None) -> bool:
    """Whether ``tokenizer.decode`` is its Rust backend's decode and nothing more, so that the
    backend's own incremental DecodeStream gives the same text (at a tenth of the cost of two
    ``decode`` calls a token, which the frontend pays on the step's critical path under
    ``--executor uni``). Not where a subclass decodes its own way or spaces are cleaned up."""
    return (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and type(tokenizer)._decode is PreTrainedTokenizerFast._decode
        and not tokenizer.clean_up_tokenization_spaces
    )
