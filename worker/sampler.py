"""Token sampling for a batch: penalties, greedy or temperature sampling with top-k, top-p
and min-p, and logprobs.

Random draws come from a counter-based generator keyed by (request seed, output position),
so a seeded request samples the same tokens whatever else is in the batch, and every
tensor-parallel rank, given the same logits, samples the same tokens without talking.
"""

from dataclasses import dataclass

import torch

from strata.engine_core.protocol import TokenLogprobs
from strata.kernels import cpu_layers

_MASK_53 = (1 << 53) - 1


@dataclass
class RandomSampling:
    """What sampling at random needs, one entry per row, as tensors on the logits' device;
    greedy rows among them have temperature 0."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64; vocab size when disabled
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    output_positions: torch.Tensor  # [B] int64: index of the token being sampled
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters, as tensors on the logits' device."""

    random: RandomSampling | None = None  # None: every row is greedy
    # Penalties, present only when some row has one.
    presence_penalty: torch.Tensor | None = None  # [B]
    frequency_penalty: torch.Tensor | None = None  # [B]
    repetition_penalty: torch.Tensor | None = None  # [B]
    output_token_counts: torch.Tensor | None = None  # [B, V] float32
    seen_token_mask: torch.Tensor | None = None  # [B, V] bool: in prompt or output
    # Rows that may not stop yet (min_tokens): (row, token ids to forbid).
    banned_tokens: list[tuple[int, list[int]]] | None = None
    # Rows that want logprobs: (row, number of top alternatives).
    logprob_rows: list[tuple[int, int]] | None = None
    # Rows with a logit bias: (row, {token id: bias}).
    logit_bias: list[tuple[int, dict[int, float]]] | None = None
    # Rows under a grammar and their packed int32 token masks [R, ceil(V / 32)].
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, dict[int, TokenLogprobs]]:
    """Pick one token per row of ``logits`` ``[B, V]``. Returns the token ids ``[B]`` and,
    for rows that asked, the logprobs of the model's raw distribution."""
    raw = logits
    logits = logits if logits.dtype == torch.float32 else logits.float()
    if meta.repetition_penalty is not None:
        logits = _apply_penalties(logits, meta)
    if meta.banned_tokens or meta.logit_bias or meta.grammar_rows is not None:
        logits = logits.clone() if logits is raw else logits
    for row, bias in meta.logit_bias or ():
        logits[row, list(bias)] += torch.tensor(list(bias.values()), device=logits.device)
    for row, token_ids in meta.banned_tokens or ():
        logits[row, token_ids] = float("-inf")
    if meta.grammar_rows is not None:
        assert meta.grammar_bitmask is not None
        apply_token_bitmask(logits, meta.grammar_rows, meta.grammar_bitmask)
    greedy = cpu_layers.argmax(logits.contiguous()) if cpu_layers.handles(logits) else logits.max(dim=-1).indices
    if meta.random is None:
        tokens = greedy
    else:
        tokens = torch.where(meta.random.temperature == 0, greedy, _sample_random(logits, meta.random))
    logprobs = _logprobs(raw, tokens, meta.logprob_rows) if meta.logprob_rows else {}
    return tokens, logprobs


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every token of ``rows`` whose bit in ``bitmask`` (packed int32,
    bit ``t % 32`` of word ``t // 32``) is clear; tokens past the mask's end are disallowed."""
    vocab = logits.shape[1]
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab], float("-inf"))


def _apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    assert meta.seen_token_mask is not None and meta.output_token_counts is not None
    repetition = meta.repetition_penalty[:, None]
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(meta.seen_token_mask, penalised, logits)
    counts = meta.output_token_counts
    logits = logits - meta.frequency_penalty[:, None] * counts
    return logits - meta.presence_penalty[:, None] * (counts > 0).float()


def _sample_random(logits: torch.Tensor, meta: RandomSampling) -> torch.Tensor:
    """Inverse-CDF sampling with one uniform per row from the (seed, position) generator."""
    temperature = torch.where(meta.temperature == 0, 1.0, meta.temperature)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    if meta.need_min_p:
        floor = meta.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    if meta.need_top_k:
        kth = probs.topk(int(meta.top_k.max()), dim=-1).values
        threshold = kth.gather(1, (meta.top_k.clamp(max=kth.shape[1]) - 1)[:, None])
        probs = probs.masked_fill(probs < threshold, 0.0)
    if meta.need_top_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep_sorted = mass_before < meta.top_p[:, None] * sorted_probs.sum(dim=-1, keepdim=True)
        keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
        probs = probs.masked_fill(~keep, 0.0)
    cdf = probs.double().cumsum(dim=-1)
    targets = uniform(meta.seeds, meta.output_positions).to(cdf.device) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, targets[:, None], right=True).squeeze(1)
    return tokens.clamp_(max=probs.shape[1] - 1)


def uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A float64 in [0, 1) per row: the splitmix64 finaliser of (seed, position)."""
    x = seeds.to(torch.int64) * _signed(0x9E3779B97F4A7C15) + (positions.to(torch.int64) + 1) * _signed(0xD1B54A32D192ED03)
    x = (x ^ _shift_right(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shift_right(x, 27)) * _signed(0x94D049BB133111EB)
    x = x ^ _shift_right(x, 31)
    return (_shift_right(x, 11) & _MASK_53).double() / float(1 << 53)


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, rows: list[tuple[int, int]]) -> dict[int, TokenLogprobs]:
    index = torch.tensor([row for row, _ in rows], device=raw.device)
    logprobs = torch.log_softmax(raw[index].float(), dim=-1)
    max_k = max(k for _, k in rows)
    top_values, top_ids = logprobs.topk(max_k, dim=-1) if max_k else (logprobs[:, :0], logprobs[:, :0].long())
    sampled = tokens[index]
    sampled_logprob = logprobs.gather(1, sampled[:, None]).squeeze(1)
    result = {}
    for i, (row, k) in enumerate(rows):
        result[row] = TokenLogprobs(
            [int(sampled[i])] + top_ids[i, :k].tolist(),
            [float(sampled_logprob[i])] + top_values[i, :k].tolist(),
        )
    return result
