"""Speculative decoding with a draft model: after a step's verification the last stage runs a
smaller model (this rank's TP shard of it) ``k`` times on each decoding row, greedily, and the
step's output carries the ``k`` drafts to the scheduler for the row's next step.

The draft has its own paged KV cache, laid out for its own layers and heads but addressed by
the target's block ids: a position's draft K/V sits in the same block and slot as its target
K/V, so the rows' block tables serve both. A row's drafts run past the blocks its table holds
(the scheduler allocates blocks for tokens it schedules, not for guesses), so the draft cache
has ``scratch_blocks_per_row`` extra blocks per row of a step that take those positions.

Draft K/V is trusted only for accepted tokens that lie in the row's own blocks
(``computed``): the next proposal first catches the draft up on every token the target
accepted since, in the same forward that proposes the first draft. A row that enters the
batch (new, resumed after preemption, or with blocks from the prefix cache or the CPU tier,
whose draft K/V nobody vouches for) starts from position 0.

That catch-up forward takes at most ``catch_up_budget`` tokens (the step's token budget, so it
is never larger than the target's largest step): rows are caught up in batch order while the
budget lasts, the first row it does not cover goes as far as it allows, and the rows not
caught up propose nothing this step (they decode without drafts) and go on next time.
"""

import numpy as np
import torch

from strata.worker.attention import AttentionMetadata
from strata.worker.input_batch import InputBatch, to_device
from strata.worker.llama import LlamaForCausalLM


def scratch_blocks_per_row(num_speculative_tokens: int, block_size: int) -> int:
    """Blocks a row's guessed positions may need past its own: the step computed up to its
    second-to-last token, so guesses span at most ``k`` positions from there."""
    return num_speculative_tokens // block_size + 2


class DraftProposer:
    """Proposes ``num_speculative_tokens`` greedy drafts per row with ``model`` over
    ``kv_caches`` (one per draft layer, ``num_blocks`` blocks shared by id with the target's
    cache, then the scratch blocks of up to ``max_rows`` rows), catching up on at most
    ``catch_up_budget`` tokens per proposal."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        num_blocks: int,
        block_size: int,
        num_speculative_tokens: int,
        num_batch_rows: int,
        max_rows: int,
        catch_up_budget: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.catch_up_budget = catch_up_budget
        self.kv_caches = kv_caches
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.k = num_speculative_tokens
        self.scratch = scratch_blocks_per_row(num_speculative_tokens, block_size)
        self.max_rows = max_rows
        self.device = device
        self.computed = np.zeros(num_batch_rows, dtype=np.int64)  # leading positions whose draft K/V holds

    def row_added(self, row: int) -> None:
        self.computed[row] = 0

    def propose(self, batch: InputBatch, rows: np.ndarray) -> np.ndarray:
        """``[p, k]`` drafts continuing the tokens of ``rows[:p]``: the rows whose catch-up fit
        the budget (``p`` may be 0; the rest propose at a later step)."""
        assert len(rows) <= self.max_rows, f"{len(rows)} rows propose, the draft cache has scratch for {self.max_rows}"
        num_tokens = batch.num_tokens[rows]
        start = self.computed[rows]
        behind = num_tokens - start  # >= 1: at least the token the target produced last
        counts = np.clip(self.catch_up_budget - (np.cumsum(behind) - behind), 0, behind)
        fed = int(np.count_nonzero(counts))
        caught_up = int(np.count_nonzero(counts == behind))  # a prefix of the fed rows
        drafts = np.empty((caught_up, self.k), dtype=np.int64)
        rows, start, counts = rows[:fed], start[:fed], counts[:fed]
        seq_lens = start + counts
        tables = self._block_tables(batch, rows, int(seq_lens.max()) + self.k - 1)
        # Catch up on the accepted tokens, the last one's logits giving the first draft.
        token_row = np.repeat(np.arange(fed), counts)
        positions = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts - start, counts)
        token_ids = batch.token_ids[rows[token_row], positions]
        drafts[:, 0] = self._greedy(token_ids, positions, token_row, tables, counts, seq_lens)[:caught_up]
        self.computed[rows] = np.minimum(seq_lens, batch.num_blocks[rows] * self.block_size)
        if caught_up == 0:
            return drafts
        every_row, ones = np.arange(caught_up), np.ones(caught_up, dtype=np.int64)
        for j in range(1, self.k):
            positions = seq_lens[:caught_up] + j - 1
            drafts[:, j] = self._greedy(drafts[:, j - 1], positions, every_row, tables[:caught_up], ones, positions + 1)
        return drafts

    def _block_tables(self, batch: InputBatch, rows: np.ndarray, max_len: int) -> np.ndarray:
        """Each row's blocks, then its scratch blocks past them, for positions below ``max_len``."""
        columns = -(-max_len // self.block_size)
        tables = np.zeros((len(rows), columns), dtype=np.int32)
        width = min(columns, batch.block_table.shape[1])
        tables[:, :width] = batch.block_table[rows, :width]
        past = np.arange(columns)[None, :] - batch.num_blocks[rows][:, None]
        scratch = self.num_blocks + np.arange(len(rows))[:, None] * self.scratch + np.clip(past, 0, self.scratch - 1)
        return np.where(past >= 0, scratch, tables).astype(np.int32)

    def _greedy(
        self,
        token_ids: np.ndarray,
        positions: np.ndarray,
        token_row: np.ndarray,
        tables: np.ndarray,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
    ) -> np.ndarray:
        """One draft forward over each row's ``query_lens`` tokens; the argmax after each row's last."""
        blocks = tables[token_row, positions // self.block_size].astype(np.int64)
        query_start_loc = np.concatenate(([0], np.cumsum(query_lens)))
        meta = AttentionMetadata(
            slot_mapping=to_device(blocks * self.block_size + positions % self.block_size, self.device),
            block_tables=to_device(tables, self.device),
            query_start_loc=to_device(query_start_loc.astype(np.int32), self.device),
            seq_lens=to_device(seq_lens.astype(np.int32), self.device),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        hidden = self.model(to_device(token_ids, self.device), to_device(positions, self.device), self.kv_caches, meta)
        logits = self.model.compute_logits(hidden[to_device(query_start_loc[1:] - 1, self.device)])
        return logits.argmax(dim=-1).cpu().numpy()
