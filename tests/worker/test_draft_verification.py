"""Draft verification: which hidden states a step samples, which drafts it keeps, and that the
tokens it produces follow the target's distribution (chi-square over many seeded draws)."""

import numpy as np
import torch

from strata.engine_core.protocol import TokenLogprobs
from strata.worker.draft_verification import DraftLayout
from strata.worker.sampler import RandomSampling, SamplingMetadata, sample

VOCAB = 8
CHI_SQUARE_7_DOF_AT_0_001 = 24.32  # a fixed seed makes the test deterministic; this bounds a fair sampler


def test_a_row_with_drafts_samples_its_last_token_and_every_draft_position():
    # A 5-token prefill chunk, a decode with 2 drafts, a plain decode.
    layout = DraftLayout.build(np.array([0, 5, 8, 9]), np.array([0, 2, 0]))
    assert layout.hidden_index.tolist() == [4, 5, 6, 7, 8]
    assert layout.starts.tolist() == [0, 1, 4]
    assert layout.batch_index.tolist() == [0, 1, 1, 1, 2]
    assert layout.offsets.tolist() == [0, 0, 1, 2, 0]


def test_drafts_are_kept_while_the_sampled_token_equals_them():
    layout = DraftLayout.build(np.array([0, 4, 8, 12]), np.array([3, 3, 3]))
    sampled = np.array([7, 8, 9, 1, 7, 5, 9, 2, 6, 8, 9, 3])
    drafts = {0: np.array([7, 8, 9]), 1: np.array([7, 8, 9]), 2: np.array([7, 8, 9])}
    assert layout.verify(sampled, drafts) == {0: [7, 8, 9, 1], 1: [7, 5], 2: [6]}


def test_a_constrained_row_gets_a_mask_row_for_each_position_it_samples():
    layout = DraftLayout.build(np.array([0, 5, 8, 9]), np.array([0, 2, 0]))
    assert layout.logits_rows(np.array([1, 2])).tolist() == [1, 2, 3, 4]


def test_logprobs_after_a_rejected_draft_are_dropped():
    layout = DraftLayout.build(np.array([0, 3, 4]), np.array([2, 0]))
    logprobs = {row: TokenLogprobs([row], [-1.0]) for row in range(4)}
    by_row = layout.logprobs_by_row(logprobs, {0: [7, 5]})
    assert {index: [entry.token_ids[0] for entry in entries] for index, entries in by_row.items()} == {0: [0, 1], 1: [3]}


def chi_square(observed: np.ndarray, probabilities: np.ndarray) -> float:
    expected = observed.sum() * probabilities
    return float(((observed - expected) ** 2 / expected).sum())


def test_verified_tokens_follow_the_targets_distribution():
    count = 20000
    first = torch.tensor([0.0, 1.0, 2.0, 0.5, -1.0, 0.0, 0.3, 1.5])
    second = torch.tensor([1.0, -0.5, 0.0, 2.0, 0.5, 0.2, -1.0, 1.0])
    draft = 2  # the most likely first token: accepted often, rejected often enough
    # Each of `count` requests verifies one draft: two logits rows, at output positions 0 and 1.
    logits = torch.stack([first, second]).repeat(count, 1)
    meta = SamplingMetadata(random=RandomSampling(
        temperature=torch.ones(2 * count), top_k=torch.full((2 * count,), VOCAB), top_p=torch.ones(2 * count),
        min_p=torch.zeros(2 * count), seeds=torch.arange(count, dtype=torch.int64).repeat_interleave(2),
        output_positions=torch.tensor([0, 1]).repeat(count), need_top_k=False, need_top_p=False, need_min_p=False,
    ))
    sampled = sample(logits, meta)[0].numpy()
    layout = DraftLayout.build(np.arange(0, 2 * count + 1, 2), np.ones(count, dtype=np.int64))
    produced = layout.verify(sampled, {i: np.array([draft]) for i in range(count)})
    firsts = np.array([tokens[0] for tokens in produced.values()])
    seconds = np.array([tokens[1] for tokens in produced.values() if tokens[0] == draft])
    assert chi_square(np.bincount(firsts, minlength=VOCAB), torch.softmax(first, 0).numpy()) < CHI_SQUARE_7_DOF_AT_0_001
    assert chi_square(np.bincount(seconds, minlength=VOCAB), torch.softmax(second, 0).numpy()) < CHI_SQUARE_7_DOF_AT_0_001
    acceptance = (firsts == draft).mean()
    assert abs(acceptance - float(torch.softmax(first, 0)[draft])) < 0.01, "a draft is kept with probability p(draft)"
