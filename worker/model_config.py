"""A checkpoint's ``config.json``, read into the fields the model classes use.

Each field is filled as transformers' config class for the model type fills it (its defaults, its
derived values: head_dim, layer_types, rope parameters), and the tests hold the two equal on every
supported model type. Reading it ourselves keeps transformers out of the worker: its config
classes import its modeling and kernel-hub code, ~4.5 s of every worker process's start.
"""

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# What transformers' config class assumes for each field a config.json leaves out, per model type.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"max_position_embeddings": 32768, "sliding_window": 4096, "max_window_layers": 28, "head_dim": 128},
    "qwen3_moe": {
        "max_position_embeddings": 32768, "sliding_window": 4096,
        "num_local_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    },
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0, "num_local_experts": 8, "num_experts_per_tok": 2},
    "gemma3_text": {
        "sliding_window": 4096, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "sliding_window_pattern": 6,  # every sixth layer attends fully
    },
}
_COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "rope_theta": 10_000.0,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "sliding_window": None,
}
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_QWEN_TYPES = ("qwen2", "qwen3", "qwen3_moe")  # a sliding window only with use_sliding_window
_LAYER_TYPED = ("qwen2", "qwen3")  # configs that derive each layer's attention kind from max_window_layers
_SCALED_ROPE_TYPES = ("llama3", "yarn", "longrope")  # scalings that need the pre-training context


@dataclass
class ModelConfig:
    """The architecture a checkpoint's ``config.json`` describes, as the model classes read it."""

    model_type: str
    architectures: list[str]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str  # Gemma 3's hidden_activation
    rms_norm_eps: float
    max_position_embeddings: int
    rope_parameters: dict[str, Any]  # Gemma 3: one dict per layer type
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    layer_types: list[str] | None
    # mixtures of experts (Qwen3-MoE, Mixtral)
    num_experts: int = 0  # num_local_experts
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    mlp_only_layers: list[int] = field(default_factory=list)
    decoder_sparse_step: int = 1
    # Gemma 3
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    use_bidirectional_attention: bool = False
    source: dict[str, Any] = field(default_factory=dict, repr=False)  # the config.json fields, cut as the config is

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> "ModelConfig":
        """The config a ``config.json`` dict describes; a ValueError names a missing size."""
        model_type = saved.get("model_type", "")
        missing = [name for name in _SIZES if name not in saved]
        if missing:
            raise ValueError(f"the model's config.json has no {', '.join(missing)}")
        if "num_experts" in saved:  # Qwen3-MoE's older name for what transformers 5 calls num_local_experts
            saved = {"num_local_experts": saved["num_experts"]} | saved
        fields = _COMMON_DEFAULTS | _DEFAULTS.get(model_type, {}) | saved
        hidden, heads, layers = fields["hidden_size"], fields["num_attention_heads"], fields["num_hidden_layers"]
        sliding_window = fields["sliding_window"]
        if model_type in _QWEN_TYPES and not fields.get("use_sliding_window", False):
            sliding_window = None
        is_gemma3 = model_type == "gemma3_text"
        return cls(
            model_type=model_type,
            architectures=list(fields.get("architectures") or []),
            vocab_size=fields["vocab_size"],
            hidden_size=hidden,
            intermediate_size=fields["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=fields.get("num_key_value_heads") or heads,
            head_dim=fields.get("head_dim") or hidden // heads,
            hidden_act=fields["hidden_activation" if is_gemma3 else "hidden_act"],
            rms_norm_eps=fields["rms_norm_eps"],
            max_position_embeddings=fields["max_position_embeddings"],
            rope_parameters=_gemma3_rope(fields) if is_gemma3 else _rope(fields),
            tie_word_embeddings=bool(fields["tie_word_embeddings"]),
            attention_bias=bool(fields["attention_bias"]),
            mlp_bias=bool(fields["mlp_bias"]),
            sliding_window=sliding_window,
            layer_types=_layer_types(fields, sliding_window),
            num_experts=fields.get("num_local_experts", 0),
            num_experts_per_tok=fields.get("num_experts_per_tok", 0),
            moe_intermediate_size=fields.get("moe_intermediate_size", 0),
            norm_topk_prob=bool(fields.get("norm_topk_prob", False)),
            mlp_only_layers=list(fields.get("mlp_only_layers") or []),
            decoder_sparse_step=fields.get("decoder_sparse_step", 1),
            query_pre_attn_scalar=fields.get("query_pre_attn_scalar"),
            final_logit_softcapping=fields.get("final_logit_softcapping"),
            attn_logit_softcapping=fields.get("attn_logit_softcapping"),
            use_bidirectional_attention=bool(fields.get("use_bidirectional_attention", False)),
            source=saved,
        )

    def first_layers(self, num_layers: int) -> "ModelConfig":
        """This config cut to its first ``num_layers`` decoder layers (the rest of a checkpoint's
        layers are then skipped at load, as another pipeline stage's would be)."""
        if not 1 <= num_layers <= self.num_hidden_layers:
            raise ValueError(f"the model has {self.num_hidden_layers} decoder layers, cannot keep the first {num_layers}")
        layer_types = None if self.layer_types is None else self.layer_types[:num_layers]
        source = self.source | {"num_hidden_layers": num_layers}
        if "layer_types" in source:
            source["layer_types"] = layer_types
        return replace(self, num_hidden_layers=num_layers, layer_types=layer_types, source=source)


def read_model_config(path: Path | str) -> ModelConfig:
    """The config of the HF-style model directory ``path`` (its ``config.json``)."""
    return ModelConfig.from_dict(json.loads((Path(path) / "config.json").read_text()))


def _rope(fields: dict[str, Any]) -> dict[str, Any]:
    # The legacy rope_scaling, where a file still has it, wins over rope_parameters (as in transformers).
    params = dict(fields.get("rope_scaling") or fields.get("rope_parameters") or {})
    params.setdefault("rope_theta", fields["rope_theta"])
    params.setdefault("rope_type", params.get("type", "default"))
    if "partial_rotary_factor" in fields:
        params.setdefault("partial_rotary_factor", fields["partial_rotary_factor"])
    if params["rope_type"] in _SCALED_ROPE_TYPES:
        params["original_max_position_embeddings"] = fields.get(
            "original_max_position_embeddings",
            params.get("original_max_position_embeddings", fields["max_position_embeddings"]),
        )
    return params


def _gemma3_rope(fields: dict[str, Any]) -> dict[str, Any]:
    # Local (sliding) layers rotate at rope_local_base_freq; a legacy rope_scaling scales the global ones.
    saved = fields.get("rope_parameters") or {}
    params = {kind: dict(saved.get(kind) or {"rope_type": "default"}) for kind in ("full_attention", "sliding_attention")}
    params["full_attention"].update(fields.get("rope_scaling") or {})
    params["full_attention"].setdefault("rope_theta", fields["rope_theta"])
    params["sliding_attention"].setdefault("rope_theta", fields["rope_local_base_freq"])
    for kind_params in params.values():
        kind_params.setdefault("rope_type", kind_params.get("type", "default"))
    return params


def _layer_types(fields: dict[str, Any], sliding_window: int | None) -> list[str] | None:
    layers, model_type = fields["num_hidden_layers"], fields.get("model_type")
    if fields.get("layer_types") is not None:
        return list(fields["layer_types"])
    if model_type == "gemma3_text":
        pattern = fields["sliding_window_pattern"]
        return ["sliding_attention" if (index + 1) % pattern else "full_attention" for index in range(layers)]
    if model_type in _LAYER_TYPED:
        return [
            "sliding_attention" if sliding_window is not None and index >= fields["max_window_layers"] else "full_attention"
            for index in range(layers)
        ]
    return None
