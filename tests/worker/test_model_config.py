"""A checkpoint's config.json is read into the fields transformers' config class for its model
type gives (its defaults, head_dim, layer_types, rope parameters), and a worker loads a model
without importing transformers."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig, PreTrainedConfig

from strata.worker.model_config import ModelConfig, read_model_config
from strata.worker.model_loader import resolve_model_path

from model_factory import TINY_CONFIGS, tiny_gemma3_config

EVERY_MODEL_TYPE = TINY_CONFIGS | {"gemma3_text": tiny_gemma3_config}
SIZES = dict(
    vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2
)


def transformers_reading(config: PreTrainedConfig) -> dict[str, Any]:
    """What the model classes read from ``config`` when they took transformers' configs."""
    gemma3 = config.model_type == "gemma3_text"
    return dict(
        model_type=config.model_type,
        architectures=list(config.architectures or []),
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        hidden_act=config.hidden_activation if gemma3 else config.hidden_act,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters=config.rope_parameters,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=getattr(config, "attention_bias", False),
        mlp_bias=getattr(config, "mlp_bias", False),
        sliding_window=getattr(config, "sliding_window", None),
        layer_types=getattr(config, "layer_types", None),
        num_experts=getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0),
        num_experts_per_tok=getattr(config, "num_experts_per_tok", 0),
        moe_intermediate_size=getattr(config, "moe_intermediate_size", 0),
        norm_topk_prob=getattr(config, "norm_topk_prob", False),
        mlp_only_layers=list(getattr(config, "mlp_only_layers", None) or []),
        decoder_sparse_step=getattr(config, "decoder_sparse_step", 1),
        query_pre_attn_scalar=config.query_pre_attn_scalar if gemma3 else None,
        final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
        attn_logit_softcapping=getattr(config, "attn_logit_softcapping", None),
        use_bidirectional_attention=getattr(config, "use_bidirectional_attention", False),
    )


def ours(config: ModelConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__ if name != "source"}


def assert_read_as_transformers_reads(path: Path) -> None:
    assert ours(read_model_config(path)) == transformers_reading(AutoConfig.from_pretrained(path))


def write_config(path: Path, fields: dict[str, Any]) -> Path:
    (path / "config.json").write_text(json.dumps(fields))
    return path


@pytest.mark.parametrize("model_type", EVERY_MODEL_TYPE)
def test_a_saved_config_of_each_model_type_reads_as_transformers_reads_it(model_type: str, tmp_path: Path) -> None:
    EVERY_MODEL_TYPE[model_type]().save_pretrained(tmp_path)
    assert_read_as_transformers_reads(tmp_path)


@pytest.mark.parametrize("model_type", EVERY_MODEL_TYPE)
def test_a_config_of_sizes_only_takes_the_model_types_defaults(model_type: str, tmp_path: Path) -> None:
    assert_read_as_transformers_reads(write_config(tmp_path, {"model_type": model_type, **SIZES}))


@pytest.mark.parametrize(
    "fields",
    [
        {"model_type": "llama", "rope_theta": 500000.0, "max_position_embeddings": 4096,
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
        {"model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0}},
        {"model_type": "gemma3_text", "rope_theta": 500000.0, "rope_local_base_freq": 20000.0,
         "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 3},
        {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2},
        {"model_type": "qwen3_moe", "head_dim": 32, "num_experts": 4, "mlp_only_layers": [0, 3]},
        {"model_type": "mistral", "sliding_window": None},
        {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": True},
    ],
    ids=["llama3-rope-scaling", "legacy-linear-scaling", "gemma3-legacy-rope", "qwen2-windows",
         "qwen3-moe-head-dim", "mistral-no-window", "mixtral-experts"],
)
def test_older_and_partial_config_files_read_as_transformers_reads_them(fields: dict[str, Any], tmp_path: Path) -> None:
    assert_read_as_transformers_reads(write_config(tmp_path, SIZES | fields))


@pytest.mark.parametrize("model", [None, "gemma3-270m"], ids=["default-model", "gemma3-270m"])
def test_the_packaged_models_read_as_transformers_reads_them(model: str | None) -> None:
    assert_read_as_transformers_reads(resolve_model_path(model))


def test_a_config_without_a_size_names_it(tmp_path: Path) -> None:
    sizes = {name: value for name, value in SIZES.items() if name != "intermediate_size"}
    with pytest.raises(ValueError, match="config.json has no intermediate_size"):
        read_model_config(write_config(tmp_path, {"model_type": "llama", **sizes}))


def test_the_first_layers_of_a_config_keep_their_layer_types(tmp_path: Path) -> None:
    config = read_model_config(write_config(tmp_path, {"model_type": "gemma3_text", **SIZES}))
    first = config.first_layers(6)
    assert (first.num_hidden_layers, first.layer_types) == (6, config.layer_types[:6])
    assert first.source["num_hidden_layers"] == 6
    with pytest.raises(ValueError, match="the model has 7 decoder layers, cannot keep the first 8"):
        config.first_layers(8)


def test_a_worker_process_imports_its_modules_and_loads_the_default_model_without_transformers() -> None:
    # transformers' config classes import its modeling code: seconds of every worker's start.
    script = f"""
import sys, torch
import strata.worker.worker_process
from strata.worker.attention import TorchAttentionBackend
from strata.worker.model_loader import load_model
from strata.worker.parallel_state import TensorParallel
model = load_model({str(resolve_model_path(None))!r}, torch.float32, TensorParallel(0, 1), TorchAttentionBackend(), "cpu")
assert "transformers" not in sys.modules, sorted(name for name in sys.modules if name.startswith("transformers"))[:5]
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
