"""Runs one step for one rank: apply the scheduler's diff to the persistent batch, build the
inputs, run the model over the paged KV cache, sample."""

import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from strata.connector.offloading_worker import OffloadingConnectorWorker
from strata.engine_core.protocol import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput, pack_tokens, unpack_tokens
from strata.kernels import cpu_attention
from strata.worker.attention import AttentionBackend, AttentionMetadata, get_attention_backend, kv_cache_dtype
from strata.worker.config import WorkerConfig
from strata.worker.cpu_memory import check_kv_cache_fits, keep_freed_memory, move_weights_to_huge_pages, zeroed_cpu_tensor
from strata.worker.cuda_graphs import CudaGraphRunner, graph_batch_sizes
from strata.worker.draft_proposer import DraftProposer, scratch_blocks_per_row
from strata.worker.draft_verification import DraftLayout
from strata.worker.input_batch import InputBatch, StepInputs, to_device
from strata.worker.kv_cache_sizing import KVCacheSizer
from strata.worker.lora import LoRAStep, attach_lora_pools
from strata.worker.lora_slots import LoRASlots
from strata.worker.cpu_linear_plan import (
    apply_cpu_linear_plan, apply_quantized_linear_plan, plan_cpu_linears, plan_quantized_linears,
)
from strata.worker.model_config import read_model_config
from strata.worker.model_loader import load_model, quantized_weights_file, resolve_dtype, weight_bytes
from strata.worker.parallel_state import TensorParallel
from strata.worker.llama import LlamaForCausalLM
from strata.worker.pipeline_parallel import WHOLE_MODEL, PipelineStage, SampledTokenFeed, StageLink
from strata.worker.prompt_logprobs import compute_prompt_logprobs, prompt_spans
from strata.worker.sampler import RandomSampling, SamplingMetadata, sample
from strata.worker.scaled_weights import scaled_scheme

logger = logging.getLogger(__name__)

# Longest an empty step waits for a KV transfer: requests that arrive meanwhile wait this long.
IDLE_TRANSFER_WAIT_S = 0.02


class ModelRunner:
    """Owns the model, this rank's KV cache and the persistent batch. With a pipeline ``link``
    it runs its stage's layers: a stage after the first takes its input from the previous
    stage, one before the last hands its output on and samples nothing."""

    def __init__(self, config: WorkerConfig, tp: TensorParallel, link: StageLink | None = None) -> None:
        self.config = config
        self.tp = tp
        self.link = link
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        else:
            torch.cuda.set_device(self.device)  # Triton and graph capture use the current device
        self.dtype, reason = resolve_dtype(config.dtype, self.device)
        self.backend = get_attention_backend(config.attention_backend, self.device)
        self.cache_dtype = kv_cache_dtype(self.backend, self.dtype, config.kv_cache_dtype, self.device)
        logger.info("rank %d: dtype %s (%s), KV cache %s", tp.rank, self.dtype, reason, self.cache_dtype)
        if self.backend.name == "cpu":
            chunks = cpu_attention.chunk_body(self.dtype, self.cache_dtype)
            logger.info("rank %d: attention of long prefill chunks: %s", tp.rank, chunks)
        stage = link.stage if link is not None else WHOLE_MODEL
        self.model = load_rank_model(config, tp, self.dtype, self.backend, self.device, config.model, config.gguf_file, stage)
        self.lora = lora_slots(config, tp, self.model, self.dtype, self.device)
        self.block_size = config.block_size
        draft = None
        if config.speculative_model is not None:
            draft = load_rank_model(
                config, tp, self.dtype, self.backend, self.device, config.speculative_model,
                config.speculative_gguf_file, WHOLE_MODEL, config.speculative_draft_layers,
            )
        sizer = KVCacheSizer(config, tp, self.model, self.cache_dtype, self.device, draft)
        graph_sizes = cuda_graph_sizes(config, tp, self.device, self.backend)
        self.num_blocks = sizer.num_blocks(graph_sizes)
        if self.device.type == "cpu":
            check_kv_cache_fits(self.num_blocks * sizer.bytes_per_block())
        self.kv_caches = self._kv_caches(self.model, self.num_blocks)
        # Handles go up to twice max_num_seqs (finished handles are reserved for a step).
        num_batch_rows = 2 * config.max_num_seqs
        self.drafter = None
        if draft is not None:
            scratch = config.max_num_seqs * scratch_blocks_per_row(config.num_speculative_tokens, self.block_size)
            self.drafter = DraftProposer(
                draft, self._kv_caches(draft, self.num_blocks + scratch), self.num_blocks, self.block_size,
                config.num_speculative_tokens, num_batch_rows, config.max_num_seqs, config.max_num_batched_tokens,
                self.device,
            )
            logger.info(
                "rank %d: draft model: %d layers, %.1f MB of weights, its KV cache %.1f MB",
                tp.rank, draft.num_layers, weight_bytes(draft) / 1e6,
                (self.num_blocks + scratch) * sizer.model_bytes_per_block(draft) / 1e6,
            )
        self.graphs = None
        if graph_sizes:
            self.graphs = CudaGraphRunner(
                self.model, self.kv_caches, graph_sizes, config.max_model_len, self.block_size, self.device
            )
            self.graphs.capture()
        self.batch = InputBatch(num_batch_rows, config.max_model_len, self.block_size)
        # A stage before the last samples nothing: the last stage's tokens come over the link.
        self.feed = SampledTokenFeed(link, self.batch) if link is not None and not link.stage.is_last else None
        self.num_cpu_blocks = sizer.num_offload_blocks()
        self.offload = None
        if self.num_cpu_blocks:
            factor = (config.kv_offload_block_size or self.block_size) // self.block_size
            self.offload = OffloadingConnectorWorker(self.kv_caches, self.num_cpu_blocks * factor)

    def _kv_caches(self, model: LlamaForCausalLM, num_blocks: int) -> list[torch.Tensor]:
        """One paged cache per layer of ``model``, ``num_blocks`` blocks each."""
        shape = (2, num_blocks, self.block_size, model.num_kv_heads_per_rank, model.head_dim)
        if self.device.type == "cpu":
            return [zeroed_cpu_tensor(shape, self.cache_dtype, commit=True) for _ in range(model.num_layers)]
        return [torch.zeros(shape, dtype=self.cache_dtype, device=self.device) for _ in range(model.num_layers)]

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput, grammar_bitmask: Callable[[], bytes] | None = None) -> ModelRunnerOutput:
        """Run the step; ``grammar_bitmask`` gives the masks of ``step.structured_rows``, asked
        for only once the logits are computed (the EngineCore fills them meanwhile)."""
        rows, num_scheduled, drafts = self._update_batch(step)
        lora_load_errors = self.lora.load(step.lora_loads) if self.lora is not None else {}
        if self.offload is not None:
            self.offload.start_transfers(step.kv_connector_metadata)
        output = self._run(step, rows, num_scheduled, drafts, grammar_bitmask)
        output.lora_load_errors = lora_load_errors
        return output

    def _run(
        self,
        step: SchedulerOutput,
        rows: np.ndarray,
        num_scheduled: np.ndarray,
        drafts: dict[int, np.ndarray],
        grammar_bitmask: Callable[[], bytes] | None,
    ) -> ModelRunnerOutput:
        """The forward pass of the step's rows, and their sampling on the last stage."""
        if len(rows) == 0:
            if self.offload is not None:
                # Every request waits for a transfer: wait for one here rather than have the
                # engine spin through empty steps (which, in one process, starve the copy
                # thread of the GIL).
                self.offload.wait_for_progress(IDLE_TRANSFER_WAIT_S)
            return ModelRunnerOutput(step=step.step, rank=self.config.rank, kv_connector_output=self._finished_transfers())
        inputs = self.batch.prepare(rows, num_scheduled)
        lora_active = False
        if self.lora is not None:
            self.lora.step.begin(inputs.lora_slots)
            lora_active = self.lora.step.active
        # The graphs were captured without adapter deltas: steps with adapter rows run eagerly.
        graph_size = self.graphs.size_for(num_scheduled) if self.graphs is not None and not lora_active else None
        if graph_size is not None:
            # Decode-only, one token per row: the last hidden states are all the hidden states.
            hidden = last_hidden = self.graphs.run(inputs, graph_size)
        else:
            stage_input = self.model.stage_input_buffer(len(inputs.token_ids))
            if stage_input is not None:
                assert self.link is not None
                self.link.receive(stage_input)
            hidden = self.model(
                self._to_device(inputs.token_ids),
                self._to_device(inputs.positions),
                self.kv_caches,
                self._attention_metadata(inputs),
                stage_input,
            )
            if not self.model.stage.is_last:
                assert self.link is not None
                self.link.send(hidden)
                self.batch.advance_computed(rows, num_scheduled)
                assert self.feed is not None
                self.feed.step_ran(step.step, rows)
                return ModelRunnerOutput(step=step.step, rank=self.config.rank, kv_connector_output=self._finished_transfers())
            # With one token per row, each hidden state is its row's last.
            last_hidden = hidden if len(inputs.token_ids) == len(rows) else hidden[self._to_device(inputs.query_start_loc[1:] - 1)]
        spans = prompt_spans(self.batch, inputs)
        prompt_logprobs = compute_prompt_logprobs(spans, hidden, self.model.compute_logits) if spans else {}
        layout = None
        if drafts:
            num_drafts = np.zeros(len(rows), dtype=np.int64)
            num_drafts[list(drafts)] = [len(row_drafts) for row_drafts in drafts.values()]
            layout = DraftLayout.build(inputs.query_start_loc, num_drafts)
            last_hidden = hidden[self._to_device(layout.hidden_index)]  # every position to sample
        logits = self.model.compute_logits(last_hidden)
        meta = self._sampling_metadata(inputs, layout)
        if step.structured_rows:
            assert grammar_bitmask is not None, "a step with structured rows needs their bitmask"
            structured = np.frombuffer(step.structured_rows, dtype=np.uint16).astype(np.int64)
            meta.grammar_rows = self._to_device(structured if layout is None else layout.logits_rows(structured))
            words = np.frombuffer(grammar_bitmask(), dtype=np.int32).reshape(len(meta.grammar_rows), -1).copy()
            meta.grammar_bitmask = self._to_device(words)
        tokens, logprobs = sample(logits, meta)
        sampled = (tokens if tokens.device.type == "cpu" else tokens.cpu()).numpy()
        produced: dict[int, list[int]] = {}
        if layout is not None:
            produced = layout.verify(sampled, drafts)
            row_logprobs = layout.logprobs_by_row(logprobs, produced)
            sampled = sampled[layout.starts]
        else:
            row_logprobs = {row: [value] for row, value in logprobs.items()}
        done = self.batch.advance(rows, num_scheduled, sampled)
        for index, row_tokens in produced.items():
            self.batch.accept(int(rows[index]), row_tokens)
        if self.link is not None and self.model.stage.size > 1:
            self._send_sampled(done, sampled, produced)
        draft_token_ids = self._propose_drafts(rows, done, produced) if self.drafter is not None and step.propose_drafts else {}
        return ModelRunnerOutput(
            step=step.step,
            rank=self.config.rank,
            sampled_token_ids=pack_tokens(sampled.tolist()),
            logprobs=row_logprobs,
            kv_connector_output=self._finished_transfers(),
            prompt_logprobs=prompt_logprobs,
            verified_token_ids={index: pack_tokens(row_tokens) for index, row_tokens in produced.items()},
            draft_token_ids=draft_token_ids,
        )

    def _propose_drafts(self, rows: np.ndarray, done: np.ndarray, produced: dict[int, list[int]]) -> dict[int, bytes]:
        """The draft model's drafts, by batch position, for the rows that gained tokens this step
        (a sampled token, or a verified step's). Every rank runs the draft (its TP shard); only
        the first sends them, the one the executor reads tokens from."""
        assert self.drafter is not None
        gained = done.copy()
        gained[list(produced)] = True
        positions = np.flatnonzero(gained)
        if len(positions) == 0:
            return {}
        drafts = self.drafter.propose(self.batch, rows[positions])
        if self.tp.rank != 0:
            return {}
        # The first len(drafts) rows proposed; the others are still catching up.
        return {int(position): pack_tokens(row_drafts) for position, row_drafts in zip(positions, drafts.tolist())}

    def _send_sampled(self, done: np.ndarray, sampled: np.ndarray, produced: dict[int, list[int]]) -> None:
        """The last stage tells the earlier ones what each row gained: the sampled token where
        the row's tokens were all computed, every produced token where it verified drafts."""
        assert self.link is not None
        counts = done.astype(np.int32)
        if not produced:
            self.link.send_sampled(counts, sampled[done])
            return
        gained = [[int(token)] if row_done else [] for token, row_done in zip(sampled, done)]
        for index, row_tokens in produced.items():
            counts[index] = len(row_tokens)
            gained[index] = row_tokens
        self.link.send_sampled(counts, np.fromiter((t for row in gained for t in row), dtype=np.int32))

    def _finished_transfers(self) -> KVConnectorOutput | None:
        return None if self.offload is None else self.offload.get_finished()

    def shutdown(self) -> None:
        if self.offload is not None:
            self.offload.shutdown()

    def _update_batch(self, step: SchedulerOutput) -> tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]:
        """Apply the step's diff; return the scheduled rows and their token counts, in batch
        order, and the drafts to verify by batch position."""
        for handle in step.finished_handles + step.preempted_handles:
            self.batch.remove(handle)
        if self.feed is not None:
            self.feed.catch_up(step.collected_step)
        for new in step.new_requests:
            self.batch.add(new)
            if self.drafter is not None:
                self.drafter.row_added(new.handle)
            if self.feed is not None:
                self.feed.row_added(new.handle, step.step)
        for handle, count in step.cached.kept_blocks.items():
            self.batch.keep_blocks(handle, count)
        for handle, block_ids in step.cached.new_block_ids.items():
            self.batch.append_blocks(handle, block_ids)
        cached = np.frombuffer(step.cached.handles, dtype=np.uint16).astype(np.int64)
        rows = np.concatenate(([new.handle for new in step.new_requests], cached)).astype(np.int64)
        num_scheduled = np.ones(len(rows), dtype=np.int64)
        num_scheduled[: len(step.new_requests)] = [new.num_scheduled_tokens for new in step.new_requests]
        drafts: dict[int, np.ndarray] = {}
        if step.cached.num_tokens:
            position = {handle: i for i, handle in enumerate(cached.tolist())}
            offset = len(step.new_requests)
            for handle, count in step.cached.num_tokens.items():
                num_scheduled[offset + position[handle]] = count
            for handle, packed in step.cached.draft_token_ids.items():
                drafts[offset + position[handle]] = row_drafts = np.asarray(unpack_tokens(packed), dtype=np.int64)
                self.batch.place_drafts(handle, row_drafts)
        return rows, num_scheduled, drafts

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    def _attention_metadata(self, inputs: StepInputs) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self._to_device(inputs.slot_mapping),
            block_tables=self._to_device(inputs.block_tables),
            query_start_loc=self._to_device(inputs.query_start_loc.astype(np.int32)),
            seq_lens=self._to_device(inputs.seq_lens.astype(np.int32)),
            max_query_len=int(inputs.num_scheduled.max()),
            max_seq_len=int(inputs.seq_lens.max()),
        )

    def _sampling_metadata(self, inputs: StepInputs, layout: DraftLayout | None) -> SamplingMetadata:
        """One row per logits row: a batch row's, or with drafts one per position it samples."""
        batch = self.batch
        rows = inputs.rows if layout is None else inputs.rows[layout.batch_index]
        temperature = batch.temperature[rows]
        at_random, extras = bool(temperature.any()), bool(batch.sampling_extras[rows].any())
        meta = SamplingMetadata()
        if not (at_random or extras):
            return meta  # plain greedy rows: the logits are all the sampler needs
        num_known = batch.num_tokens[inputs.rows]  # the tokens before each logits row's position
        if layout is not None:
            # A draft position sees the drafts before it as output, as a one-token step there would.
            num_known = num_known[layout.batch_index] + layout.offsets
        num_output = num_known - batch.num_prompt[rows]
        if at_random:
            meta.random = self._random_sampling(rows, temperature, num_output)
        if extras:
            self._add_extras(meta, inputs, layout, rows, num_known, num_output)
        return meta

    def _random_sampling(self, rows: np.ndarray, temperature: np.ndarray, num_output: np.ndarray) -> RandomSampling:
        batch, vocab = self.batch, self.model.vocab_size
        top_k = batch.top_k[rows]
        top_p = batch.top_p[rows]
        min_p = batch.min_p[rows]
        return RandomSampling(
            temperature=self._to_device(temperature),
            top_k=self._to_device(np.where(top_k > 0, np.minimum(top_k, vocab), vocab)),
            top_p=self._to_device(top_p),
            min_p=self._to_device(min_p),
            seeds=self._to_device(batch.seed[rows]),
            output_positions=self._to_device(num_output),
            need_top_k=bool(((top_k > 0) & (top_k < vocab)).any()),
            need_top_p=bool((top_p < 1).any()),
            need_min_p=bool((min_p > 0).any()),
        )

    def _add_extras(
        self,
        meta: SamplingMetadata,
        inputs: StepInputs,
        layout: DraftLayout | None,
        rows: np.ndarray,
        num_known: np.ndarray,
        num_output: np.ndarray,
    ) -> None:
        """The penalties, min_tokens bans, logprob requests and logit biases of the logits
        rows (``rows``, their batch rows) that have them."""
        batch, vocab = self.batch, self.model.vocab_size
        penalised = (batch.presence_penalty[rows] != 0) | (batch.frequency_penalty[rows] != 0) | (batch.repetition_penalty[rows] != 1)
        if penalised.any():
            self._add_penalties(meta, rows, num_known)
        banned = [
            (i, batch.stop_token_ids[row])
            for i, row in enumerate(rows.tolist())
            if num_output[i] < batch.min_tokens[row] and batch.stop_token_ids[row]
        ]
        meta.banned_tokens = banned or None
        # A row verifying drafts is scheduled its last token and the drafts placed after it.
        pending = batch.num_tokens[inputs.rows] if layout is None else batch.num_tokens[inputs.rows] + layout.num_drafts
        ends_its_tokens = batch.num_computed[inputs.rows] + inputs.num_scheduled == pending
        if layout is not None:
            ends_its_tokens = ends_its_tokens[layout.batch_index]
        # A partial prefill chunk's sampled token is thrown away, and so would its logprobs be.
        wanted = [
            (i, min(int(batch.num_logprobs[row]), vocab))
            for i, row in enumerate(rows.tolist())
            if batch.num_logprobs[row] >= 0 and ends_its_tokens[i]
        ]
        meta.logprob_rows = wanted or None
        biased = [(i, batch.logit_bias[row]) for i, row in enumerate(rows.tolist()) if batch.logit_bias[row]]
        meta.logit_bias = biased or None

    def _add_penalties(self, meta: SamplingMetadata, rows: np.ndarray, num_known: np.ndarray) -> None:
        """Token counts for the penalties of each logits row: its batch row's first
        ``num_known`` tokens (drafts are placed after a row's tokens, so a draft position's
        count includes the drafts before it)."""
        batch = self.batch
        longest = int(num_known.max())
        tokens = self._to_device(batch.token_ids[rows, :longest])
        column = torch.arange(longest, device=self.device)[None, :]
        known = column < self._to_device(num_known)[:, None]
        is_output = known & (column >= self._to_device(batch.num_prompt[rows])[:, None])
        vocab = self.model.vocab_size
        counts = torch.zeros(len(rows), vocab, device=self.device)
        counts.scatter_add_(1, tokens, is_output.float())
        seen = torch.zeros(len(rows), vocab, device=self.device)
        seen.scatter_add_(1, tokens, known.float())
        meta.output_token_counts = counts
        meta.seen_token_mask = seen > 0
        meta.presence_penalty = self._to_device(batch.presence_penalty[rows])
        meta.frequency_penalty = self._to_device(batch.frequency_penalty[rows])
        meta.repetition_penalty = self._to_device(batch.repetition_penalty[rows])


def load_rank_model(
    config: WorkerConfig,
    tp: TensorParallel,
    dtype: torch.dtype,
    backend: AttentionBackend,
    device: torch.device,
    model_dir: str,
    gguf_file: str | None,
    stage: PipelineStage,
    num_layers: int | None = None,
) -> LlamaForCausalLM:
    """This rank's shard of the model in ``model_dir`` (its first ``num_layers`` decoder layers
    if given), its linears held as ``config.quantization`` and the CPU's plans say: the target,
    or a speculative draft."""
    blocks_from = quantized_weights_file(config.quantization, gguf_file, device)
    scaled = scaled_scheme(config.quantization, Path(model_dir), device)
    model = load_model(model_dir, dtype, tp, backend, device, config.load_format, blocks_from, scaled, stage, num_layers)
    logger.info("rank %d: %s: weights hold %.1f MB", tp.rank, model_dir, weight_bytes(model) / 1e6)
    if device.type == "cpu":
        # Before the plans: the fused layers take the weights' addresses.
        moved = move_weights_to_huge_pages(model)
        logger.info("rank %d: %.1f MB of weights moved to memory advised for huge pages", tp.rank, moved / 1e6)
    if scaled is not None:
        logger.info("rank %d: linears: %s", tp.rank, scaled.describe())
    # The CPU plan chooses among ways to hold float weights, which 8-bit linears no longer have.
    cpu_plan = None
    if scaled is None:
        cpu_plan = plan_cpu_linears(config.cpu_bf16_linear, model, dtype, device, tp)
    if cpu_plan is not None:
        apply_cpu_linear_plan(model, cpu_plan)
        logger.info("rank %d: linears: %s", tp.rank, cpu_plan.describe())
    quantized_plan = plan_quantized_linears(model, dtype, tp)
    if quantized_plan is not None:
        assert blocks_from is not None
        apply_quantized_linear_plan(model, quantized_plan)
        logger.info("rank %d: GGUF-block linears (%s): %s", tp.rank, blocks_from.name, quantized_plan.describe())
    return model


def cuda_graph_sizes(config: WorkerConfig, tp: TensorParallel, device: torch.device, backend: AttentionBackend) -> list[int]:
    """The decode batch sizes to capture CUDA graphs for; none off CUDA, with ``enforce_eager``,
    when the attention backend cannot be captured, or when the TP group's collectives cannot be
    captured (gloo)."""
    if device.type != "cuda" or config.enforce_eager:
        return []
    if not backend.graph_capturable:
        logger.info("rank %d: no CUDA graphs: the %s attention backend cannot be captured", tp.rank, backend.name)
        return []
    if config.pipeline_parallel_size > 1:
        logger.info("rank %d: no CUDA graphs: pipeline stages hand hidden states on outside the graph", config.rank)
        return []
    if tp.size > 1 and dist.get_backend(tp.group) != "nccl":
        logger.info("rank %d: no CUDA graphs: %s collectives cannot be captured", tp.rank, dist.get_backend(tp.group))
        return []
    return graph_batch_sizes(config.max_num_seqs, config.cuda_graph_sizes)


def lora_slots(
    config: WorkerConfig, tp: TensorParallel, model: torch.nn.Module, dtype: torch.dtype, device: torch.device
) -> LoRASlots | None:
    """With ``enable_lora``, adapter pools in the model's linears and the cache to fill them from."""
    if not config.enable_lora:
        return None
    step = LoRAStep(config.max_loras, config.max_lora_rank, dtype, device)
    targets = attach_lora_pools(model, step)
    model_config = read_model_config(config.model)
    max_cached = config.max_loras if config.max_cpu_loras is None else config.max_cpu_loras
    logger.info(
        "rank %d: LoRA: %d slots of rank %d in %d linears (%.1f MB), %d adapters cached in CPU memory",
        tp.rank, config.max_loras, config.max_lora_rank, len(targets),
        sum(t.pool.a.nbytes + t.pool.b.nbytes for t in targets) / 1e6, max_cached,
    )
    return LoRASlots(targets, step, model_config, config.max_lora_rank, max_cached)


def default_num_threads(num_ranks: int) -> int:
    """Torch threads per rank: honour OMP_NUM_THREADS, else share the cores among the ``num_ranks`` ranks."""
    if "OMP_NUM_THREADS" in os.environ:
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, (os.cpu_count() or 1) // num_ranks)
