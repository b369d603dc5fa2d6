"""Decode steps of a bfloat16 or float32 model on the CPU run each Llama decoder layer as two fused C calls
(``kernels.cpu_decoder_layer``): they must give exactly the logits of the module path, whose
kernels they call, and only layers whose modules they reproduce may be fused."""

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedConfig

from strata.kernels import cpu_linear, native
from strata.worker.attention import get_attention_backend
from strata.worker.llama import LlamaDecoderLayer, LlamaForCausalLM

from model_factory import (
    random_prompts,
    save_tiny_model,
    tiny_llama_config,
    tiny_mistral_config,
    tiny_qwen2_config,
    tiny_qwen3_config,
)
from worker_helpers import STREAMED_FLOAT32, PagedRunner, count_calls, greedy_decode, load_planned

pytestmark = pytest.mark.skipif(native.load_library() is None, reason="no C compiler to build the CPU kernels")

CPU = torch.device("cpu")
DECODE_TOKENS = 6


def load_streamed(path: Path, backend: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> LlamaForCausalLM:
    """The engine's load of a model on a CPU without native bfloat16: decode steps stream the
    weights as loaded (bfloat16 or float32), a bfloat16 model's GEMMs run on float32 copies."""
    return load_planned(path, STREAMED_FLOAT32, get_attention_backend(backend, CPU), dtype=dtype)


def decoder_layers(model: LlamaForCausalLM) -> list[LlamaDecoderLayer]:
    return [layer for layer in model.model.layers if isinstance(layer, LlamaDecoderLayer)]


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(tiny_llama_config(), id="llama"),
        pytest.param(tiny_qwen2_config(), id="qwen2-qkv-biases-tied-head"),
        pytest.param(tiny_mistral_config(), id="mistral-sliding-window"),
    ],
)
@pytest.mark.parametrize(
    "prompt_lengths",
    [pytest.param([3, 12], id="fused-prefill"), pytest.param([5, 40], id="module-prefill")],  # 15 rows; 45
)
@pytest.mark.parametrize("one_call", [True, False], ids=["all-layers-in-one-call", "a-call-per-half"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-model", "fp32-model"])
def test_fused_layers_give_exactly_the_logits_of_the_modules(
    config: PreTrainedConfig, prompt_lengths: list[int], one_call: bool, dtype: torch.dtype, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    save_tiny_model(config, tmp_path)
    fused, modules = load_streamed(tmp_path, dtype=dtype), load_streamed(tmp_path, dtype=dtype)
    modules.model.fused_stack = None
    for layer in decoder_layers(modules):
        layer.fused = None
    if not one_call:  # the per-layer halves, as a rank of a tensor-parallel group runs them
        fused.model.fused_stack = None
    prompts = random_prompts(prompt_lengths, fused.vocab_size, seed=1)
    expected_tokens, expected_logits = greedy_decode(PagedRunner(modules), prompts, DECODE_TOKENS)
    attention_calls, mlp_calls = count_calls(monkeypatch, "attention_block"), count_calls(monkeypatch, "mlp_block")
    stack_calls = count_calls(monkeypatch, "decoder_stack")
    tokens, logits = greedy_decode(PagedRunner(fused), prompts, DECODE_TOKENS)
    fused_steps = DECODE_TOKENS - 1 + (sum(prompt_lengths) <= cpu_linear.MAX_ROWS)
    if one_call:
        assert (stack_calls[0], attention_calls[0], mlp_calls[0]) == (fused_steps, 0, 0)
    else:
        assert attention_calls[0] == mlp_calls[0] == fused_steps * fused.num_layers
    assert tokens == expected_tokens
    assert torch.equal(logits, expected_logits)


def test_a_bfloat16_llama_on_the_cpu_backend_fuses_every_layer_into_one_call(tmp_path: Path) -> None:
    save_tiny_model(tiny_llama_config(), tmp_path)
    model = load_streamed(tmp_path)
    assert all(layer.fused is not None for layer in decoder_layers(model))
    assert model.model.fused_stack is not None


@pytest.mark.parametrize(
    ("config", "backend", "dtype"),
    [
        pytest.param(tiny_llama_config(), "torch", torch.bfloat16, id="torch-attention-backend"),
        pytest.param(tiny_llama_config(attention_bias=True), "cpu", torch.bfloat16, id="o-proj-bias-after-all-reduce"),
        pytest.param(tiny_qwen3_config(), "cpu", torch.bfloat16, id="qwen3-query-key-norms"),
    ],
)
def test_layers_the_fused_calls_would_not_reproduce_stay_on_the_modules(
    config: PreTrainedConfig, backend: str, dtype: torch.dtype, tmp_path: Path
) -> None:
    save_tiny_model(config, tmp_path)
    model = load_streamed(tmp_path, backend, dtype)
    assert all(layer.fused is None for layer in decoder_layers(model))
    assert model.model.fused_stack is None
