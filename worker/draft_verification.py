"""Verifying speculative drafts in the step that computes them.

A row scheduled with ``d`` drafts runs ``1 + d`` query tokens: its last token and the drafts.
The logits at each of those positions are sampled exactly as a one-token step at that output
position would be (same temperature, top-k/p, min-p, bias and the same counter-based uniform),
and the drafts are accepted while the sampled token equals them; the first sampled token that
differs, or the one after the last draft, ends the row's step. Both proposers' drafts are a
point mass (an n-gram match, the draft model's argmax), for which this is rejection sampling:
a draft ``x`` is kept with probability ``p(x)``, and a rejection samples ``p`` without ``x``,
renormalised. So the output is the target's distribution, and a
seeded request draws the very tokens it would draw without drafts.
"""

from dataclasses import dataclass

import numpy as np

from strata.engine_core.protocol import TokenLogprobs


@dataclass
class DraftLayout:
    """Where a step's logits rows come from when some batch rows verify drafts: batch row
    ``i`` owns logits rows ``starts[i] .. starts[i] + num_drafts[i]``."""

    num_drafts: np.ndarray  # [B]
    starts: np.ndarray  # [B]
    batch_index: np.ndarray  # [R] the batch row of each logits row
    offsets: np.ndarray  # [R] the output position of each logits row past its batch row's next one
    hidden_index: np.ndarray  # [R] the flattened token whose hidden state gives each logits row

    @classmethod
    def build(cls, query_start_loc: np.ndarray, num_drafts: np.ndarray) -> "DraftLayout":
        per_row = num_drafts + 1
        starts = np.concatenate(([0], np.cumsum(per_row)[:-1]))
        batch_index = np.repeat(np.arange(len(per_row)), per_row)
        offsets = np.arange(len(batch_index)) - starts[batch_index]
        # Each row's last 1 + d query tokens: its last token and its drafts.
        hidden_index = query_start_loc[1:][batch_index] - per_row[batch_index] + offsets
        return cls(num_drafts, starts, batch_index, offsets, hidden_index)

    def logits_rows(self, batch_rows: np.ndarray) -> np.ndarray:
        """Every logits row of these batch rows, in order: each one's ``1 + num_drafts``."""
        per_row = self.num_drafts[batch_rows] + 1
        first = np.repeat(self.starts[batch_rows], per_row)
        return first + np.arange(int(per_row.sum())) - np.repeat(np.cumsum(per_row) - per_row, per_row)

    def verify(self, sampled: np.ndarray, drafts: dict[int, np.ndarray]) -> dict[int, list[int]]:
        """Per batch row with drafts, the tokens its step produced: the sampled token at each
        position while it equals the draft there, then the first that does not (or the one
        after the last draft)."""
        produced = {}
        for index, row_drafts in drafts.items():
            start = int(self.starts[index])
            tokens = sampled[start : start + len(row_drafts) + 1].tolist()
            mismatch = np.flatnonzero(np.asarray(tokens[:-1]) != row_drafts)
            produced[index] = tokens[: int(mismatch[0]) + 1] if len(mismatch) else tokens
        return produced

    def logprobs_by_row(
        self, logprobs: dict[int, TokenLogprobs], produced: dict[int, list[int]]
    ) -> dict[int, list[TokenLogprobs]]:
        """Per batch row, the logprobs of each token it produced, in order: a logits row's
        sampled token is the one the row produced there, and positions past the first
        rejected draft produced nothing. ``logprobs`` is by logits row, in ascending order."""
        by_row: dict[int, list[TokenLogprobs]] = {}
        for row, value in logprobs.items():
            index = int(self.batch_index[row])
            if index not in produced or self.offsets[row] < len(produced[index]):
                by_row.setdefault(index, []).append(value)
        return by_row
