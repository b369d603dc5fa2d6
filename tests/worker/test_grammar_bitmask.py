"""The packed grammar bitmask, applied to logits, against a per-token reference."""

import numpy as np
import torch

from strata.worker.sampler import apply_token_bitmask


def test_bitmask_allows_exactly_the_set_bits_of_the_listed_rows():
    generator = np.random.default_rng(0)
    vocab, words = 70, 3  # the last word is partly past the vocabulary
    allowed = generator.random((2, vocab)) < 0.3
    packed = np.zeros((2, words), dtype=np.uint32)
    for row, token in zip(*np.nonzero(allowed)):
        packed[row, token // 32] |= np.uint32(1 << (token % 32))
    logits = torch.randn(4, vocab)
    expected = logits.clone()
    rows = [3, 1]
    for i, row in enumerate(rows):
        expected[row, ~torch.from_numpy(allowed[i])] = float("-inf")
    apply_token_bitmask(logits, torch.tensor(rows), torch.from_numpy(packed.view(np.int32)))
    torch.testing.assert_close(logits, expected)
