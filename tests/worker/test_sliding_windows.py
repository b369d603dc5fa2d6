"""Each layer's sliding window is read from the config as HF transformers reads it."""

from transformers import Qwen2Config

from strata.worker.llama import sliding_windows

from model_factory import tiny_gemma3_config, tiny_llama_config, tiny_mistral_config


def test_llama_attends_over_everything():
    assert sliding_windows(tiny_llama_config()) == [None, None]


def test_mistral_windows_every_layer():
    assert sliding_windows(tiny_mistral_config(sliding_window=4096)) == [4096, 4096]


def test_qwen2_window_is_off_unless_enabled():
    assert sliding_windows(Qwen2Config(num_hidden_layers=3, use_sliding_window=False, sliding_window=4096)) == [None] * 3


def test_qwen2_windows_the_layers_from_max_window_layers_on():
    config = Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=64, max_window_layers=1)
    assert sliding_windows(config) == [None, 64, 64]


def test_gemma3_windows_its_local_layers():
    assert sliding_windows(tiny_gemma3_config()) == [8, None, 8, 8]
