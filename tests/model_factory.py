"""Tiny random HF checkpoints the tests build and save themselves, and HF reference decoding."""

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from strata.kernels import reference
from strata.worker.model_config import ModelConfig

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


def tiny_mistral_config(**overrides: object) -> MistralConfig:
    """Mistral v0.1 style: the Llama layout with an 8-token sliding window on every layer."""
    settings = dict(
        _TINY, num_key_value_heads=2, sliding_window=8, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=None
    )
    return MistralConfig(**(settings | overrides))


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


def tiny_gemma3_config(**overrides: object) -> Gemma3TextConfig:
    """Gemma 3: GQA, local layers with an 8-token window (shorter than the test prompts) around
    a global one, different rotary bases (linear scaling on the global layer), a query scalar
    that is not the head size, final logit softcapping."""
    settings = dict(
        _TINY,
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        sliding_window=8,
        query_pre_attn_scalar=24,
        final_logit_softcapping=5.0,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 2.0},
        },
    )
    return Gemma3TextConfig(**(settings | overrides))


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


# The Llama family by model type (Gemma 3 has tests of its own); Mistral's 8-token window is
# shorter than most test prompts.
TINY_CONFIGS = {
    "llama": tiny_llama_config,
    "mistral": tiny_mistral_config,
    "qwen2": tiny_qwen2_config,
    "qwen3": tiny_qwen3_config,
    "qwen3_moe": tiny_qwen3_moe_config,
    "mixtral": tiny_mixtral_config,
}


def read_as_saved(config: PreTrainedConfig) -> ModelConfig:
    """The engine's reading of ``config`` from the config.json ``save_pretrained`` would write."""
    return ModelConfig.from_dict(json.loads(config.to_json_string()))


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


def save_tiny_lora(
    base: PreTrainedModel,
    path: Path,
    target_modules: tuple[str, ...],
    rank: int,
    seed: int,
    alpha: int = 16,
    use_rslora: bool = False,
) -> PreTrainedModel:
    """Save a PEFT LoRA adapter of ``base`` with random A and B (a fresh adapter's zero B would
    change nothing) to ``path``; return a copy of ``base`` with the adapter merged, the reference
    for that adapter's outputs. ``base`` itself is left as it was."""
    from peft import LoraConfig, get_peft_model  # a test extra that only adapter tests need

    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(target_modules), use_rslora=use_rslora, init_lora_weights=False
    )
    adapted = get_peft_model(copy.deepcopy(base), config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.normal_(std=0.1)
    adapted.save_pretrained(path)
    return adapted.merge_and_unload().eval()


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


# The projections an FP8 checkpoint stores in FP8 (compressed-tensors leaves the head and the
# embedding in the model dtype, as its usual recipes do).
FP8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_fp8_checkpoint(
    config: PreTrainedConfig, path: Path, dequantized_path: Path, strategy: str = "channel", input_scale: float | None = None
) -> None:
    """Save a random model as an FP8 checkpoint in the compressed-tensors layout to ``path``: each
    projection's ``weight`` in float8_e4m3fn with its float32 ``weight_scale`` (``[rows, 1]`` per
    ``channel``, ``[1]`` per ``tensor``) and, given ``input_scale``, a static activation scale;
    ``quantization_config`` in config.json says so. ``dequantized_path`` gets the same model with
    those FP8 weights dequantized into float32, the reference it must compute."""
    model = save_tiny_model(config, dequantized_path)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.rpartition(".")[0].rpartition(".")[2] not in FP8_PROJECTIONS:
            tensors[name] = tensor.contiguous()
            continue
        amax = tensor.abs().amax(dim=1) if strategy == "channel" else tensor.abs().amax().reshape(1)
        scale = reference.channel_scales(amax, torch.float8_e4m3fn)
        weight = reference.quantize_rows(tensor, scale.expand(tensor.shape[0]), torch.float8_e4m3fn)
        stem = name.removesuffix(".weight")
        tensors[name] = weight
        tensors[f"{stem}.weight_scale"] = scale.reshape(-1, 1) if strategy == "channel" else scale
        if input_scale is not None:
            tensors[f"{stem}.input_scale"] = torch.tensor([input_scale])
        tensor.copy_(weight.float() * scale.reshape(-1, 1))
    model.save_pretrained(dequantized_path)
    activations = {"num_bits": 8, "type": "float", "symmetric": True}
    activations |= {"strategy": "tensor", "dynamic": False} if input_scale is not None else {"strategy": "token", "dynamic": True}
    config.quantization_config = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False},
                "input_activations": activations,
            }
        },
    }
    config.save_pretrained(path)
    save_file(tensors, path / "model.safetensors")
