"""Logprobs of prompt tokens, from the hidden states of the prefill chunk that computes them.

The hidden state at prompt position ``p`` predicts the token at ``p + 1``: a chunk covering
positions ``[s, e)`` scores the prompt tokens at ``s + 1 .. min(e, P - 1)`` (the last
position's prediction is the first sampled token, which the sampler scores). The LM head runs
over a bounded slice of positions at a time, so a long chunk never holds ``[chunk, vocab]``
logits at once.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from strata.engine_core.protocol import PromptLogprobs
from strata.worker.input_batch import InputBatch, StepInputs

POSITIONS_PER_SLICE = 256  # float32 logits of a 49k vocabulary: 50 MB per slice


@dataclass
class PromptSpan:
    """One row's prompt tokens to score this step."""

    batch_index: int
    first_hidden: int  # index, in the step's flattened tokens, of the hidden state scoring the first
    first_position: int  # prompt position of the first token scored
    targets: np.ndarray  # the prompt token ids scored
    num_top: int


def prompt_spans(batch: InputBatch, inputs: StepInputs) -> list[PromptSpan]:
    """The rows of this step that want prompt logprobs and whose chunk scores some (read
    before the batch advances)."""
    spans = []
    for index in np.flatnonzero(batch.num_prompt_logprobs[inputs.rows] >= 0).tolist():
        row = int(inputs.rows[index])
        start = int(batch.num_computed[row])
        end = min(start + int(inputs.num_scheduled[index]), int(batch.num_prompt[row]) - 1)
        if end > start:
            spans.append(
                PromptSpan(
                    batch_index=index,
                    first_hidden=int(inputs.query_start_loc[index]),
                    first_position=start + 1,
                    targets=batch.token_ids[row, start + 1 : end + 1],
                    num_top=int(batch.num_prompt_logprobs[row]),
                )
            )
    return spans


def compute_prompt_logprobs(
    spans: list[PromptSpan], hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> dict[int, PromptLogprobs]:
    """Per batch index, the logprobs of its span's tokens and their top alternatives under the
    model's raw distribution. ``compute_logits`` may be collective (TP): every rank calls it
    alike, since every rank has the same spans."""
    result = {}
    for span in spans:
        ids, values = [], []
        targets = torch.from_numpy(span.targets).to(hidden.device)
        for start in range(0, len(targets), POSITIONS_PER_SLICE):
            stop = min(start + POSITIONS_PER_SLICE, len(targets))
            logits = compute_logits(hidden[span.first_hidden + start : span.first_hidden + stop])
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            own = targets[start:stop, None]
            top_values, top_ids = logprobs.topk(span.num_top, dim=-1)
            ids.append(torch.cat((own, top_ids), dim=1))
            values.append(torch.cat((logprobs.gather(1, own), top_values), dim=1))
        result[span.batch_index] = PromptLogprobs(
            first_position=span.first_position,
            width=span.num_top + 1,
            token_ids=torch.cat(ids).to(torch.int32).cpu().numpy().tobytes(),
            logprobs=torch.cat(values).cpu().numpy().tobytes(),
        )
    return result
