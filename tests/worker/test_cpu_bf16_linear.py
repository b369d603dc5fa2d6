"""A bfloat16 model on CPU follows a ``CpuLinearPlan``: a GEMM in bfloat16 or on exact float32
copies of the weights, and the steps of few rows streamed from the bfloat16 weights, the
crossover measured at start (``worker/cpu_linear_plan.py``); a float32 model streams its own
float32 weights in the steps of few rows and runs its float32 GEMM in the others."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from strata.kernels import cpu_features, cpu_linear, onednn_linear
from strata.runtime.engine_args import EngineArgs
from strata.worker import cpu_linear_plan
from strata.worker.attention import get_attention_backend
from strata.worker.cpu_linear_plan import CANDIDATE_ROWS, CpuLinearPlan, measure_crossover, plan_cpu_linears
from strata.worker.llama import LlamaForCausalLM
from strata.worker.model_loader import load_model
from strata.worker.tp_layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

from model_factory import random_prompts, save_tiny_model, tiny_llama_config, tiny_qwen2_config
from worker_helpers import SINGLE_RANK, STREAMED_FLOAT32, PagedRunner, greedy_decode, load_ours, load_planned

CPU = torch.device("cpu")
LINEARS = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
NATIVE = CpuLinearPlan(torch.bfloat16, False, 0, "tests: the bfloat16 GEMM at every step")
STREAMED_BF16 = CpuLinearPlan(torch.bfloat16, True, cpu_linear.MAX_ROWS, "tests: packed bfloat16 GEMMs, streamed decode steps")
STREAMED_FLOAT32_WEIGHTS = CpuLinearPlan(
    torch.float32, False, cpu_linear.MAX_ROWS, "tests: a float32 model, streamed decode steps", torch.float32
)


def load_bf16(path: Path, plan: CpuLinearPlan) -> LlamaForCausalLM:
    return load_planned(path, plan, get_attention_backend(None, CPU))  # the C kernels where they build


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # untied head; tied head with q/k/v biases
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    config = tiny_llama_config() if request.param == "llama" else tiny_qwen2_config()
    save_tiny_model(config, path)
    return path


def test_widened_linears_hold_the_bfloat16_values_exactly(checkpoint: Path) -> None:
    native, widened = load_bf16(checkpoint, NATIVE), load_bf16(checkpoint, STREAMED_FLOAT32)
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
    widened = load_bf16(tmp_path, STREAMED_FLOAT32)
    head, embedding = widened.lm_head.weight, widened.model.embed_tokens.weight
    assert head.dtype == torch.float32 and embedding.dtype == torch.bfloat16
    assert torch.equal(head.to(torch.bfloat16), embedding)


def test_greedy_path_of_the_bfloat16_gemm_gets_the_same_logits_and_tokens(checkpoint: Path) -> None:
    native, widened = load_bf16(checkpoint, NATIVE), load_bf16(checkpoint, STREAMED_FLOAT32)
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


@pytest.mark.parametrize("plan", [STREAMED_FLOAT32, STREAMED_BF16], ids=["float32-gemm", "bfloat16-gemm"])
def test_streamed_decode_steps_give_the_bfloat16_gemms_logits(plan: CpuLinearPlan, checkpoint: Path) -> None:
    if plan.packed and not onednn_linear.available(plan.gemm_dtype):
        pytest.skip(f"torch's oneDNN cannot pack {plan.gemm_dtype} weights on this CPU (it needs AVX-512 or AVX-NE-CONVERT)")
    native, planned = load_bf16(checkpoint, NATIVE), load_bf16(checkpoint, plan)
    assert all(layer.fused is not None for layer in planned.model.layers)
    prompts = random_prompts([5, 17, 9], native.vocab_size, seed=4)
    (native_tokens, native_logits), (planned_tokens, planned_logits) = (
        greedy_decode(PagedRunner(model), prompts, num_tokens=8) for model in (native, planned)
    )
    # Streamed and GEMM sums differ in order only; the native head rounds logits to bfloat16.
    torch.testing.assert_close(planned_logits, native_logits, atol=3e-2, rtol=2e-2)
    assert planned_tokens[0][:2] == native_tokens[0][:2]


def test_a_step_through_the_float32_gemms_keeps_activations_and_kv_cache_bfloat16(checkpoint: Path) -> None:
    widened = load_bf16(checkpoint, STREAMED_FLOAT32)
    output_dtypes: list[torch.dtype] = []
    for layer in widened.model.layers:
        layer.self_attn.qkv_proj.register_forward_hook(lambda module, args, out: output_dtypes.append(out.dtype))
        layer.register_forward_hook(lambda module, args, out: output_dtypes.extend(t.dtype for t in out))
    runner = PagedRunner(widened)
    # More rows than the plan streams: the step runs the modules, not the fused C layers.
    (prompt,) = random_prompts([STREAMED_FLOAT32.stream_rows + 1], widened.vocab_size)
    runner.step([(runner.add_sequence(len(prompt)), prompt)])
    assert output_dtypes and set(output_dtypes) == {torch.bfloat16}
    assert all(cache.dtype == torch.bfloat16 and cache.abs().sum() > 0 for cache in runner.kv_caches)


@pytest.mark.parametrize(
    ("mode", "native_bf16", "gemm_dtype"),
    [
        ("auto", False, torch.float32),
        ("auto", True, torch.bfloat16),
        ("float32", True, torch.float32),
        ("native", False, torch.bfloat16),
    ],
)
def test_the_plan_of_a_bfloat16_model_on_cpu(
    mode: str, native_bf16: bool, gemm_dtype: torch.dtype, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_features, "has_native_bf16", lambda: native_bf16)
    model = load_model(checkpoint, torch.bfloat16, SINGLE_RANK, get_attention_backend(None, CPU), CPU)
    plan = plan_cpu_linears(mode, model, torch.bfloat16, "cpu", SINGLE_RANK)
    assert plan is not None and plan.gemm_dtype == gemm_dtype
    if mode == "native":
        assert plan.stream_rows == 0
    else:
        assert plan.stream_rows in (0, *CANDIDATE_ROWS) and "streamed/GEMM" in plan.reason


@pytest.mark.parametrize(("dtype", "device"), [(torch.float16, "cpu"), (torch.bfloat16, "cuda")])
def test_other_models_have_no_plan(dtype: torch.dtype, device: str, checkpoint: Path) -> None:
    assert plan_cpu_linears("float32", load_ours(checkpoint), dtype, device, SINGLE_RANK) is None


def test_a_float32_model_plans_to_stream_its_own_float32_weights(checkpoint: Path) -> None:
    plan = plan_cpu_linears("auto", load_ours(checkpoint), torch.float32, "cpu", SINGLE_RANK)
    assert plan is not None and plan.gemm_dtype == plan.streamed_dtype == torch.float32 and not plan.packed
    assert "stream the float32 weights" in plan.describe() or plan.stream_rows == 0


def test_streamed_float32_decode_steps_give_the_float32_gemms_logits_and_tokens(checkpoint: Path) -> None:
    backend = get_attention_backend(None, CPU)
    gemm = load_model(checkpoint, torch.float32, SINGLE_RANK, backend, CPU)
    streamed = load_planned(checkpoint, STREAMED_FLOAT32_WEIGHTS, backend, dtype=torch.float32)
    assert all(layer.fused is not None for layer in streamed.model.layers)
    assert all(layer.fused is None for layer in gemm.model.layers)
    prompts = random_prompts([5, 17, 9], gemm.vocab_size, seed=4)
    (gemm_tokens, gemm_logits), (streamed_tokens, streamed_logits) = (
        greedy_decode(PagedRunner(model), prompts, num_tokens=8) for model in (gemm, streamed)
    )
    # Both sum float32 products in float32, in different orders.
    torch.testing.assert_close(streamed_logits, gemm_logits, atol=1e-4, rtol=1e-4)
    assert streamed_tokens == gemm_tokens


def test_a_later_plan_of_the_process_reuses_the_measured_crossover_rather_than_timing_anew(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(checkpoint, torch.bfloat16, SINGLE_RANK, get_attention_backend(None, CPU), CPU)
    first = plan_cpu_linears("float32", model, torch.bfloat16, "cpu", SINGLE_RANK)

    def timing(run) -> float:
        raise AssertionError("timed again")

    monkeypatch.setattr(cpu_linear_plan, "_fastest_seconds", timing)
    assert plan_cpu_linears("float32", model, torch.bfloat16, "cpu", SINGLE_RANK) == first


def test_unknown_mode_is_rejected_naming_the_field(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="cpu_bf16_linear"):
        plan_cpu_linears("fp16", load_ours(checkpoint), torch.bfloat16, "cpu", SINGLE_RANK)
    with pytest.raises(ValueError, match="cpu_bf16_linear"):
        EngineArgs(cpu_bf16_linear="fp16")


@pytest.mark.parametrize(
    ("stream_wins_at", "expected"),
    [(set(CANDIDATE_ROWS), CANDIDATE_ROWS[-1]), ({1, 2, 4, 8}, 8), ({1, 2, 8, 16}, 16), ({1, 2, 16}, 2), (set(), 0)],
    ids=["always", "up-to-8", "one-loss-among-wins-is-noise", "one-win-among-losses-is-noise", "never"],
)
def test_the_crossover_splits_the_row_counts_where_most_timings_agree(
    stream_wins_at: set[int], expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    timings = iter([])

    def scripted(run) -> float:  # measure_crossover times streaming, then the GEMM, per row count
        return next(timings)

    rows_order = [(rows, 1.0 if rows in stream_wins_at else 3.0, 2.0) for rows in CANDIDATE_ROWS]
    timings = iter(value for _, stream, gemm in rows_order for value in (stream, gemm))
    monkeypatch.setattr(cpu_linear_plan, "_fastest_seconds", scripted)
    stream_rows, measured = measure_crossover(torch.randn(8, 64).bfloat16(), torch.bfloat16, False, SINGLE_RANK)
    assert stream_rows == expected
    assert measured == rows_order


def test_widened_linears_keep_their_bfloat16_weight_for_decode_rows(checkpoint: Path) -> None:
    native, widened = load_bf16(checkpoint, NATIVE), load_bf16(checkpoint, STREAMED_FLOAT32)
    native_modules = dict(native.named_modules())
    for name, module in widened.named_modules():
        if isinstance(module, LINEARS):
            assert torch.equal(module.streamed.weight, native_modules[name].weight)
    tied = native.lm_head.weight.data_ptr() == native.model.embed_tokens.weight.data_ptr()
    shares_the_embedding = widened.lm_head.streamed.weight.data_ptr() == widened.model.embed_tokens.weight.data_ptr()
    assert shares_the_embedding == tied  # a tied head streams the embedding itself: no third copy


@pytest.mark.parametrize(
    "rows", [1, cpu_linear.MAX_ROWS, cpu_linear.MAX_ROWS + 1], ids=["one-row", "most-streamed-rows", "float32-gemm"]
)
def test_a_widened_layer_gives_the_float32_gemm_at_any_row_count(rows: int) -> None:
    layer = ColumnParallelLinear(64, [slice(0, 48)], bias=True, matrix_rows=[48])
    layer.weight.data = torch.randn(48, 64).bfloat16()
    layer.bias.data = torch.randn(48).bfloat16()
    weight, bias = layer.weight.float(), layer.bias.float()
    layer.plan_cpu_(torch.float32, cpu_linear.MAX_ROWS, pack=False)
    x = torch.randn(rows, 64).bfloat16()
    torch.testing.assert_close(layer(x), F.linear(x.float(), weight, bias).bfloat16(), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("rows", [1, 8, 9], ids=["one-row", "most-streamed-rows", "gemm"])
def test_a_bfloat16_layer_streams_up_to_its_stream_rows_and_runs_the_gemm_above(rows: int) -> None:
    layer = RowParallelLinear(64, 48, SINGLE_RANK)
    layer.weight.data = torch.randn(48, 64).bfloat16()
    layer.plan_cpu_(torch.bfloat16, 8, pack=False)
    assert layer.streamed is not None and layer.weight.data_ptr() == layer.streamed.weight.data_ptr()  # no copy
    x = torch.randn(rows, 64).bfloat16()
    streamed = cpu_linear.small_batch_linear(x, layer.streamed.weight)
    assert torch.equal(layer(x), streamed if rows <= 8 else F.linear(x, layer.weight))
