"""The GPU proof's benchmarks: speed against what the hardware can do, measured in the same run.

    python benchmarks/gpu_proof.py --out DIR           # on a GPU host (see gpu_proof.sh)
    python benchmarks/gpu_proof.py --tiny --out DIR    # the same code on the CPU, tiny shapes

Measured, with dummy (random) weights of Llama-3.2-1B and Llama-3.1-8B shapes in bfloat16:
- the device's memory bandwidth (a device-to-device copy) and bfloat16 peak (a large matmul);
- decode step time (forward + logits + argmax, CUDA graphs) at each batch size with each
  sequence at ``context`` tokens, against the memory bound (weight bytes + KV bytes read) /
  bandwidth; CUDA graphs against eager at batch 1;
- decode tokens/s of the 1B shape with 8-bit linears (FP8 W8A8, FP8 weight-only, INT8) against
  the same model unquantized;
- the attention kernel alone: decode (bytes of KV read / time against the bandwidth) and
  prefill (causal FLOPs / time against the matmul peak);
- ``strata bench throughput`` and ``strata bench serve`` on the 8B shape, with a word-level
  tokenizer built here (``save_tokenizer``): no model package is needed.
Each section runs on its own: one that raises is recorded with its error and the next runs;
``results.json`` and ``results.md`` in ``--out`` are rewritten after every section, and each
figure is printed as it is measured. The server's output goes to ``serve.log`` there.
"""

import argparse
import importlib.util
import json
import math
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import LlamaConfig, PreTrainedTokenizerFast

from strata import LLM
from strata.launch.bench import serve as bench_serve
from strata.launch.bench import throughput as bench_throughput
from strata.launch.bench.server_process import ServerProcess, free_port, strata_serve_command
from strata.worker.attention import AttentionMetadata, get_attention_backend
from strata.worker.cuda_graphs import CudaGraphRunner, PaddedDecode
from strata.worker.input_batch import StepInputs
from strata.worker.model_loader import load_model, weight_bytes
from strata.worker.parallel_state import TensorParallel
from strata.worker.scaled_weights import ScaledScheme

SHAPES = {
    "llama-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
    ),
    "llama-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=1024, tie_word_embeddings=False,
    ),
}
BLOCK_SIZE = 16
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
# Imported by ``strata serve`` only; a host without them skips the serve section.
SERVER_MODULES = ("fastapi", "uvicorn", "llguidance")
# Targets of issue 13.
DECODE_BOUND_RATIO = 1.3
GRAPH_SPEEDUP = 3.0
DECODE_ATTENTION_FRACTION = 0.7
PREFILL_ATTENTION_FRACTION = 0.5
# The 8-bit linears the quantized decode section compares with the plan's dtype (issue 28),
# as --quantization fp8, fp8-weight-only and int8 hold them; None: the unquantized baseline.
QUANTIZED_LINEARS = {
    "unquantized": None,
    "fp8": ScaledScheme(torch.float8_e4m3fn, w8a8=True),
    "fp8-weight-only": ScaledScheme(torch.float8_e4m3fn, w8a8=False),
    "int8": ScaledScheme(torch.int8, w8a8=False),
}


@dataclass(frozen=True)
class Plan:
    """What one run measures, and how big."""

    device: str
    dtype: str
    decode_shapes: tuple[str, ...]
    decode_batches: tuple[int, ...]
    context: int
    attention_shape: str
    decode_attention: tuple[int, int]  # sequences x context
    prefill_attention: tuple[int, int]  # sequences x new tokens
    matmul_size: int
    copy_bytes: int
    e2e_shape: str
    throughput: tuple[int, int, int]  # prompts, input tokens, output tokens
    serve_concurrency: tuple[int, ...]
    serve_max_tokens: int
    iterations: int
    quantized_shape: str
    quantized_batches: tuple[int, ...]
    engine_args: dict = field(default_factory=dict)


GPU_PLAN = Plan(
    device="cuda", dtype="bfloat16", decode_shapes=("llama-1b", "llama-8b"), decode_batches=(1, 16, 64, 256),
    context=1024, attention_shape="llama-8b", decode_attention=(64, 4096), prefill_attention=(8, 4096),
    matmul_size=8192, copy_bytes=2 << 30, e2e_shape="llama-8b", throughput=(1000, 512, 128),
    serve_concurrency=(1, 16, 64), serve_max_tokens=64, iterations=20, quantized_shape="llama-1b",
    quantized_batches=(1, 16, 64),
)
TINY_PLAN = Plan(
    device="cpu", dtype="float32", decode_shapes=("tiny",), decode_batches=(1, 4), context=64,
    attention_shape="tiny", decode_attention=(4, 64), prefill_attention=(2, 32), matmul_size=256,
    copy_bytes=64 << 20, e2e_shape="tiny", throughput=(4, 16, 4), serve_concurrency=(2,), serve_max_tokens=4,
    iterations=3, quantized_shape="tiny", quantized_batches=(1,), engine_args={"executor": "uni"},
)


def save_shape(name: str, root: Path) -> Path:
    """A directory holding only the config.json of shape ``name``."""
    path = root / name
    LlamaConfig(**SHAPES[name], max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5).save_pretrained(path)
    return path


def save_tokenizer(path: Path, vocab_size: int) -> Path:
    """Save to ``path`` a word-level tokenizer of exactly ``vocab_size`` ids: the special tokens,
    every word of the benchmarks' texts (so their prompts are distinct token sequences), then
    placeholders, so that every id a dummy model samples decodes."""
    split = pre_tokenizers.Whitespace()
    texts = [bench_throughput.CORPUS, " ".join(bench_serve._WORDS)]
    words = dict.fromkeys(SPECIAL_TOKENS + [word for text in texts for word, _ in split.pre_tokenize_str(text)])
    vocab = {word: index for index, word in enumerate(words)}
    if len(vocab) > vocab_size:
        raise ValueError(f"the benchmarks' texts have {len(vocab)} distinct words, more than {vocab_size} ids")
    vocab |= {f"<unused_{index}>": index for index in range(len(vocab), vocab_size)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = split
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(path)
    return path


def seconds_per_call(work: Callable[[], object], device: torch.device, iterations: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        work()
    if device.type != "cuda":
        started = time.perf_counter()
        for _ in range(iterations):
            work()
        return (time.perf_counter() - started) / iterations
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iterations):
        work()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iterations


def copy_bandwidth(plan: Plan) -> float:
    """Bytes per second of a device-to-device copy (each byte read once and written once)."""
    device = torch.device(plan.device)
    source = torch.empty(plan.copy_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    seconds = seconds_per_call(lambda: target.copy_(source), device, plan.iterations)
    return 2 * plan.copy_bytes / seconds


def matmul_peak(plan: Plan) -> float:
    """FLOP/s of a large square matmul in the plan's dtype."""
    device, n = torch.device(plan.device), plan.matmul_size
    a = torch.randn(n, n, dtype=getattr(torch, plan.dtype), device=device)
    b = torch.randn_like(a)
    return 2 * n**3 / seconds_per_call(lambda: a @ b, device, plan.iterations)


def _decode_inputs(batch: int, context: int, vocab_size: int, generator: torch.Generator) -> StepInputs:
    """A decode step of ``batch`` sequences whose new token is the ``context``-th, blocks shuffled."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    tables = torch.randperm(batch * blocks_per_seq, generator=generator).reshape(batch, blocks_per_seq)
    tables = tables.numpy().astype(np.int32)
    positions = np.full(batch, context - 1, dtype=np.int64)
    slots = tables[:, (context - 1) // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
    return StepInputs(
        rows=np.arange(batch),
        num_scheduled=np.ones(batch, dtype=np.int64),
        token_ids=torch.randint(vocab_size, (batch,), generator=generator).numpy(),
        positions=positions,
        slot_mapping=slots,
        query_start_loc=np.arange(batch + 1),
        seq_lens=np.full(batch, context, dtype=np.int64),
        block_tables=tables,
        lora_slots=np.full(batch, -1, dtype=np.int64),
    )


def decode_steps(plan: Plan, shape: str, config_dir: Path, bandwidth: float) -> Iterator[dict]:
    """Decode step time at each batch size against the memory bound, and graphs against eager,
    one row per batch size as it is measured."""
    device, dtype = torch.device(plan.device), getattr(torch, plan.dtype)
    backend = get_attention_backend(None, device)
    model = load_model(config_dir, dtype, TensorParallel(0, 1), backend, device, "dummy")
    model_bytes = weight_bytes(model)
    generator = torch.Generator().manual_seed(0)
    for batch in plan.decode_batches:
        inputs = _decode_inputs(batch, plan.context, model.vocab_size, generator)
        caches = _kv_caches(model, batch * inputs.block_tables.shape[1], backend.cache_dtype(dtype), device)
        kv_bytes = batch * plan.context * sum(cache[:, 0, 0].numel() * cache.element_size() for cache in caches)
        bound_s = (model_bytes + kv_bytes) / bandwidth
        row = {"shape": shape, "batch": batch, "context": plan.context, "weight_bytes": model_bytes,
               "kv_bytes_read": kv_bytes, "memory_bound_ms": bound_s * 1e3}
        row |= _decode_ms(plan, model, caches, inputs, batch)
        best = row.get("graphs_ms", row["eager_ms"])
        row["ratio_to_bound"] = best / row["memory_bound_ms"]
        if "graphs_ms" in row:
            row["graph_speedup"] = row["eager_ms"] / row["graphs_ms"]
        del caches
        if device.type == "cuda":
            torch.cuda.empty_cache()
        yield row


def _kv_caches(model: torch.nn.Module, num_blocks: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    cache_shape = (2, num_blocks, BLOCK_SIZE, model.num_kv_heads_per_rank, model.head_dim)
    return [torch.zeros(cache_shape, dtype=dtype, device=device) for _ in range(model.num_layers)]


def _decode_ms(plan: Plan, model: torch.nn.Module, caches: list[torch.Tensor], inputs: StepInputs, batch: int) -> dict:
    """Milliseconds per decode step (forward + logits + argmax) of ``inputs``: ``eager_ms``, and on
    CUDA ``graphs_ms``."""
    device = torch.device(plan.device)
    modes = {"eager": PaddedDecode(model, caches, [batch], plan.context, BLOCK_SIZE, device)}
    if device.type == "cuda":
        graphs = CudaGraphRunner(model, caches, [batch], plan.context, BLOCK_SIZE, device)
        graphs.capture()
        modes["graphs"] = graphs
    times = {}
    for mode, runner in modes.items():
        def step(runner=runner) -> torch.Tensor:
            return model.compute_logits(runner.run(inputs, batch)).argmax(-1)

        with torch.inference_mode():
            times[f"{mode}_ms"] = seconds_per_call(step, device, plan.iterations) * 1e3
    return times


def quantized_decode(plan: Plan, config_dir: Path) -> Iterator[dict]:
    """Decode tokens/s of the ``plan.quantized_shape`` model at each of ``plan.quantized_batches``
    with its linears in the plan's dtype, then 8-bit (``QUANTIZED_LINEARS``), one row per model
    and batch as it is measured; each 8-bit row also gives its speed-up over the unquantized one."""
    device, dtype = torch.device(plan.device), getattr(torch, plan.dtype)
    backend = get_attention_backend(None, device)
    baseline: dict[int, float] = {}
    for name, scheme in QUANTIZED_LINEARS.items():
        model = load_model(config_dir, dtype, TensorParallel(0, 1), backend, device, "dummy", scaled=scheme)
        generator = torch.Generator().manual_seed(0)
        for batch in plan.quantized_batches:
            inputs = _decode_inputs(batch, plan.context, model.vocab_size, generator)
            caches = _kv_caches(model, batch * inputs.block_tables.shape[1], backend.cache_dtype(dtype), device)
            times = _decode_ms(plan, model, caches, inputs, batch)
            tokens_per_s = batch / times.get("graphs_ms", times["eager_ms"]) * 1e3
            baseline.setdefault(batch, tokens_per_s)
            yield {"shape": plan.quantized_shape, "linears": name, "batch": batch, "context": plan.context,
                   "weight_bytes": weight_bytes(model), "tokens_per_s": tokens_per_s, "speedup": tokens_per_s / baseline[batch]}
        del model, caches
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _attention_batch(plan: Plan, num_seqs: int, query_len: int, context: int):
    """Query, new K/V, a shuffled paged cache and its metadata for ``num_seqs`` equal sequences."""
    config = SHAPES[plan.attention_shape]
    device, dtype = torch.device(plan.device), getattr(torch, plan.dtype)
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    generator = torch.Generator().manual_seed(1)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    tables = torch.randperm(num_seqs * blocks_per_seq, generator=generator).reshape(num_seqs, blocks_per_seq)
    positions = torch.arange(context - query_len, context).repeat(num_seqs)
    seq_of_token = torch.arange(num_seqs).repeat_interleave(query_len)
    slots = tables[seq_of_token, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    meta = AttentionMetadata(
        slot_mapping=slots.to(device),
        block_tables=tables.int().to(device),
        query_start_loc=(torch.arange(num_seqs + 1) * query_len).int().to(device),
        seq_lens=torch.full((num_seqs,), context, dtype=torch.int32, device=device),
        max_query_len=query_len,
        max_seq_len=context,
    )
    backend = get_attention_backend(None, device)
    cache = torch.randn(2, num_seqs * blocks_per_seq, BLOCK_SIZE, kv_heads, head_dim, device=device).to(
        backend.cache_dtype(dtype)
    )
    tokens = num_seqs * query_len
    query = torch.randn(tokens, heads, head_dim, dtype=dtype, device=device)
    key = torch.randn(tokens, kv_heads, head_dim, dtype=cache.dtype, device=device)
    value = torch.randn_like(key)
    return backend, query, key, value, cache, meta, head_dim**-0.5


def decode_attention(plan: Plan, bandwidth: float) -> dict:
    num_seqs, context = plan.decode_attention
    backend, query, key, value, cache, meta, scale = _attention_batch(plan, num_seqs, 1, context)
    seconds = seconds_per_call(lambda: backend.forward(query, key, value, cache, meta, scale), torch.device(plan.device), plan.iterations)
    kv_bytes = num_seqs * context * cache[:, 0, 0].numel() * cache.element_size()
    return {"sequences": num_seqs, "context": context, "ms": seconds * 1e3, "bytes_per_s": kv_bytes / seconds,
            "fraction_of_bandwidth": kv_bytes / seconds / bandwidth}


def prefill_attention(plan: Plan, peak: float) -> dict:
    num_seqs, length = plan.prefill_attention
    backend, query, key, value, cache, meta, scale = _attention_batch(plan, num_seqs, length, length)
    seconds = seconds_per_call(lambda: backend.forward(query, key, value, cache, meta, scale), torch.device(plan.device), plan.iterations)
    heads, head_dim = query.shape[1], query.shape[2]
    flops = num_seqs * 4 * heads * head_dim * length * (length + 1) / 2  # QK^T and PV over the causal half
    return {"sequences": num_seqs, "tokens": length, "ms": seconds * 1e3, "flop_per_s": flops / seconds,
            "fraction_of_matmul_peak": flops / seconds / peak}


def engine_model(plan: Plan, root: Path) -> Path:
    """The end-to-end benchmarks' model directory: the config.json of ``plan.e2e_shape`` and a
    tokenizer of its vocabulary."""
    path = save_shape(plan.e2e_shape, root)
    return save_tokenizer(path, SHAPES[plan.e2e_shape]["vocab_size"])


def _engine_flags(plan: Plan, model_dir: Path) -> dict:
    return {"load_format": "dummy", "tokenizer": str(model_dir), "device": plan.device, "dtype": plan.dtype,
            "max_model_len": 2048, **plan.engine_args}


def throughput(plan: Plan, model_dir: Path) -> dict:
    num_prompts, input_len, output_len = plan.throughput
    workload = bench_throughput.Workload(
        num_prompts=num_prompts, input_len_min=input_len, input_len_max=input_len, output_len=output_len
    )
    with LLM(str(model_dir / "config.json"), **_engine_flags(plan, model_dir)) as llm:
        return bench_throughput.run(llm, workload)


def serve(plan: Plan, model_dir: Path, log: Path, startup_timeout_s: float = 300) -> Iterator[dict]:
    """``strata serve`` in a child process (its output in ``log``), loaded by ``strata bench serve``
    at each concurrency, one result per concurrency as it is measured. Raises ``Skipped`` where
    a module the server imports is not installed."""
    missing = [module for module in SERVER_MODULES if importlib.util.find_spec(module) is None]
    if missing:
        raise Skipped(f"not installed: {', '.join(missing)}")
    port = free_port()
    flags = ["--model", str(model_dir / "config.json")]
    for name, value in (_engine_flags(plan, model_dir) | {"executor": "mp"}).items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    with ServerProcess(strata_serve_command(port, flags), port, log) as server:
        server.wait_healthy(startup_timeout_s)
        for concurrency in plan.serve_concurrency:
            load = bench_serve.Load(url=server.url, num_prompts=max(4, 2 * concurrency), max_concurrency=concurrency,
                                    max_tokens=plan.serve_max_tokens)
            yield bench_serve.run(load)


def device_name(plan: Plan) -> str:
    if plan.device == "cuda":
        return torch.cuda.get_device_name()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return "cpu"


class Skipped(Exception):
    """Raised by a section that cannot run on this host; its message says why."""


class Report:
    """One run's results, rewritten as ``results.json`` and ``results.md`` in ``out`` after every
    section; each figure's table line is printed as it is added."""

    def __init__(self, out: Path, results: dict) -> None:
        self.out = out
        self.results = results | {"sections": {}}
        self.started = time.monotonic()

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Run the ``with`` body as section ``name``: its status in ``results["sections"]`` is ok,
        ``skipped: WHY``, ``error: `` and the last line of its traceback (the run goes on with the
        next section), or interrupted (a signal's exit, which is not held up)."""
        print(f"-- {name}", flush=True)
        status = "interrupted"
        try:
            yield
            status = "ok"
        except Skipped as reason:
            status = f"skipped: {reason}"
        except Exception:
            traceback.print_exc()
            status = "error: " + traceback.format_exc().strip().splitlines()[-1]
        finally:
            self.results["sections"][name] = status
            self.write()
        print(f"-- {name}: {status}", flush=True)

    def add(self, key: str, value: object) -> None:
        self.results[key] = value
        print(*FIGURE_LINES[key](value, self.results), sep="\n", flush=True)

    def append(self, key: str, row: dict) -> None:
        self.results.setdefault(key, []).append(row)
        print(*FIGURE_LINES[key](row, self.results), sep="\n", flush=True)

    def write(self) -> None:
        self.results["elapsed_s"] = time.monotonic() - self.started
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2))
        (self.out / "results.md").write_text(markdown(self.results))


def run(plan: Plan, out: Path, models: Path) -> dict:
    """Every section of ``plan`` in turn (see the module's docstring), the models' config.json and
    tokenizer saved under ``models``; the results as written."""
    report = Report(out, {"device": device_name(plan), "plan": asdict(plan), "torch": torch.__version__})
    results = report.results
    with report.section("copy bandwidth"):
        report.add("copy_bandwidth_bytes_per_s", copy_bandwidth(plan))
    with report.section("matmul peak"):
        report.add("matmul_peak_flop_per_s", matmul_peak(plan))
    for shape in plan.decode_shapes:
        with report.section(f"decode steps {shape}"):
            for row in decode_steps(plan, shape, save_shape(shape, models), results["copy_bandwidth_bytes_per_s"]):
                report.append("decode_steps", row)
    with report.section("quantized decode"):
        for row in quantized_decode(plan, save_shape(plan.quantized_shape, models)):
            report.append("quantized_decode", row)
    with report.section("decode attention"):
        report.add("decode_attention", decode_attention(plan, results["copy_bandwidth_bytes_per_s"]))
    with report.section("prefill attention"):
        report.add("prefill_attention", prefill_attention(plan, results["matmul_peak_flop_per_s"]))
    if plan.device == "cuda":
        torch.cuda.empty_cache()  # the engines' workers size their KV cache from what is free
    with report.section("bench throughput"):
        report.add("throughput", throughput(plan, engine_model(plan, models)))
    with report.section("bench serve"):
        for load in serve(plan, engine_model(plan, models), out / "serve.log"):
            report.append("serve", load)
    return results


def _check(value: float, target: float, at_most: bool = False) -> str:
    met = value <= target if at_most else value >= target
    return "yes" if met else "**no**"


def _bandwidth_lines(bandwidth: float, results: dict) -> list[str]:
    return [f"| device-to-device copy bandwidth | {bandwidth / 1e9:.0f} GB/s | - | - |"]


def _peak_lines(peak: float, results: dict) -> list[str]:
    return [f"| matmul peak ({results['plan']['dtype']}) | {peak / 1e12:.1f} TFLOP/s | - | - |"]


def _decode_lines(row: dict, results: dict) -> list[str]:
    best = row.get("graphs_ms", row["eager_ms"])
    lines = [
        f"| decode step {row['shape']}, batch {row['batch']} x {row['context']} | {best:.2f} ms "
        f"(bound {row['memory_bound_ms']:.2f} ms, **{row['ratio_to_bound']:.2f}x**) | <= {DECODE_BOUND_RATIO}x | "
        f"{_check(row['ratio_to_bound'], DECODE_BOUND_RATIO, at_most=True)} |"
    ]
    if row["batch"] == 1 and "graph_speedup" in row:
        lines.append(
            f"| CUDA graphs vs eager, {row['shape']}, batch 1 | {row['graphs_ms']:.2f} vs {row['eager_ms']:.2f} ms "
            f"(**{row['graph_speedup']:.2f}x**) | >= {GRAPH_SPEEDUP}x | {_check(row['graph_speedup'], GRAPH_SPEEDUP)} |"
        )
    return lines


def _quantized_decode_lines(row: dict, results: dict) -> list[str]:
    return [
        f"| decode {row['shape']}, {row['linears']} linears ({row['weight_bytes'] / 1e9:.2f} GB), batch {row['batch']} x "
        f"{row['context']} | {row['tokens_per_s']:.0f} tokens/s (**{row['speedup']:.2f}x** unquantized) | - | - |"
    ]


def _decode_attention_lines(attention: dict, results: dict) -> list[str]:
    return [
        f"| decode attention {attention['sequences']} x {attention['context']} | {attention['bytes_per_s'] / 1e9:.0f} GB/s "
        f"(**{attention['fraction_of_bandwidth']:.0%}** of copy) | >= {DECODE_ATTENTION_FRACTION:.0%} | "
        f"{_check(attention['fraction_of_bandwidth'], DECODE_ATTENTION_FRACTION)} |"
    ]


def _prefill_attention_lines(prefill: dict, results: dict) -> list[str]:
    return [
        f"| prefill attention {prefill['sequences']} x {prefill['tokens']} | {prefill['flop_per_s'] / 1e12:.1f} TFLOP/s "
        f"(**{prefill['fraction_of_matmul_peak']:.0%}** of matmul) | >= {PREFILL_ATTENTION_FRACTION:.0%} | "
        f"{_check(prefill['fraction_of_matmul_peak'], PREFILL_ATTENTION_FRACTION)} |"
    ]


def _throughput_lines(tp: dict, results: dict) -> list[str]:
    return [
        f"| bench throughput {tp['num_prompts']} x {tp['input_len_min']} -> {tp['output_len']} | "
        f"{tp['output_tokens_per_s']:.0f} output tokens/s | - | - |"
    ]


def _serve_lines(load: dict, results: dict) -> list[str]:
    return [
        f"| bench serve, concurrency {load['max_concurrency']} | TTFT {_ms(load['median_ttft_ms'])} / "
        f"TPOT {_ms(load['median_tpot_ms'])} median, {load['failed']} failed | - | - |"
    ]


def _ms(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.1f} ms"


# Each figure's lines in the table, in the order of the table: a figure kept as a list has lines per row.
FIGURE_LINES: dict[str, Callable[[object, dict], list[str]]] = {
    "copy_bandwidth_bytes_per_s": _bandwidth_lines,
    "matmul_peak_flop_per_s": _peak_lines,
    "decode_steps": _decode_lines,
    "quantized_decode": _quantized_decode_lines,
    "decode_attention": _decode_attention_lines,
    "prefill_attention": _prefill_attention_lines,
    "throughput": _throughput_lines,
    "serve": _serve_lines,
}


def markdown(results: dict) -> str:
    """The figures measured so far as one Markdown table (figure, value, target, met), then every
    section that did not end ok."""
    lines = [f"Device: {results['device']} (torch {results['torch']}); run took {results['elapsed_s']:.0f} s.", "",
             "| figure | value | target | met |", "|---|---|---|---|"]
    for key, figure_lines in FIGURE_LINES.items():
        rows = results.get(key, [])
        for row in rows if isinstance(rows, list) else [rows]:
            lines += figure_lines(row, results)
    unfinished = [f"- {name}: {status}" for name, status in results["sections"].items() if status != "ok"]
    if unfinished:
        lines += ["", "Sections not completed:", *unfinished]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for results.json and results.md")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: checks the code path, measures nothing")
    args = parser.parse_args(argv)
    plan = TINY_PLAN if args.tiny else GPU_PLAN
    if plan.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --tiny to check the code path on the CPU")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as models:
        results = run(plan, args.out, Path(models))
    print(markdown(results))
    failed = [name for name, status in results["sections"].items() if status.startswith("error")]
    if failed:
        raise SystemExit(f"sections that failed: {', '.join(failed)}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # gpu_proof.sh's timeout: the server is stopped too
    main()
