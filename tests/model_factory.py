"""Tiny random HF checkpoints the tests build and save themselves, and HF reference decoding."""

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MixtralConfig,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=97)


def tiny_llama_config(**overrides: object) -> LlamaConfig:
    """GQA (4 query heads, 2 KV heads), untied head, llama3 rope scaling that bends real frequencies."""
    settings = dict(
        _TINY,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=None,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            # Small enough that the 16-dim heads have wavelengths in all three llama3 bands.
            "original_max_position_embeddings": 64,
        },
    )
    return LlamaConfig(**(settings | overrides))


def tiny_qwen2_config() -> Qwen2Config:
    """Qwen2: q/k/v biases, tied embeddings, linear rope scaling."""
    return Qwen2Config(
        **_TINY,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=None,
        rope_parameters={"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 2.0},
    )


def tiny_qwen3_config() -> Qwen3Config:
    """Qwen3: per-head q/k norms, a head_dim (32) other than hidden / heads (16), GQA, tied embeddings."""
    return Qwen3Config(
        **_TINY, num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=True,
        eos_token_id=None,
    )


def tiny_qwen3_moe_config() -> Qwen3MoeConfig:
    """Qwen3-MoE: 6 experts (more than TP ranks), top-3 without renormalising, and a dense
    middle layer (``mlp_only_layers``) with its own intermediate size."""
    return Qwen3MoeConfig(
        **(_TINY | {"num_hidden_layers": 3}),
        num_key_value_heads=2,
        moe_intermediate_size=32,
        num_experts=6,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=None,
    )


def tiny_mixtral_config() -> MixtralConfig:
    """Mixtral: 5 experts (an uneven split over 2 ranks), top-2, GQA."""
    return MixtralConfig(
        **(_TINY | {"intermediate_size": 48}),
        num_key_value_heads=2,
        num_local_experts=5,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=None,
    )


TINY_CONFIGS = {
    "llama": tiny_llama_config,
    "qwen2": tiny_qwen2_config,
    "qwen3": tiny_qwen3_config,
    "qwen3_moe": tiny_qwen3_moe_config,
    "mixtral": tiny_mixtral_config,
}


def save_tiny_model(
    config: PreTrainedConfig, path: Path, seed: int = 0, **save_options: object
) -> PreTrainedModel:
    """Save a random float32 HF model to ``path`` and return it (in eval mode, as the reference).

    ``save_options`` go to ``save_pretrained`` (e.g. ``max_shard_size``).

    Every parameter is drawn at random, biases and norm weights included (HF would start those at
    zero and one, which would hide a bias or norm weight that fails to load).
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(std=0.1)
    model.save_pretrained(path, **save_options)
    return model


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab_size, (length,), generator=generator).tolist() for length in lengths]


@torch.inference_mode()
def hf_greedy(model: PreTrainedModel, prompt: list[int], num_tokens: int) -> list[int]:
    """HF ``generate`` without sampling: the reference decode of one prompt."""
    input_ids = torch.tensor([prompt], device=model.device)
    output = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=num_tokens, do_sample=False
    )
    return output[0, len(prompt) :].tolist()
