"""Shared by the LoRA worker tests: a tiny llama with two PEFT adapters and their merged HF references."""

from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedConfig, PreTrainedModel

from strata.engine_core.protocol import LoRAAdapter

from model_factory import save_tiny_lora, save_tiny_model, tiny_llama_config

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class TinyAdapters:
    """A tiny llama, its HF reference, and adapters with the merged HF model each one makes."""

    model_dir: Path
    base: PreTrainedModel
    adapters: list[LoRAAdapter]
    merged: list[PreTrainedModel]


def save_tiny_adapters(path: Path, config: PreTrainedConfig | None = None) -> TinyAdapters:
    """A tiny model of ``config`` (default: tiny llama) and two adapters. Adapter 1: every
    module, rank 8. Adapter 2: q, v and down, rank 4, rsLoRA."""
    model_dir = path / "model"
    base = save_tiny_model(config or tiny_llama_config(), model_dir)
    first = save_tiny_lora(base, path / "all", ALL_MODULES, rank=8, seed=1)
    second = save_tiny_lora(base, path / "some", ("q_proj", "v_proj", "down_proj"), rank=4, seed=2, use_rslora=True)
    adapters = [LoRAAdapter("all", 1, str(path / "all")), LoRAAdapter("some", 2, str(path / "some"))]
    return TinyAdapters(model_dir, base, adapters, [first, second])
