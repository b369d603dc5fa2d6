"""A pipeline stage holds and reads its own layers only: the first the embedding, the last the
norm and head; chained, the stages of each Llama-decoder family compute the whole model; the
balanced split gives earlier stages the remainder; a stage before the last takes in the tokens
the last stage sampled."""

import numpy as np
import pytest
import torch

from strata.engine_core.protocol import NewRequestData
from strata.engine_core.sampling_params import SamplingParams
from strata.worker.attention import TorchAttentionBackend
from strata.worker.model_loader import dummy_weights, load_model
from strata.worker.parallel_state import TensorParallel
from strata.worker.input_batch import InputBatch
from strata.worker.pipeline_parallel import PipelineStage, SampledTokenFeed, split_layers
from strata.worker.model_registry import model_class

from model_factory import (
    random_prompts,
    read_as_saved,
    save_tiny_model,
    tiny_llama_config,
    tiny_mixtral_config,
    tiny_qwen3_config,
)
from worker_helpers import PagedRunner, greedy_decode


class ReadRecorder:
    """A checkpoint source that records whether any part of it was read."""

    def __init__(self, source, reads: set[str], name: str) -> None:
        self.source, self.reads, self.name = source, reads, name
        self.shape = source.shape

    def __getitem__(self, index):
        self.reads.add(self.name)
        return self.source[index]


def stage_model(stage: PipelineStage, **overrides):
    config = read_as_saved(tiny_llama_config(num_hidden_layers=4, **overrides))
    model = model_class(config.model_type, config.architectures)(config, TensorParallel(0, 1), TorchAttentionBackend(), stage)
    reads: set[str] = set()
    model.load_weights((name, ReadRecorder(source, reads, name)) for name, source in dummy_weights(config, torch.float32, "cpu"))
    return model, reads


def test_the_balanced_split_gives_earlier_stages_the_remainder():
    assert split_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]


def test_a_partition_names_each_stages_layer_count():
    assert split_layers(4, 2, [1, 3]) == [range(0, 1), range(1, 4)]


def test_more_stages_than_layers_are_refused():
    with pytest.raises(ValueError, match="2 decoder layers cannot fill 3 pipeline stages"):
        split_layers(2, 3)


def test_the_first_stage_reads_the_embedding_and_its_layers_only():
    model, reads = stage_model(PipelineStage(0, 2))
    assert model.num_layers == 2 and not hasattr(model, "lm_head")
    assert {name.split(".")[2] for name in reads if name.startswith("model.layers.")} == {"0", "1"}
    assert "model.embed_tokens.weight" in reads and "model.norm.weight" not in reads


def test_the_last_stage_reads_its_layers_the_norm_and_the_head_only():
    model, reads = stage_model(PipelineStage(1, 2, (1, 3)))
    assert model.num_layers == 3
    assert {name.split(".")[2] for name in reads if name.startswith("model.layers.")} == {"1", "2", "3"}
    assert {"model.norm.weight", "lm_head.weight"} <= reads and "model.embed_tokens.weight" not in reads


def test_a_last_stage_with_a_tied_head_reads_the_embedding_as_its_head():
    model, reads = stage_model(PipelineStage(1, 2), tie_word_embeddings=True)
    assert "model.embed_tokens.weight" in reads
    assert model.lm_head.weight is model.model.embed_tokens.weight


class ScriptedLink:
    """Hands out the (counts, tokens) the last stage would have sent, in order."""

    def __init__(self, messages: list[tuple[list[int], list[int]]]) -> None:
        self.messages = messages

    def receive_sampled(self, num_rows: int):
        counts, tokens = self.messages.pop(0)
        assert len(counts) == num_rows
        return np.array(counts), np.array(tokens, dtype=np.int32)


def request_row(handle: int, prompt: list[int], num_scheduled: int) -> NewRequestData:
    return NewRequestData(f"r{handle}", handle, prompt, [], SamplingParams(), None, [0, 1], 0, num_scheduled)


def test_a_stage_before_the_last_appends_sampled_and_verified_tokens_and_leaves_the_last_uncomputed():
    batch = InputBatch(4, 64, 16)
    feed = SampledTokenFeed(ScriptedLink([([1, 0], [40]), ([3], [41, 42, 43])]), batch)
    for handle, prompt in ((0, [5, 6, 7]), (1, [8, 9, 10, 11, 12])):
        batch.add(request_row(handle, prompt, 3))
        feed.row_added(handle, 1)
    rows = np.array([0, 1])
    batch.advance_computed(rows, np.array([3, 3]))  # row 0 ends its prompt; row 1 is mid-prompt
    feed.step_ran(1, rows)
    feed.catch_up(1)
    assert batch.token_ids[0, :4].tolist() == [5, 6, 7, 40] and (batch.num_tokens[0], batch.num_computed[0]) == (4, 3)
    assert (batch.num_tokens[1], batch.num_computed[1]) == (5, 3)
    batch.advance_computed(np.array([0]), np.array([3]))  # its last token and two drafts, one accepted
    feed.step_ran(2, np.array([0]))
    feed.catch_up(2)
    assert batch.token_ids[0, :7].tolist() == [5, 6, 7, 40, 41, 42, 43] and batch.num_computed[0] == 6


def test_tokens_sampled_for_a_handle_s_earlier_request_skip_the_request_that_took_it():
    batch = InputBatch(4, 64, 16)
    feed = SampledTokenFeed(ScriptedLink([([1], [40])]), batch)
    batch.add(request_row(0, [5, 6, 7], 3))
    feed.row_added(0, 1)
    batch.advance_computed(np.array([0]), np.array([3]))
    feed.step_ran(1, np.array([0]))
    batch.add(request_row(0, [20, 21], 2))  # step 1's request was aborted; step 2 reuses its handle
    feed.row_added(0, 2)
    feed.catch_up(1)
    assert (batch.num_tokens[0], batch.num_computed[0]) == (2, 0) and batch.token_ids[0, :2].tolist() == [20, 21]


class ChainedStages(torch.nn.Module):
    """Two stage models run one after the other, with the model interface ``PagedRunner`` drives."""

    def __init__(self, first: torch.nn.Module, last: torch.nn.Module) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.num_layers = first.num_layers + last.num_layers
        self.num_kv_heads_per_rank, self.head_dim = last.num_kv_heads_per_rank, last.head_dim

    def forward(self, input_ids, positions, kv_caches, meta):
        handed_over = self.first(input_ids, positions, kv_caches[: self.first.num_layers], meta)
        return self.last(input_ids, positions, kv_caches[self.first.num_layers :], meta, handed_over)

    def compute_logits(self, hidden):
        return self.last.compute_logits(hidden)


@pytest.mark.parametrize("make_config", [tiny_llama_config, tiny_qwen3_config, tiny_mixtral_config])
def test_two_chained_stages_give_the_whole_models_logits(make_config, tmp_path):
    config = make_config()
    save_tiny_model(config, tmp_path)
    prompts = random_prompts([6, 11], config.vocab_size)

    def load(stage: PipelineStage):
        return load_model(tmp_path, torch.float32, TensorParallel(0, 1), TorchAttentionBackend(), "cpu", stage=stage)

    whole_tokens, whole_logits = greedy_decode(PagedRunner(load(PipelineStage())), prompts, 4)
    chained = ChainedStages(load(PipelineStage(0, 2)), load(PipelineStage(1, 2)))
    tokens, logits = greedy_decode(PagedRunner(chained), prompts, 4)
    assert tokens == whole_tokens
    torch.testing.assert_close(logits, whole_logits, rtol=0, atol=1e-5)
