"""GGUF models whose linears keep the file's blocks (``--quantization gguf``): the blocks are the
converted weights once dequantized (the Llama q/k row order undone, merged layers stacked, the
tied head shared), greedy decoding gives HF's tokens on those weights or differs first where HF
itself nearly ties, and the fused decode halves give exactly the module path's logits."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from strata.kernels import cpu_attention, cpu_decoder_layer, cpu_linear, gguf_linear, native
from strata.worker import cpu_linear_plan
from strata.worker.attention import CpuAttentionBackend
from strata.worker.cpu_linear_plan import plan_quantized_linears
from strata.worker.fused_decode_layers import FusedDecoderStack
from strata.worker.gguf_weights import GgufTensor
from strata.worker.llama import LlamaForCausalLM
from strata.worker.model_loader import quantized_weights_file, resolve_model_path

from worker_helpers import SINGLE_RANK, PagedRunner, count_calls, greedy_decode, load_gguf_blocks

pytestmark = pytest.mark.skipif(native.load_library() is None, reason="no C compiler to build the CPU kernels")

NUM_TOKENS = 32
NEAR_TIE = 1e-2  # logits of HF's reference this close may order either way after int8 activations
QUESTIONS = ["Write a short poem about the sea.", "Explain what a CPU does."]


def chat_prompts(model_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [
        list(tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
        for question in QUESTIONS
    ]


def assert_greedy_equal_up_to_a_near_tie(hf: PreTrainedModel, prompts: list[list[int]], ours: list[list[int]]) -> None:
    """Each of ``ours`` equals HF's greedy continuation, or the first token that differs was
    within ``NEAR_TIE`` of HF's best logit at that position."""
    for prompt, tokens in zip(prompts, ours):
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        for position, token in enumerate(tokens):
            best = int(logits[position].argmax())
            if best != token:
                gap = float(logits[position, best] - logits[position, token])
                assert gap <= NEAR_TIE, f"token {position}: ours {token}, HF {best}, {gap:.3g} apart in HF's logits"
                break


# Past what the fused layers take on streamed bfloat16 weights, and past a chunk long enough for
# the chunk attention: steps of up to this many rows multiply the blocks in the fused halves.
FUSED_ROWS = 4 * cpu_linear.MAX_ROWS


@pytest.fixture(scope="module")
def default_model() -> Iterator[LlamaForCausalLM]:
    yield load_gguf_blocks(None, block_rows=FUSED_ROWS)


def forbid_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    def timing(run) -> float:
        raise AssertionError("timed again")

    monkeypatch.setattr(cpu_linear_plan, "_fastest_seconds", timing)


@pytest.fixture
def new_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty cache folder and a process that has timed nothing yet; its plans folder."""
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_linear_plan, "_measured", {})
    return tmp_path / "plans"


def test_a_later_engine_of_the_process_reuses_the_measured_crossovers_rather_than_timing_anew(
    default_model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Re-timed, a crossover may move with the machine's noise and the bits of a step with it.
    first = plan_quantized_linears(default_model, torch.float32, SINGLE_RANK)
    forbid_timing(monkeypatch)
    assert plan_quantized_linears(default_model, torch.float32, SINGLE_RANK) == first


def test_a_later_process_on_the_machine_reuses_the_stored_crossovers_rather_than_timing_anew(
    default_model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch, new_machine: Path
) -> None:
    first = plan_quantized_linears(default_model, torch.float32, SINGLE_RANK)
    assert list(new_machine.glob("crossover-*.json")), "the timings were not stored"
    monkeypatch.setattr(cpu_linear_plan, "_measured", {})  # as a new process starts
    forbid_timing(monkeypatch)
    assert plan_quantized_linears(default_model, torch.float32, SINGLE_RANK) == first


def test_a_cache_folder_that_cannot_be_written_still_gives_the_plan(
    default_model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("")
    monkeypatch.setenv("STRATA_CACHE_DIR", str(not_a_folder))
    monkeypatch.setattr(cpu_linear_plan, "_measured", {})
    assert plan_quantized_linears(default_model, torch.float32, SINGLE_RANK).block_rows


NO_BFLOAT16_PRODUCTS = pytest.mark.skipif(
    native.load_library() is None or not gguf_linear.bfloat16_dot_products(),
    reason="this CPU's kernels have no AVX512-BF16 products beside int16 ones (AMX tiles, or no AVX512-BF16)",
)


@NO_BFLOAT16_PRODUCTS
def test_a_bfloat16_plan_times_where_avx512_bf16_products_overtake_int16_ones_for_each_block_type(
    default_model: LlamaForCausalLM, new_machine: Path
) -> None:
    plan = plan_quantized_linears(default_model, torch.bfloat16, SINGLE_RANK)
    interleaved_types = {part.base_type for module in default_model.modules()
                         if getattr(module, "quantized", None) is not None
                         for part in module.quantized.matrix.parts if part.type & gguf_linear.INTERLEAVED}
    assert set(plan.dot_rows) == interleaved_types
    first_rows = {0} | {max(rows + 1, cpu_linear_plan.DOT_CANDIDATE_ROWS[0]) for rows in (0, *cpu_linear_plan.DOT_CANDIDATE_ROWS[:-1])}
    assert set(plan.dot_rows.values()) <= first_rows
    assert "int16/AVX512-BF16 products by rows" in plan.describe()


def test_a_float32_plan_keeps_int16_products_at_every_step(default_model: LlamaForCausalLM) -> None:
    assert plan_quantized_linears(default_model, torch.float32, SINGLE_RANK).dot_rows == {}


def test_a_matrix_turns_to_avx512_bf16_products_only_where_every_part_does() -> None:
    q4_1, q8_0 = gguf_linear.TYPES["Q4_1"], gguf_linear.TYPES["Q8_0"]
    part = {code: gguf_linear.QuantizedPart(torch.zeros(16, 20 if code == q4_1 else 34, dtype=torch.uint8), code)
            for code in (q4_1, q8_0)}
    both = gguf_linear.QuantizedMatrix([part[q4_1], part[q8_0]], 32)
    plan = cpu_linear_plan.QuantizedLinearPlan({q4_1: 64, q8_0: 64}, torch.bfloat16, "tests", {q4_1: 25, q8_0: 49})
    assert plan.dot_rows_for(both) == 49
    assert plan.dot_rows_for(gguf_linear.QuantizedMatrix([part[q4_1]], 32)) == 25
    never = cpu_linear_plan.QuantizedLinearPlan({q4_1: 64, q8_0: 64}, torch.bfloat16, "tests", {q4_1: 25, q8_0: 0})
    assert never.dot_rows_for(both) == 0


def test_another_thread_count_times_the_crossovers_anew(
    default_model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch, new_machine: Path
) -> None:
    plan_quantized_linears(default_model, torch.float32, SINGLE_RANK)
    monkeypatch.setattr(cpu_linear_plan, "_measured", {})
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        plan_quantized_linears(default_model, torch.float32, SINGLE_RANK)
    finally:
        torch.set_num_threads(threads)
    assert len(list(new_machine.glob("crossover-*.json"))) == 2 * len(
        {part.base_type for module in default_model.modules() if getattr(module, "quantized", None) is not None
         for part in module.quantized.matrix.parts}
    )


def test_the_linears_blocks_are_the_converted_weights(default_model: LlamaForCausalLM) -> None:
    model_dir = resolve_model_path(None)
    with safe_open(model_dir / "model.safetensors", framework="pt") as converted:
        layer = default_model.model.layers[7]
        expected = {
            "self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            "self_attn.o_proj": ["self_attn.o_proj"],
            "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
            "mlp.down_proj": ["mlp.down_proj"],
        }
        for ours, theirs in expected.items():
            blocks = layer.get_submodule(ours).quantized.matrix
            weight = torch.cat([converted.get_tensor(f"model.layers.7.{name}.weight") for name in theirs])
            assert torch.equal(gguf_linear.dequantize(blocks), weight), ours
        embedding = default_model.model.embed_tokens
        assert torch.equal(gguf_linear.dequantize(embedding.quantized.matrix), converted.get_tensor("model.embed_tokens.weight"))
    assert default_model.lm_head.quantized is embedding.quantized, "the tied head multiplies the embedding's blocks"
    floats = [name for name, _ in default_model.named_parameters()]
    assert floats and all("norm" in name for name in floats), "only the norms stay float tensors"


def test_the_default_model_decodes_hfs_greedy_tokens_up_to_a_near_tie(default_model: LlamaForCausalLM) -> None:
    model_dir = resolve_model_path(None)
    prompts = chat_prompts(model_dir)
    tokens, _ = greedy_decode(PagedRunner(default_model), prompts, NUM_TOKENS)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert_greedy_equal_up_to_a_near_tie(hf, prompts, tokens)


def test_fused_halves_on_blocks_give_exactly_the_module_logits(
    default_model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A prefill of 47 rows (more than the streaming kernel takes), then decode steps of 3: all fused.
    prompts = [[1, 510, 3543, 282], [1, 19, 253], list(range(1000, 1040))]
    decoder = default_model.model
    fused, stack = [layer.fused for layer in decoder.layers], decoder.fused_stack
    assert all(fused) and stack is not None, "every Llama layer on blocks is fused, all in one call"
    stack_calls = count_calls(monkeypatch, "decoder_stack")
    fused_tokens, fused_logits = greedy_decode(PagedRunner(default_model), prompts, 4)
    assert stack_calls[0] == 4
    try:
        decoder.fused_stack = None
        for layer in decoder.layers:
            layer.fused = None
        tokens, logits = greedy_decode(PagedRunner(default_model), prompts, 4)
    finally:
        decoder.fused_stack = stack
        for layer, halves in zip(decoder.layers, fused):
            layer.fused = halves
    assert fused_tokens == tokens
    assert torch.equal(fused_logits, logits)


def test_a_stack_split_in_two_carrying_its_residual_gives_the_bits_of_a_call_per_half(
    default_model: LlamaForCausalLM,
) -> None:
    # Decode steps of few rows run a stack on blocks in one parallel region (csrc/decoder_layer.c);
    # a later pipeline stage's stack starts from the residual an earlier one carried.
    decoder = default_model.model
    layers = [layer.fused for layer in decoder.layers]
    generator = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, 4, 16, 3, 64, generator=generator).bfloat16() for _ in layers]
    block_tables = torch.tensor([[0, 1], [3, 2]], dtype=torch.int32)
    positions = torch.tensor([20, 5])
    slot_mapping = (block_tables[torch.arange(2), positions // 16] * 16 + positions % 16).long()
    seq_lens, query_start_loc = (positions + 1).int(), torch.tensor([0, 1, 2], dtype=torch.int32)
    cos, sin = decoder.rotary_emb(positions)
    hidden = torch.randn(2, decoder.norm.weight.numel(), generator=generator).bfloat16()
    step = cpu_decoder_layer.decode_step(hidden, cos, sin, slot_mapping, block_tables, query_start_loc, seq_lens)
    assert step is not None
    halves_caches = [cache.clone() for cache in caches]
    expected, expected_residual = hidden.clone(), None
    for layer, cache in zip(layers, halves_caches):
        expected, expected_residual = layer.forward(step, cache, expected, expected_residual)
    split = len(layers) // 3
    out, residual = FusedDecoderStack.of(layers[:split]).forward(step, caches[:split], hidden.clone(), None)
    out, residual = FusedDecoderStack.of(layers[split:]).forward(step, caches[split:], out, residual)
    assert torch.equal(out, expected)
    assert torch.equal(residual, expected_residual)
    assert all(torch.equal(cache, halves_cache) for cache, halves_cache in zip(caches, halves_caches))


def test_a_prefill_chunk_long_enough_for_the_chunk_attention_leaves_the_fused_halves(
    default_model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 3 + 64 rows, fewer than FUSED_ROWS: the 64-token chunk is the module path's (the
    # fused halves attend with the paged kernel only); the 3 decode steps after it are fused.
    prompts = [[1, 19, 253], list(range(1000, 1000 + CpuAttentionBackend.LONG_CHUNK_TOKENS))]
    stack_calls = count_calls(monkeypatch, "decoder_stack")
    chunk_calls = count_calls(monkeypatch, "chunk_attention", cpu_attention)
    greedy_decode(PagedRunner(default_model), prompts, 4)
    assert stack_calls[0] == 3
    assert chunk_calls[0] == default_model.num_layers


def test_gemma3_270m_blocks_of_four_types_decode_hfs_greedy_tokens_up_to_a_near_tie() -> None:
    model = load_gguf_blocks("gemma3-270m")
    types = {part.base_type for layer in model.model.layers for part in layer.self_attn.qkv_proj.quantized.matrix.parts}
    types |= {layer.mlp.down_proj.quantized.matrix.parts[0].base_type for layer in model.model.layers}
    assert {gguf_linear.TYPE_NAMES[t] for t in types} == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    model_dir = resolve_model_path("gemma3-270m")
    prompts = chat_prompts(model_dir)
    tokens, _ = greedy_decode(PagedRunner(model), prompts, NUM_TOKENS)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert_greedy_equal_up_to_a_near_tie(hf, prompts, tokens)


def test_a_shard_that_splits_a_block_is_refused_naming_the_way_out() -> None:
    q4_k = gguf_linear.TYPES["Q4_K"]
    tensor = GgufTensor("model.layers.0.mlp.down_proj.weight", q4_k, (4, 512), torch.zeros(4, 288, dtype=torch.uint8).numpy())
    with pytest.raises(ValueError, match=r"Q4_K blocks hold 256 values, so columns 128:384 .* --quantization none"):
        tensor.columns(slice(128, 384))


@pytest.mark.parametrize(
    ("gguf", "device", "obstacle"),
    [(None, "cpu", "the model is not a GGUF file"), ("model.gguf", "cuda", "GGUF blocks are multiplied by CPU kernels")],
    ids=["not-gguf", "not-cpu"],
)
def test_quantization_gguf_where_it_cannot_run_is_refused_saying_why(gguf: str | None, device: str, obstacle: str) -> None:
    with pytest.raises(ValueError, match=f"--quantization gguf: {obstacle}"):
        quantized_weights_file("gguf", gguf, device)
    assert quantized_weights_file("auto", gguf, device) is None
