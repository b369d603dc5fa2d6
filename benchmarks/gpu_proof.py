"""The GPU proof's benchmarks: speed against what the hardware can do, measured in the same run.

    python benchmarks/gpu_proof.py --out DIR           # on a GPU host (see gpu_proof.sh)
    python benchmarks/gpu_proof.py --tiny --out DIR    # the same code on the CPU, tiny shapes

Measured, with dummy (random) weights of Llama-3.2-1B and Llama-3.1-8B shapes in bfloat16:
- the device's memory bandwidth (a device-to-device copy) and bfloat16 peak (a large matmul);
- decode step time (forward + logits + argmax, CUDA graphs) at each batch size with each
  sequence at ``context`` tokens, against the memory bound (weight bytes + KV bytes read) /
  bandwidth; CUDA graphs against eager at batch 1;
- the attention kernel alone: decode (bytes of KV read / time against the bandwidth) and
  prefill (causal FLOPs / time against the matmul peak);
- ``strata bench throughput`` and ``strata bench serve`` on the 8B shape.
Writes ``results.json``, ``results.md`` and the server's ``serve.log`` into ``--out``.
"""

import argparse
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig

from strata import LLM
from strata.launch.bench import serve as bench_serve
from strata.launch.bench import throughput as bench_throughput
from strata.launch.bench.server_process import ServerProcess, free_port, strata_serve_command
from strata.worker.attention import AttentionMetadata, get_attention_backend
from strata.worker.cuda_graphs import CudaGraphRunner, PaddedDecode
from strata.worker.input_batch import StepInputs
from strata.worker.model_loader import load_model, resolve_model_path
from strata.worker.parallel_state import TensorParallel

SHAPES = {
    "llama-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
    ),
    "llama-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
    ),
    # The default model's tokenizer has 49,152 ids, so the tiny model takes them all.
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=49152, tie_word_embeddings=False,
    ),
}
BLOCK_SIZE = 16
# Targets of issue 13.
DECODE_BOUND_RATIO = 1.3
GRAPH_SPEEDUP = 3.0
DECODE_ATTENTION_FRACTION = 0.7
PREFILL_ATTENTION_FRACTION = 0.5


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
    engine_args: dict = field(default_factory=dict)


GPU_PLAN = Plan(
    device="cuda", dtype="bfloat16", decode_shapes=("llama-1b", "llama-8b"), decode_batches=(1, 16, 64, 256),
    context=1024, attention_shape="llama-8b", decode_attention=(64, 4096), prefill_attention=(8, 4096),
    matmul_size=8192, copy_bytes=2 << 30, e2e_shape="llama-8b", throughput=(1000, 512, 128),
    serve_concurrency=(1, 16, 64), serve_max_tokens=64, iterations=20,
)
TINY_PLAN = Plan(
    device="cpu", dtype="float32", decode_shapes=("tiny",), decode_batches=(1, 4), context=64,
    attention_shape="tiny", decode_attention=(4, 64), prefill_attention=(2, 32), matmul_size=256,
    copy_bytes=64 << 20, e2e_shape="tiny", throughput=(4, 16, 4), serve_concurrency=(2,), serve_max_tokens=4,
    iterations=3, engine_args={"executor": "uni"},
)


def save_shape(name: str, root: Path) -> Path:
    """A directory holding only the config.json of shape ``name``."""
    path = root / name
    LlamaConfig(**SHAPES[name], max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5).save_pretrained(path)
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
    )


def decode_steps(plan: Plan, shape: str, config_dir: Path, bandwidth: float) -> list[dict]:
    """Decode step time per batch size against the memory bound; graphs against eager at batch 1."""
    device, dtype = torch.device(plan.device), getattr(torch, plan.dtype)
    backend = get_attention_backend(None, device)
    model = load_model(config_dir, dtype, TensorParallel(0, 1), backend, device, "dummy")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    generator = torch.Generator().manual_seed(0)
    rows = []
    for batch in plan.decode_batches:
        inputs = _decode_inputs(batch, plan.context, model.vocab_size, generator)
        num_blocks = batch * inputs.block_tables.shape[1]
        cache_shape = (2, num_blocks, BLOCK_SIZE, model.num_kv_heads_per_rank, model.head_dim)
        caches = [torch.zeros(cache_shape, dtype=backend.cache_dtype(dtype), device=device) for _ in range(model.num_layers)]
        kv_bytes = batch * plan.context * sum(cache[:, 0, 0].numel() * cache.element_size() for cache in caches)
        bound_s = (weight_bytes + kv_bytes) / bandwidth
        modes = {"eager": PaddedDecode(model, caches, [batch], plan.context, BLOCK_SIZE, device)}
        if device.type == "cuda":
            graphs = CudaGraphRunner(model, caches, [batch], plan.context, BLOCK_SIZE, device)
            graphs.capture()
            modes["graphs"] = graphs
        row = {"shape": shape, "batch": batch, "context": plan.context, "weight_bytes": weight_bytes,
               "kv_bytes_read": kv_bytes, "memory_bound_ms": bound_s * 1e3}
        for mode, runner in modes.items():
            def step(runner=runner) -> torch.Tensor:
                return model.compute_logits(runner.run(inputs, batch)).argmax(-1)

            with torch.inference_mode():
                row[f"{mode}_ms"] = seconds_per_call(step, device, plan.iterations) * 1e3
        best = row.get("graphs_ms", row["eager_ms"])
        row["ratio_to_bound"] = best / row["memory_bound_ms"]
        if "graphs_ms" in row:
            row["graph_speedup"] = row["eager_ms"] / row["graphs_ms"]
        rows.append(row)
        del modes, caches
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


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


def _engine_flags(plan: Plan, config_dir: Path, tokenizer: Path) -> dict:
    return {"load_format": "dummy", "tokenizer": str(tokenizer), "device": plan.device, "dtype": plan.dtype,
            "max_model_len": 2048, **plan.engine_args}


def throughput(plan: Plan, config_dir: Path, tokenizer: Path) -> dict:
    num_prompts, input_len, output_len = plan.throughput
    workload = bench_throughput.Workload(
        num_prompts=num_prompts, input_len_min=input_len, input_len_max=input_len, output_len=output_len
    )
    with LLM(str(config_dir / "config.json"), **_engine_flags(plan, config_dir, tokenizer)) as llm:
        return bench_throughput.run(llm, workload)


def serve(plan: Plan, config_dir: Path, tokenizer: Path, log: Path, startup_timeout_s: float = 300) -> list[dict]:
    """``strata serve`` in a child process (its output in ``log``), loaded by ``strata bench serve``
    at each concurrency."""
    port = free_port()
    flags = ["--model", str(config_dir / "config.json")]
    for name, value in (_engine_flags(plan, config_dir, tokenizer) | {"executor": "mp"}).items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    with ServerProcess(strata_serve_command(port, flags), port, log) as server:
        server.wait_healthy(startup_timeout_s)
        results = []
        for concurrency in plan.serve_concurrency:
            load = bench_serve.Load(url=server.url, num_prompts=max(4, 2 * concurrency), max_concurrency=concurrency,
                                    max_tokens=plan.serve_max_tokens)
            results.append(bench_serve.run(load))
        return results


def device_name(plan: Plan) -> str:
    if plan.device == "cuda":
        return torch.cuda.get_device_name()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return "cpu"


def run(plan: Plan, out: Path, tokenizer: Path) -> dict:
    started = time.monotonic()
    models = Path(out) / "models"
    results: dict = {"device": device_name(plan), "plan": asdict(plan), "torch": torch.__version__}
    results["copy_bandwidth_bytes_per_s"] = bandwidth = copy_bandwidth(plan)
    results["matmul_peak_flop_per_s"] = peak = matmul_peak(plan)
    results["decode_steps"] = [row for shape in plan.decode_shapes for row in decode_steps(plan, shape, save_shape(shape, models), bandwidth)]
    results["decode_attention"] = decode_attention(plan, bandwidth)
    results["prefill_attention"] = prefill_attention(plan, peak)
    if plan.device == "cuda":
        torch.cuda.empty_cache()  # the engines' workers size their KV cache from what is free
    e2e_dir = save_shape(plan.e2e_shape, models)
    results["throughput"] = throughput(plan, e2e_dir, tokenizer)
    results["serve"] = serve(plan, e2e_dir, tokenizer, out / "serve.log")
    results["elapsed_s"] = time.monotonic() - started
    return results


def _check(value: float, target: float, at_most: bool = False) -> str:
    met = value <= target if at_most else value >= target
    return "yes" if met else "**no**"


def markdown(results: dict) -> str:
    """The results as one Markdown table: figure, value, target, met."""
    lines = [f"Device: {results['device']} (torch {results['torch']}); run took {results['elapsed_s']:.0f} s.", "",
             "| figure | value | target | met |", "|---|---|---|---|",
             f"| device-to-device copy bandwidth | {results['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s | - | - |",
             f"| matmul peak ({results['plan']['dtype']}) | {results['matmul_peak_flop_per_s'] / 1e12:.1f} TFLOP/s | - | - |"]
    for row in results["decode_steps"]:
        best = row.get("graphs_ms", row["eager_ms"])
        lines.append(
            f"| decode step {row['shape']}, batch {row['batch']} x {row['context']} | {best:.2f} ms "
            f"(bound {row['memory_bound_ms']:.2f} ms, **{row['ratio_to_bound']:.2f}x**) | <= {DECODE_BOUND_RATIO}x | "
            f"{_check(row['ratio_to_bound'], DECODE_BOUND_RATIO, at_most=True)} |"
        )
        if row["batch"] == 1 and "graph_speedup" in row:
            lines.append(
                f"| CUDA graphs vs eager, {row['shape']}, batch 1 | {row['graphs_ms']:.2f} vs {row['eager_ms']:.2f} ms "
                f"(**{row['graph_speedup']:.2f}x**) | >= {GRAPH_SPEEDUP}x | {_check(row['graph_speedup'], GRAPH_SPEEDUP)} |"
            )
    attention = results["decode_attention"]
    lines.append(
        f"| decode attention {attention['sequences']} x {attention['context']} | {attention['bytes_per_s'] / 1e9:.0f} GB/s "
        f"(**{attention['fraction_of_bandwidth']:.0%}** of copy) | >= {DECODE_ATTENTION_FRACTION:.0%} | "
        f"{_check(attention['fraction_of_bandwidth'], DECODE_ATTENTION_FRACTION)} |"
    )
    prefill = results["prefill_attention"]
    lines.append(
        f"| prefill attention {prefill['sequences']} x {prefill['tokens']} | {prefill['flop_per_s'] / 1e12:.1f} TFLOP/s "
        f"(**{prefill['fraction_of_matmul_peak']:.0%}** of matmul) | >= {PREFILL_ATTENTION_FRACTION:.0%} | "
        f"{_check(prefill['fraction_of_matmul_peak'], PREFILL_ATTENTION_FRACTION)} |"
    )
    tp = results["throughput"]
    lines.append(
        f"| bench throughput {tp['num_prompts']} x {tp['input_len_min']} -> {tp['output_len']} | "
        f"{tp['output_tokens_per_s']:.0f} output tokens/s | - | - |"
    )
    for load in results["serve"]:
        lines.append(
            f"| bench serve, concurrency {load['max_concurrency']} | TTFT {_ms(load['median_ttft_ms'])} / "
            f"TPOT {_ms(load['median_tpot_ms'])} median, {load['failed']} failed | - | - |"
        )
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.1f} ms"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for results.json and results.md")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: checks the code path, measures nothing")
    parser.add_argument("--tokenizer", type=Path, default=None, help="tokenizer directory (default: the default model's)")
    args = parser.parse_args(argv)
    plan = TINY_PLAN if args.tiny else GPU_PLAN
    if plan.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --tiny to check the code path on the CPU")
    args.out.mkdir(parents=True, exist_ok=True)
    results = run(plan, args.out, args.tokenizer or resolve_model_path(None))
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    (args.out / "results.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # gpu_proof.sh's timeout: the server is stopped too
    main()
