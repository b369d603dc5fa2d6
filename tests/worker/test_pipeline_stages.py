"""A pipeline stage holds and reads its own layers only: the first the embedding, the last the
norm and head; the balanced split gives earlier stages the remainder."""

import pytest
import torch

from strata.worker.attention import TorchAttentionBackend
from strata.worker.model_loader import dummy_weights
from strata.worker.parallel_state import TensorParallel
from strata.worker.pipeline_parallel import PipelineStage, split_layers
from strata.worker.model_registry import model_class

from model_factory import tiny_llama_config


class ReadRecorder:
    """A checkpoint source that records whether any part of it was read."""

    def __init__(self, source, reads: set[str], name: str) -> None:
        self.source, self.reads, self.name = source, reads, name
        self.shape = source.shape

    def __getitem__(self, index):
        self.reads.add(self.name)
        return self.source[index]


def stage_model(stage: PipelineStage, **overrides):
    config = tiny_llama_config(num_hidden_layers=4, **overrides)
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
