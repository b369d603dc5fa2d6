"""The persistent batch: per-request state the worker keeps between steps, one row per handle.

A request's prompt, sampling parameters and block table arrive once (``NewRequestData``);
afterwards each step only names its handle, and the worker appends the tokens it sampled
itself. Rows are numpy arrays so a step's inputs are built with vectorised gathers;
``to_device`` hands them to the model.
"""

from dataclasses import dataclass

import numpy as np
import torch

from strata.engine_core.block_hash import hash_block, ROOT_HASH
from strata.engine_core.protocol import NewRequestData


@dataclass
class StepInputs:
    """A step's flattened inputs (host arrays, batch order)."""

    rows: np.ndarray  # [B] persistent-batch rows (= handles)
    num_scheduled: np.ndarray  # [B]
    token_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [B + 1]
    seq_lens: np.ndarray  # [B]
    block_tables: np.ndarray  # [B, max blocks used this step]
    lora_slots: np.ndarray  # [T] the LoRA slot each token uses, -1: the base model


class InputBatch:
    def __init__(self, num_rows: int, max_model_len: int, block_size: int) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        max_blocks = -(-max_model_len // block_size)
        # One spare column: a prompt of max_model_len tokens still samples one token.
        self.token_ids = np.zeros((num_rows, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(num_rows, dtype=np.int64)
        self.num_prompt = np.zeros(num_rows, dtype=np.int64)
        self.num_computed = np.zeros(num_rows, dtype=np.int64)
        self.block_table = np.zeros((num_rows, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(num_rows, dtype=np.int64)
        self.temperature = np.ones(num_rows, dtype=np.float32)
        self.top_p = np.ones(num_rows, dtype=np.float32)
        self.top_k = np.zeros(num_rows, dtype=np.int64)  # 0 = disabled
        self.min_p = np.zeros(num_rows, dtype=np.float32)
        self.seed = np.zeros(num_rows, dtype=np.int64)
        self.presence_penalty = np.zeros(num_rows, dtype=np.float32)
        self.frequency_penalty = np.zeros(num_rows, dtype=np.float32)
        self.repetition_penalty = np.ones(num_rows, dtype=np.float32)
        self.min_tokens = np.zeros(num_rows, dtype=np.int64)
        self.num_logprobs = np.full(num_rows, -1, dtype=np.int64)  # -1 = none
        self.num_prompt_logprobs = np.full(num_rows, -1, dtype=np.int64)  # -1 = none
        self.stop_token_ids: list[list[int]] = [[] for _ in range(num_rows)]
        self.logit_bias: list[dict[int, float] | None] = [None] * num_rows
        # Whether the row's sampling needs more than its logits (and random draws): a penalty,
        # min_tokens, logprobs or a logit bias.
        self.sampling_extras = np.zeros(num_rows, dtype=bool)
        self.request_ids: list[str | None] = [None] * num_rows
        self.lora_slot = np.full(num_rows, -1, dtype=np.int64)  # -1: the base model

    def add(self, new: NewRequestData) -> None:
        row = new.handle
        tokens = new.prompt_token_ids + new.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt[row] = len(new.prompt_token_ids)
        self.num_computed[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, new.block_ids)
        params = new.sampling_params
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = max(params.top_k, 0)
        self.min_p[row] = params.min_p
        self.seed[row] = params.seed if params.seed is not None else _stable_seed(new.request_id)
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        self.min_tokens[row] = params.min_tokens
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.num_prompt_logprobs[row] = -1 if params.prompt_logprobs is None else params.prompt_logprobs
        self.logit_bias[row] = params.logit_bias or None
        stop = list(params.stop_token_ids or ())
        if new.eos_token_id is not None and not params.ignore_eos:
            stop.append(new.eos_token_id)
        self.stop_token_ids[row] = stop
        self.sampling_extras[row] = bool(
            params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1
            or (params.min_tokens and stop) or params.logprobs is not None or params.logit_bias
        )
        self.request_ids[row] = new.request_id
        self.lora_slot[row] = new.lora_slot

    def remove(self, row: int) -> None:
        self.request_ids[row] = None

    def keep_blocks(self, row: int, count: int) -> None:
        """Cut the row's table to its first ``count`` blocks (the rest were given back)."""
        self.num_blocks[row] = count

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def prepare(self, rows: np.ndarray, num_scheduled: np.ndarray) -> StepInputs:
        """Flatten the scheduled rows into one ragged batch, without per-token Python."""
        ends = np.cumsum(num_scheduled)
        starts = ends - num_scheduled
        token_row = np.repeat(rows, num_scheduled)
        computed = self.num_computed[rows]
        positions = np.arange(ends[-1]) - np.repeat(starts - computed, num_scheduled)
        block_ids = self.block_table[token_row, positions // self.block_size]
        seq_lens = computed + num_scheduled
        max_blocks = -(-int(seq_lens.max()) // self.block_size)
        return StepInputs(
            rows=rows,
            num_scheduled=num_scheduled,
            token_ids=self.token_ids[token_row, positions],
            positions=positions,
            slot_mapping=block_ids.astype(np.int64) * self.block_size + positions % self.block_size,
            query_start_loc=np.concatenate(([0], ends)),
            seq_lens=seq_lens,
            block_tables=self.block_table[rows, :max_blocks],
            lora_slots=self.lora_slot[token_row],
        )

    def place_drafts(self, row: int, drafts: np.ndarray) -> None:
        """Put drafts after the row's last token, as this step's inputs; ``accept`` keeps the
        ones the step verified."""
        start = self.num_tokens[row]
        self.token_ids[row, start : start + len(drafts)] = drafts

    def accept(self, row: int, produced: list[int]) -> None:
        """A row that verified drafts: its last token and the accepted drafts are now
        computed, and every token the step produced is appended."""
        start = self.num_tokens[row]
        self.token_ids[row, start : start + len(produced)] = produced
        self.num_tokens[row] = start + len(produced)
        self.num_computed[row] = start + len(produced) - 1

    def advance_computed(self, rows: np.ndarray, num_scheduled: np.ndarray) -> None:
        """A pipeline stage before the last samples nothing: count the step's tokens as computed;
        ``append_sampled`` brings the tokens the last stage sampled."""
        self.num_computed[rows] += num_scheduled

    def append_sampled(self, rows: np.ndarray, counts: np.ndarray, tokens: np.ndarray) -> None:
        """Append the ``counts[i]`` tokens row ``rows[i]`` gained in a step (``tokens``,
        concatenated in row order): its last token is then the only one not computed, as after
        a sampled or verified step on the last stage."""
        gained = counts > 0
        if (counts <= 1).all():
            rows = rows[gained]
            ends = self.num_tokens[rows]
            self.token_ids[rows, ends] = tokens
            self.num_tokens[rows] = ends + 1
            self.num_computed[rows] = ends
            return
        starts = np.cumsum(counts) - counts
        for row, start, count in zip(rows[gained].tolist(), starts[gained].tolist(), counts[gained].tolist()):
            end = self.num_tokens[row]
            self.token_ids[row, end : end + count] = tokens[start : start + count]
            self.num_tokens[row] = end + count
            self.num_computed[row] = end + count - 1

    def advance(self, rows: np.ndarray, num_scheduled: np.ndarray, sampled: np.ndarray) -> np.ndarray:
        """Count the step's tokens as computed and append the sampled token to every row
        whose prompt (or last token) is now fully computed. Returns that row mask."""
        self.num_computed[rows] += num_scheduled
        done = self.num_computed[rows] == self.num_tokens[rows]
        done_rows = rows[done]
        self.token_ids[done_rows, self.num_tokens[done_rows]] = sampled[done]
        self.num_tokens[done_rows] += 1
        return done


def _stable_seed(request_id: str) -> int:
    """A seed every rank derives alike for a request that came without one."""
    return int.from_bytes(hash_block(ROOT_HASH, [], request_id.encode())[:8], "little") >> 1


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` as a tensor on ``device``, copied without waiting for the copy where the device allows.
    On the CPU, the array's own memory: each torch call skipped here saves tens of microseconds of
    a decode step, whose weights have just pushed torch's code and data out of the caches."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)
