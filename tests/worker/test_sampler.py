"""The sampler against hand-computed references on small vocabularies."""

import torch

from strata.worker.sampler import RandomSampling, SamplingMetadata, sample, uniform

VOCAB = 8


def metadata(batch: int, **overrides) -> SamplingMetadata:
    """Every row sampled at random from the whole distribution, unless ``overrides`` say otherwise."""
    fields = dict(
        temperature=torch.ones(batch),
        top_k=torch.full((batch,), VOCAB),
        top_p=torch.ones(batch),
        min_p=torch.zeros(batch),
        seeds=torch.arange(batch, dtype=torch.int64),
        output_positions=torch.zeros(batch, dtype=torch.int64),
        need_top_k=False,
        need_top_p=False,
        need_min_p=False,
    )
    fields.update(overrides)
    return SamplingMetadata(random=RandomSampling(**fields))


def draws(logits: torch.Tensor, count: int, **overrides) -> torch.Tensor:
    """``count`` samples of one distribution: distinct output positions give distinct draws."""
    batch = logits.expand(count, -1)
    meta = metadata(count, seeds=torch.full((count,), 42), output_positions=torch.arange(count), **overrides)
    return sample(batch, meta)[0]


def test_uniform_is_a_pure_function_of_seed_and_position():
    seeds, positions = torch.tensor([1, 1, 2]), torch.tensor([5, 5, 5])
    values = uniform(seeds, positions)
    assert values[0] == values[1] != values[2]
    many = uniform(torch.full((20000,), 7), torch.arange(20000))
    assert 0 <= many.min() and many.max() < 1 and abs(many.mean().item() - 0.5) < 0.01


def test_sampling_follows_the_softmax_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, -1.0, 0.0, 0.3, 1.5]])
    counts = torch.bincount(draws(logits, 20000), minlength=VOCAB).float() / 20000
    assert torch.allclose(counts, torch.softmax(logits[0], -1), atol=0.015)


def test_top_k_keeps_only_the_k_most_likely():
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, -1.0, 0.0, 0.3, 1.5]])
    seen = set(draws(logits, 2000, top_k=torch.full((2000,), 2), need_top_k=True).tolist())
    assert seen == {2, 7}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05, 0.0, 0.0, 0.0]]) + 1e-9
    seen = set(draws(probs.log(), 2000, top_p=torch.full((2000,), 0.75), need_top_p=True).tolist())
    assert seen == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    probs = torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05, 0.0, 0.0, 0.0]]) + 1e-9
    seen = set(draws(probs.log(), 2000, min_p=torch.full((2000,), 0.3), need_min_p=True).tolist())
    assert seen == {0, 1, 2}


def test_greedy_rows_take_the_argmax_even_in_a_sampled_batch():
    logits = torch.randn(4, VOCAB)
    meta = metadata(4, temperature=torch.tensor([0.0, 1.0, 0.0, 1.0]))
    tokens, _ = sample(logits, meta)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_penalties_follow_their_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, 0.0, 0.0, 0.0, 0.0]])
    counts = torch.tensor([[2.0, 1.0, 0, 0, 0, 0, 0, 0]])
    seen = torch.tensor([[True, True, True, False, False, False, False, False]])
    meta = SamplingMetadata(
        presence_penalty=torch.tensor([0.5]), frequency_penalty=torch.tensor([0.25]),
        repetition_penalty=torch.tensor([2.0]), output_token_counts=counts, seen_token_mask=seen,
    )
    # token 0: 2/2 - 0.25*2 - 0.5 = 0; token 1: -1*2 - 0.25 - 0.5; token 2: 0.5/2; token 3 untouched: 1.0
    assert sample(logits, meta)[0].item() == 3


def test_banned_tokens_are_never_sampled():
    logits = torch.tensor([[5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    meta = SamplingMetadata(banned_tokens=[(0, [0])])
    assert sample(logits, meta)[0].item() != 0


def test_logprobs_are_those_of_the_raw_distribution_sampled_first():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0]])
    meta = SamplingMetadata(logprob_rows=[(0, 2)])
    tokens, logprobs = sample(logits, meta)
    expected = torch.log_softmax(logits[0], -1)
    assert logprobs[0].token_ids == [1, 1, 3]
    assert torch.allclose(torch.tensor(logprobs[0].logprobs), expected[[1, 1, 3]])
