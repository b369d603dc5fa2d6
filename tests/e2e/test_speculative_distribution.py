"""Sampled requests with speculation on follow the target's distribution: over many seeded
draws of a tiny-vocabulary model, the tokens at a drafted position and at the position after
a kept draft pass a chi-square test against the probabilities HF computes on the same weights,
for n-gram drafts and for a draft model's; strongly penalised requests draw the very tokens
they draw without drafts."""

import numpy as np
import pytest
import torch

from strata import LLM, SamplingParams

from model_factory import save_tiny_model, tiny_llama_config

VOCAB = 16
TEMPERATURE = 0.7
NUM_DRAWS = 3000
# Every token follows its predecessor somewhere in the prompt, so n-gram always has drafts.
PROMPT = list(range(VOCAB)) * 2
# By degrees of freedom: the chi-square value exceeded with probability 0.001.
CHI_SQUARE_AT_0_001 = [0.0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26, 32.91, 34.53, 36.12, 37.70]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    path = tmp_path_factory.mktemp("target")
    model = save_tiny_model(tiny_llama_config(vocab_size=VOCAB), path)
    return str(path), model


def chi_square(tokens: np.ndarray, probabilities: np.ndarray) -> tuple[float, int]:
    """The statistic and its degrees of freedom, the cells expected fewer than 5 draws pooled."""
    observed, expected = np.bincount(tokens, minlength=VOCAB).astype(float), len(tokens) * probabilities
    small = expected < 5
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return float(((observed - expected) ** 2 / expected).sum()), len(expected) - 1


def next_token_probabilities(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, -1]
    return torch.softmax(logits / TEMPERATURE, dim=-1).numpy()


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_tokens_with_drafts_follow_the_targets_distribution(target, method):
    path, model = target
    # The draft model: the target's first layer, a guess that is often right and often not. Its
    # first forward catches up on every request's prompt: a step budget with room for them all
    # lets every request propose at once.
    draft = {"speculative_model": path, "speculative_draft_layers": 1} if method == "draft" else {}
    if method == "draft":
        draft["max_num_batched_tokens"] = NUM_DRAWS * (len(PROMPT) + 1)
    params = [SamplingParams(temperature=TEMPERATURE, seed=seed, max_tokens=3, ignore_eos=True) for seed in range(NUM_DRAWS)]
    with LLM(path, skip_tokenizer=True, dtype="float32", executor="uni", speculative_method=method,
             num_speculative_tokens=2, speculative_disable_by_batch_size=NUM_DRAWS, **draft) as llm:
        outputs = llm.generate([PROMPT] * NUM_DRAWS, params, use_tqdm=False)
        stats = llm.stats
    drawn = np.array([output.outputs[0].token_ids for output in outputs])
    # Every second token was verified as a draft or sampled after a rejected one; a request whose
    # prompt's last chunk is its last token verifies drafts there already, and may again after.
    assert stats.spec_verifications >= NUM_DRAWS
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens

    first = int(np.bincount(drawn[:, 0]).argmax())
    seconds = drawn[drawn[:, 0] == first, 1]
    statistic, dof = chi_square(seconds, next_token_probabilities(model, PROMPT + [first]))
    assert statistic < CHI_SQUARE_AT_0_001[dof], "the second token given the most drawn first"

    second = int(np.bincount(seconds).argmax())
    thirds = drawn[(drawn[:, 0] == first) & (drawn[:, 1] == second), 2]
    statistic, dof = chi_square(thirds, next_token_probabilities(model, PROMPT + [first, second]))
    assert statistic < CHI_SQUARE_AT_0_001[dof], "the third token given the most drawn first two"


def test_strongly_penalised_sampled_requests_draw_the_tokens_they_draw_without_drafts(target):
    # Penalties this strong move a draft position's distribution unless it counts the drafts
    # before it, as a one-token step there would.
    path, _ = target
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=24, ignore_eos=True, presence_penalty=0.5,
                       frequency_penalty=1.0, repetition_penalty=1.3)
        for seed in range(200)
    ]
    drawn = {}
    for method in (None, "ngram"):
        with LLM(path, skip_tokenizer=True, dtype="float32", executor="uni", speculative_method=method,
                 speculative_disable_by_batch_size=len(params)) as llm:
            drawn[method] = [output.outputs[0].token_ids for output in llm.generate([PROMPT] * 200, params, use_tqdm=False)]
            if method:
                assert llm.stats.spec_accepted_tokens > 0
    assert drawn["ngram"] == drawn[None]
