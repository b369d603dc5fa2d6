"""The mixture-of-experts layer against a per-token loop, and its shares summing to the whole."""

import pytest
import torch
import torch.nn.functional as F

from strata.worker.moe import Experts, TopKRouter

HIDDEN, FEATURES, NUM_EXPERTS, TOP_K, TOKENS = 32, 24, 5, 2, 40
NAMES = ("w1", "w3", "w2")


@pytest.fixture(scope="module")
def checkpoint() -> dict[str, torch.Tensor]:
    """Per-expert matrices as a Mixtral checkpoint stores them (gate w1, up w3, down w2)."""
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for expert in range(NUM_EXPERTS):
        tensors[f"{expert}.w1.weight"] = torch.randn(FEATURES, HIDDEN, generator=generator) * 0.2
        tensors[f"{expert}.w3.weight"] = torch.randn(FEATURES, HIDDEN, generator=generator) * 0.2
        tensors[f"{expert}.w2.weight"] = torch.randn(HIDDEN, FEATURES, generator=generator) * 0.2
    return tensors


def load_experts(checkpoint: dict[str, torch.Tensor], experts: slice, features: slice) -> Experts:
    layer = Experts(HIDDEN, FEATURES, NUM_EXPERTS, experts, features, NAMES)
    for param_name in ("gate_up_proj", "down_proj"):
        for part, name in enumerate(layer.checkpoint_parts(param_name)):
            layer.load_weight(param_name, checkpoint[name], part)
    return layer


@pytest.fixture(scope="module")
def routed() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(TOKENS, HIDDEN, generator=generator)
    router = TopKRouter(NUM_EXPERTS, HIDDEN, TOP_K, renormalize=True)
    router.weight.copy_(torch.randn(NUM_EXPERTS, HIDDEN, generator=generator))
    weights, expert_ids = router(x)
    return x, weights, expert_ids


def per_token_reference(checkpoint, x, weights, expert_ids) -> torch.Tensor:
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for weight, expert in zip(weights[token].tolist(), expert_ids[token].tolist()):
            gate = F.linear(x[token], checkpoint[f"{expert}.w1.weight"])
            up = F.linear(x[token], checkpoint[f"{expert}.w3.weight"])
            out[token] += weight * F.linear(F.silu(gate) * up, checkpoint[f"{expert}.w2.weight"])
    return out


def test_router_renormalises_the_top_k_softmax_weights(routed) -> None:
    _, weights, expert_ids = routed
    torch.testing.assert_close(weights.sum(-1), torch.ones(TOKENS))
    assert all(len(set(row)) == TOP_K for row in expert_ids.tolist())


def test_grouped_experts_equal_a_per_token_loop(checkpoint, routed) -> None:
    layer = load_experts(checkpoint, slice(0, NUM_EXPERTS), slice(0, FEATURES))
    torch.testing.assert_close(layer(*routed), per_token_reference(checkpoint, *routed), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "shares",
    [
        pytest.param([(slice(0, 2), slice(0, FEATURES)), (slice(2, 5), slice(0, FEATURES))], id="expert-parallel"),
        pytest.param([(slice(0, NUM_EXPERTS), slice(0, 12)), (slice(0, NUM_EXPERTS), slice(12, 24))], id="split-features"),
    ],
)
def test_two_ranks_shares_sum_to_the_whole_layer(checkpoint, routed, shares) -> None:
    # What the all-reduce adds up: each rank's partial output from its own experts or features.
    partial = [load_experts(checkpoint, experts, features)(*routed) for experts, features in shares]
    whole = load_experts(checkpoint, slice(0, NUM_EXPERTS), slice(0, FEATURES))(*routed)
    torch.testing.assert_close(partial[0] + partial[1], whole, atol=1e-5, rtol=1e-5)


def test_a_rank_whose_experts_got_no_tokens_contributes_zeros(checkpoint, routed) -> None:
    x, weights, expert_ids = routed
    layer = load_experts(checkpoint, slice(3, 5), slice(0, FEATURES))
    assert torch.count_nonzero(layer(x, weights, torch.zeros_like(expert_ids))) == 0
