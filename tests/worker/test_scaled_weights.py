"""8-bit linears (``--quantization fp8 | fp8-weight-only | int8``, ``worker/scaled_weights.py``):
a tiny random Llama computes what the same model with its 8-bit weights dequantized into float32
computes, whether the weights were quantized at load or stored by an FP8 checkpoint, and the
start-up refuses what cannot run.

On the CPU the weight-only linears run the dequantized torch computation, which multiplies by
the scales after the sums instead of before: the logits differ from the dequantized model's by
float32 rounding only."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from model_factory import random_prompts, save_fp8_checkpoint, save_tiny_model, tiny_llama_config
from strata.kernels import reference
from strata.worker.attention import TorchAttentionBackend
from strata.worker.llama import LlamaForCausalLM
from strata.worker.model_loader import load_model, weight_bytes
from strata.worker.scaled_weights import ScaledScheme, checkpoint_is_fp8, scaled_scheme
from strata.worker.tp_layers import ColumnParallelLinear, RowParallelLinear
from worker_helpers import SINGLE_RANK, PagedRunner, greedy_decode, load_ours, load_scaled

PROMPT_LENGTHS = [5, 12]
DECODE_TOKENS = 8
INT8 = ScaledScheme(torch.int8, w8a8=False)
FP8_WEIGHT_ONLY = ScaledScheme(torch.float8_e4m3fn, w8a8=False)


def _decode(model: LlamaForCausalLM) -> tuple[list[list[int]], torch.Tensor]:
    return greedy_decode(PagedRunner(model), random_prompts(PROMPT_LENGTHS, model.vocab_size), DECODE_TOKENS)


def _save_dequantized(source: Path, target: Path, dtype: torch.dtype) -> None:
    """``source``'s model with every projection quantized per channel to ``dtype`` and dequantized
    back into float32: what a model quantized at load stands for."""
    model = save_tiny_model(tiny_llama_config(attention_bias=True, mlp_bias=True), source)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.weight"):
                weight, scale = reference.quantize_per_channel(param, dtype)
                param.copy_(weight.float() * scale[:, None])
    model.save_pretrained(target)


@pytest.mark.parametrize("scheme", [INT8, FP8_WEIGHT_ONLY], ids=["int8", "fp8-weight-only"])
def test_model_quantized_at_load_decodes_the_tokens_of_its_dequantized_weights(scheme: ScaledScheme, tmp_path: Path) -> None:
    _save_dequantized(tmp_path / "model", tmp_path / "dequantized", scheme.weight_dtype)
    quantized = load_scaled(tmp_path / "model", scheme)
    assert quantized.model.layers[0].mlp.down_proj.scaled.weight.dtype == scheme.weight_dtype
    tokens, logits = _decode(quantized)
    expected_tokens, expected_logits = _decode(load_ours(tmp_path / "dequantized"))
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_checkpoint_keeps_its_fp8_weights_and_decodes_their_dequantized_tokens(
    strategy: str, tmp_path: Path
) -> None:
    save_fp8_checkpoint(tiny_llama_config(), tmp_path / "fp8", tmp_path / "dequantized", strategy)
    assert checkpoint_is_fp8(tmp_path / "fp8")
    model = load_scaled(tmp_path / "fp8", ScaledScheme(torch.float8_e4m3fn, w8a8=False, from_checkpoint=True))
    with safe_open(tmp_path / "fp8" / "model.safetensors", framework="pt") as stored:
        k_proj = stored.get_tensor("model.layers.1.self_attn.k_proj.weight")
    qkv = model.model.layers[1].self_attn.qkv_proj.scaled
    q_rows = qkv.weight.shape[0] - 2 * k_proj.shape[0]
    assert torch.equal(qkv.weight[q_rows : q_rows + k_proj.shape[0]].view(torch.uint8), k_proj.view(torch.uint8))
    tokens, logits = _decode(model)
    expected_tokens, expected_logits = _decode(load_ours(tmp_path / "dequantized"))
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)


def test_w8a8_checkpoint_with_static_activation_scales_keeps_them(tmp_path: Path) -> None:
    save_fp8_checkpoint(tiny_llama_config(), tmp_path / "fp8", tmp_path / "dequantized", input_scale=0.05)
    model = load_scaled(tmp_path / "fp8", ScaledScheme(torch.float8_e4m3fn, w8a8=True, from_checkpoint=True))
    assert float(model.model.layers[0].self_attn.qkv_proj.scaled.input_scale) == pytest.approx(0.05)
    assert model.lm_head.weight.dtype == torch.float32  # the head is left in the model dtype


def test_w8a8_model_points_its_logits_where_its_dequantized_weights_do(tmp_path: Path) -> None:
    # torch._scaled_mm runs on the CPU too. Rounding every activation to FP8 (a relative 2**-4)
    # moves the logits, so they are compared by direction (measured: cosine 0.9955 at least;
    # with the scales of the wrong rows: 0.69).
    save_fp8_checkpoint(tiny_llama_config(), tmp_path / "fp8", tmp_path / "dequantized")
    logits = _prefill_logits(load_scaled(tmp_path / "fp8", ScaledScheme(torch.float8_e4m3fn, w8a8=True, from_checkpoint=True)))
    expected = _prefill_logits(load_ours(tmp_path / "dequantized"))
    assert torch.nn.functional.cosine_similarity(logits, expected, dim=-1).min() > 0.99


def test_fp8_on_the_cpu_is_a_start_up_error_that_names_int8(tmp_path: Path) -> None:
    save_tiny_model(tiny_llama_config(), tmp_path)
    with pytest.raises(ValueError, match="compute capability >= 8.9.*--quantization int8"):
        scaled_scheme("fp8", tmp_path, "cpu")


def test_int8_quantizes_at_load_on_the_cpu_and_auto_leaves_an_unquantized_checkpoint_alone(tmp_path: Path) -> None:
    save_tiny_model(tiny_llama_config(), tmp_path)
    assert scaled_scheme("int8", tmp_path, "cpu") == INT8
    assert scaled_scheme("auto", tmp_path, "cpu") is None


def test_fp8_checkpoint_under_int8_is_refused(tmp_path: Path) -> None:
    save_fp8_checkpoint(tiny_llama_config(), tmp_path / "fp8", tmp_path / "dequantized")
    with pytest.raises(ValueError, match="stores FP8 weights"):
        scaled_scheme("int8", tmp_path / "fp8", "cpu")


def test_block_wise_fp8_checkpoint_is_refused(tmp_path: Path) -> None:
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="block-wise FP8"):
        checkpoint_is_fp8(tmp_path)


def _prefill_logits(model: LlamaForCausalLM) -> torch.Tensor:
    runner = PagedRunner(model)
    prompts = random_prompts(PROMPT_LENGTHS, model.vocab_size)
    return torch.cat(runner.step([(runner.add_sequence(len(prompt)), prompt) for prompt in prompts])).float()


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["fp8", "fp8-weight-only", "int8", "fp8-checkpoint"])
def test_8bit_models_on_the_gpu_point_their_logits_where_their_dequantized_weights_do(quantization: str, tmp_path: Path) -> None:
    # bfloat16 on the GPU, where W8A8 also rounds every activation to FP8 (a relative 2**-4):
    # the logits are compared by direction. On the CPU in float32 W8A8 gives a cosine of 0.9955
    # at least and scales of the wrong rows 0.69; bfloat16 adds little, so 0.98 leaves room.
    if quantization == "fp8-checkpoint":
        save_fp8_checkpoint(tiny_llama_config(), tmp_path / "model", tmp_path / "dequantized")
        scheme = scaled_scheme("auto", tmp_path / "model", "cuda")
        assert scheme == ScaledScheme(torch.float8_e4m3fn, w8a8=True, from_checkpoint=True)
    else:
        weight_dtype = torch.int8 if quantization == "int8" else torch.float8_e4m3fn
        _save_dequantized(tmp_path / "model", tmp_path / "dequantized", weight_dtype)
        scheme = scaled_scheme(quantization, tmp_path / "model", "cuda")
    logits = _prefill_logits(load_scaled(tmp_path / "model", scheme, device="cuda", dtype=torch.bfloat16))
    expected = _prefill_logits(load_model(tmp_path / "dequantized", torch.bfloat16, SINGLE_RANK, TorchAttentionBackend(), "cuda"))
    assert torch.nn.functional.cosine_similarity(logits, expected, dim=-1).min() > 0.98


def test_weight_bytes_count_the_8bit_weights_and_their_scales(tmp_path: Path) -> None:
    save_tiny_model(tiny_llama_config(), tmp_path)
    unquantized = load_ours(tmp_path)
    linears = [m.weight for m in unquantized.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    # Each float32 weight (4 bytes) becomes 1 byte, plus a float32 scale per row.
    expected = weight_bytes(unquantized) - sum(3 * w.numel() for w in linears) + sum(4 * w.shape[0] for w in linears)
    assert weight_bytes(load_scaled(tmp_path, INT8)) == expected
