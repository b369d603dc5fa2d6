"""A PEFT LoRA directory read without torch: its settings, and which tensor of
``adapter_model.safetensors`` holds each targeted linear's A and B.

The frontend reads adapters with it to refuse a bad one when it is loaded, before any request
names it; the workers read the same description to load the tensors into their slots.
"""

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from strata.worker.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The linears an adapter may target, named as the checkpoints name them.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# PEFT saves ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``.
_WEIGHT_NAME = re.compile(r"\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# Options that change what the weights mean beyond x A^T B^T: refused rather than ignored.
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "rank_pattern": "rank_pattern (per-module ranks)",
    "alpha_pattern": "alpha_pattern (per-module alphas)",
}


@dataclass(frozen=True)
class AdapterFiles:
    """What a LoRA directory holds. ``scale`` multiplies ``x A^T B^T``: ``lora_alpha / r``, or
    ``lora_alpha / sqrt(r)`` with rsLoRA. ``weights`` maps (layer index, module) to the names of
    that linear's A (``[r, in_features]``) and B (``[out_features, r]``) in the weights file;
    ``shapes`` gives every tensor's shape as the file's header states it."""

    path: Path
    rank: int
    scale: float
    target_modules: frozenset[str]
    weights: dict[tuple[int, str], tuple[str, str]]
    shapes: dict[str, tuple[int, ...]]

    @property
    def weights_file(self) -> Path:
        return self.path / WEIGHTS_FILE


def read_adapter(path: str | Path) -> AdapterFiles:
    """Read the directory's config and the weights file's header; ValueError saying what is
    missing or unsupported."""
    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise ValueError(f"LoRA adapter {str(path)!r} has no {needed.name}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not readable JSON ({error})") from None
    _check_options(path, config)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise ValueError(f"LoRA adapter {str(path)!r}: r must be a positive integer and lora_alpha a number")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    shapes = _tensor_shapes(weights_file)
    weights = _weight_names(path, shapes)
    return AdapterFiles(path, rank, scale, frozenset(module for _, module in weights), weights, shapes)


def check_adapter(files: AdapterFiles, config: ModelConfig, max_lora_rank: int) -> None:
    """ValueError if the adapter cannot run on a model of ``config`` with slots of rank
    ``max_lora_rank``: its rank is larger, it targets a module or layer the model lacks, or a
    tensor's shape does not match the linear it adapts."""
    name = str(files.path)
    if files.rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {files.rank}, above --max-lora-rank {max_lora_rank}")
    linears = linear_shapes(config)
    for (layer, module), (a_name, b_name) in sorted(files.weights.items()):
        if module not in linears:
            raise ValueError(f"LoRA adapter {name!r} targets {module}, which {config.model_type} models do not have")
        if layer >= config.num_hidden_layers:
            raise ValueError(
                f"LoRA adapter {name!r} adapts layer {layer}; the model has {config.num_hidden_layers} layers"
            )
        out_features, in_features = linears[module]
        expected = {a_name: (files.rank, in_features), b_name: (out_features, files.rank)}
        for tensor, shape in expected.items():
            if files.shapes[tensor] != shape:
                raise ValueError(
                    f"LoRA adapter {name!r}: {tensor} has shape {list(files.shapes[tensor])}, "
                    f"the model's {module} needs {list(shape)}"
                )


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each linear an adapter may target in a decoder layer of
    a model of ``config``; a mixture of experts has no dense MLP to adapt."""
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    hidden = config.hidden_size
    shapes = {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
    }
    if config.num_experts == 0:
        intermediate = config.intermediate_size
        shapes |= {"gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden), "down_proj": (hidden, intermediate)}
    return shapes


def _check_options(path: Path, config: dict) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{str(path)!r} is a {config['peft_type']} adapter, not LoRA")
    for option, what in _UNSUPPORTED_OPTIONS.items():
        if config.get(option):
            raise ValueError(f"LoRA adapter {str(path)!r} uses {what}, which is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {str(path)!r} trains biases (bias={config['bias']!r}), which is not supported")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"LoRA adapter {str(path)!r} stores transposed weights (fan_in_fan_out), which is not supported")


def _tensor_shapes(weights_file: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from a safetensors header (8 bytes of length, then JSON)."""
    try:
        with weights_file.open("rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
        return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}
    except (OSError, struct.error, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{str(weights_file)!r} is not a safetensors file ({error})") from None


def _weight_names(path: Path, shapes: dict[str, tuple[int, ...]]) -> dict[tuple[int, str], tuple[str, str]]:
    halves: dict[tuple[int, str], dict[str, str]] = {}
    for tensor in shapes:
        match = _WEIGHT_NAME.search(tensor)
        if match is None:
            raise ValueError(f"LoRA adapter {str(path)!r} holds {tensor}, which is not a LoRA A or B of a decoder linear")
        layer, module, half = int(match[1]), match[2], match[3]
        if module not in LORA_MODULES:
            raise ValueError(f"LoRA adapter {str(path)!r} targets {module}; adapters may target {', '.join(LORA_MODULES)}")
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise ValueError(f"LoRA adapter {str(path)!r} holds no LoRA weights")
    for (layer, module), pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {str(path)!r} has lora_{''.join(pair)} but not both halves for layer {layer} {module}")
    return {key: (pair["A"], pair["B"]) for key, pair in halves.items()}
