"""Each layer's sliding window is read from the config as HF transformers reads it, and reaches
the layer's attention in every family."""

import pytest
import torch
from transformers import MixtralConfig, PreTrainedConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from strata.worker.attention import TorchAttentionBackend
from strata.worker.llama import sliding_windows
from strata.worker.model_registry import model_class

from model_factory import read_as_saved, tiny_gemma3_config, tiny_llama_config, tiny_mistral_config
from worker_helpers import SINGLE_RANK


def test_llama_attends_over_everything():
    assert sliding_windows(read_as_saved(tiny_llama_config())) == [None, None]


def test_mistral_windows_every_layer():
    assert sliding_windows(read_as_saved(tiny_mistral_config(sliding_window=4096))) == [4096, 4096]


def test_qwen2_window_is_off_unless_enabled():
    config = Qwen2Config(num_hidden_layers=3, use_sliding_window=False, sliding_window=4096)
    assert sliding_windows(read_as_saved(config)) == [None] * 3


def test_qwen2_windows_the_layers_from_max_window_layers_on():
    config = Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=64, max_window_layers=1)
    assert sliding_windows(read_as_saved(config)) == [None, 64, 64]


def test_gemma3_windows_its_local_layers():
    assert sliding_windows(read_as_saved(tiny_gemma3_config())) == [8, None, 8, 8]


_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize(
    "config,windows",
    [
        (Qwen3Config(**_SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=1), [None, 8, 8]),
        (Qwen3MoeConfig(**_SMALL, use_sliding_window=True, sliding_window=8), [8, 8, 8]),
        (MixtralConfig(**_SMALL, sliding_window=8), [8, 8, 8]),
    ],
    ids=["qwen3", "qwen3_moe", "mixtral"],
)
def test_each_family_gives_its_layers_their_windows(config: PreTrainedConfig, windows: list[int | None]) -> None:
    with torch.device("meta"):  # shapes only: no memory, no weights
        model = model_class(config.model_type, None)(read_as_saved(config), SINGLE_RANK, TorchAttentionBackend())
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == windows
