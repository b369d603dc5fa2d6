"""A bfloat16 model on CPU may hold its linear weights as float32 and multiply in float32
(``--cpu-bf16-linear float32``): the same bfloat16 values, the numerics of a bfloat16 GEMM."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from strata.kernels import cpu_linear
from strata.runtime.engine_args import EngineArgs
from strata.worker import model_loader
from strata.worker.attention import get_attention_backend
from strata.worker.llama import LlamaForCausalLM
from strata.worker.model_loader import load_model, resolve_linear_dtype
from strata.worker.tp_layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

from model_factory import random_prompts, save_tiny_model, tiny_llama_config, tiny_qwen2_config
from worker_helpers import SINGLE_RANK, PagedRunner, greedy_decode

CPU = torch.device("cpu")
LINEARS = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)


def load_bf16(path: Path, linear_dtype: torch.dtype) -> LlamaForCausalLM:
    backend = get_attention_backend(None, CPU)  # the C kernels where they build, as in the engine
    return load_model(path, torch.bfloat16, SINGLE_RANK, backend, CPU, linear_dtype=linear_dtype)


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # untied head; tied head with q/k/v biases
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    config = tiny_llama_config() if request.param == "llama" else tiny_qwen2_config()
    save_tiny_model(config, path)
    return path


def test_widened_linears_hold_the_bfloat16_values_exactly(checkpoint: Path) -> None:
    native, widened = load_bf16(checkpoint, torch.bfloat16), load_bf16(checkpoint, torch.float32)
    native_modules = dict(native.named_modules())
    num_linears = 0
    for name, module in widened.named_modules():
        if isinstance(module, LINEARS):
            num_linears += 1
            assert module.weight.dtype == torch.float32
            assert torch.equal(module.weight.to(torch.bfloat16), native_modules[name].weight)
    assert num_linears == 4 * native.num_layers + 1  # qkv, o, gate_up, down per layer; the head
    assert widened.model.embed_tokens.weight.dtype == torch.bfloat16


def test_tied_head_gets_its_own_float32_copy_and_the_embedding_stays_bfloat16(tmp_path: Path) -> None:
    save_tiny_model(tiny_qwen2_config(), tmp_path)
    widened = load_bf16(tmp_path, torch.float32)
    head, embedding = widened.lm_head.weight, widened.model.embed_tokens.weight
    assert head.dtype == torch.float32 and embedding.dtype == torch.bfloat16
    assert torch.equal(head.to(torch.bfloat16), embedding)


def test_greedy_path_of_the_bfloat16_gemm_gets_the_same_logits_and_tokens(checkpoint: Path) -> None:
    native, widened = load_bf16(checkpoint, torch.bfloat16), load_bf16(checkpoint, torch.float32)
    prompts = random_prompts([5, 17, 33], native.vocab_size, seed=3)
    generated, _ = greedy_decode(PagedRunner(native), prompts, num_tokens=8)
    for prompt, tokens in zip(prompts, generated, strict=True):
        sequence = prompt + tokens
        native_logits, widened_logits = (logits_of(model, sequence)[len(prompt) - 1 : -1] for model in (native, widened))
        # Both GEMMs accumulate in float32; they differ in summation order and in the native
        # path's rounding of the logits to bfloat16 (1/64 apart near 2).
        torch.testing.assert_close(widened_logits, native_logits, atol=2e-2, rtol=1e-2)
        # The native path's greedy choice, wherever its logits did not tie after that rounding.
        top2 = native_logits.topk(2).values
        decided = top2[:, 0] - top2[:, 1] > 2e-2
        assert decided.sum() >= len(tokens) // 2
        assert widened_logits.argmax(-1)[decided].tolist() == torch.tensor(tokens)[decided].tolist()


def logits_of(model: LlamaForCausalLM, sequence: list[int]) -> torch.Tensor:
    runner = PagedRunner(model)
    (logits,) = runner.step([(runner.add_sequence(len(sequence)), sequence)])
    return logits


def test_activations_and_kv_cache_stay_bfloat16(checkpoint: Path) -> None:
    widened = load_bf16(checkpoint, torch.float32)
    output_dtypes: list[torch.dtype] = []
    for layer in widened.model.layers:
        layer.self_attn.qkv_proj.register_forward_hook(lambda module, args, out: output_dtypes.append(out.dtype))
        layer.register_forward_hook(lambda module, args, out: output_dtypes.extend(t.dtype for t in out))
    runner = PagedRunner(widened)
    (prompt,) = random_prompts([9], widened.vocab_size)
    runner.step([(runner.add_sequence(len(prompt)), prompt)])
    assert output_dtypes and set(output_dtypes) == {torch.bfloat16}
    assert all(cache.dtype == torch.bfloat16 and cache.abs().sum() > 0 for cache in runner.kv_caches)


@pytest.mark.parametrize(
    ("mode", "native_bf16", "expected"),
    [
        ("auto", False, torch.float32),
        ("auto", True, torch.bfloat16),
        ("float32", True, torch.float32),
        ("native", False, torch.bfloat16),
    ],
)
def test_linear_dtype_of_a_bfloat16_model_on_cpu(
    mode: str, native_bf16: bool, expected: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_loader, "_cpu_has_native_bf16", lambda: native_bf16)
    assert resolve_linear_dtype(mode, torch.bfloat16, "cpu")[0] == expected


@pytest.mark.parametrize(("dtype", "device"), [(torch.float32, "cpu"), (torch.float16, "cpu"), (torch.bfloat16, "cuda")])
def test_other_models_keep_their_dtype_for_the_linears(dtype: torch.dtype, device: str) -> None:
    assert resolve_linear_dtype("float32", dtype, device)[0] == dtype


def test_unknown_mode_is_rejected_naming_the_field() -> None:
    with pytest.raises(ValueError, match="cpu_bf16_linear"):
        resolve_linear_dtype("fp16", torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="cpu_bf16_linear"):
        EngineArgs(cpu_bf16_linear="fp16")


def test_widened_linears_keep_their_bfloat16_weight_for_decode_rows(checkpoint: Path) -> None:
    native, widened = load_bf16(checkpoint, torch.bfloat16), load_bf16(checkpoint, torch.float32)
    native_modules = dict(native.named_modules())
    for name, module in widened.named_modules():
        if isinstance(module, LINEARS):
            assert torch.equal(module.bf16_weight, native_modules[name].weight)
    tied = native.lm_head.weight.data_ptr() == native.model.embed_tokens.weight.data_ptr()
    shares_the_embedding = widened.lm_head.bf16_weight.data_ptr() == widened.model.embed_tokens.weight.data_ptr()
    assert shares_the_embedding == tied  # a tied head streams the embedding itself: no third copy


@pytest.mark.parametrize(
    "rows", [1, cpu_linear.MAX_ROWS, cpu_linear.MAX_ROWS + 1], ids=["one-row", "most-streamed-rows", "float32-gemm"]
)
def test_a_widened_layer_gives_the_float32_gemm_at_any_row_count(rows: int) -> None:
    layer = ColumnParallelLinear(64, [slice(0, 48)], bias=True, matrix_rows=[48])
    layer.weight.data = torch.randn(48, 64).bfloat16()
    layer.bias.data = torch.randn(48).bfloat16()
    weight, bias = layer.weight.float(), layer.bias.float()
    layer.widen_(torch.float32)
    x = torch.randn(rows, 64).bfloat16()
    torch.testing.assert_close(layer(x), F.linear(x.float(), weight, bias).bfloat16(), atol=1.6e-2, rtol=1.6e-2)
