"""Where an engine step's time goes, on the CPU, in one process (``--executor uni``).

    python -m strata.launch.bench.step_profile [--num-prompts 1] [--input-len 40] [--output-len 128]

The prompts are ``strata bench throughput``'s, each ``--input-len`` tokens long. Runs them once
untimed, once timing only the decode steps, then again with wall-clock timers around the parts
of a step (no profiler: its per-call cost would distort a step made of many small calls) and
prints a Markdown table of milliseconds per step. The parts nest: the decoder holds the fused layers (all in one call on a rank alone in
its group, else a call per half; decode steps of few rows,
``kernels/cpu_decoder_layer.py``) and the linears of the module path (steps with more rows);
whatever a part does not name is its "rest" row.

Below the table: the memory bound of a one-row decode step, the bytes of weights such a step
reads (every linear's and the LM head's, as held for the step) over the bandwidth of a plain
multi-threaded read of 256 MB on huge pages (as the weights are held) measured in the same run,
and the ratios to it of the mean step (prefill steps included), of the mean decode step (one
token per running request, none admitted: what single-stream decode speed is) and of the
median decode step, in the run without the parts' timers (the engine's own speed) and in the
profiled one.
"""

import argparse
import collections
import statistics
import time
from collections.abc import Callable

import torch

from strata.engine_core.sampling_params import SamplingParams
from strata.kernels import cpu_attention, cpu_decoder_layer, cpu_kv_cache, cpu_layers, gguf_linear, reference
from strata.launch.bench.throughput import CORPUS, Workload, synthetic_prompts
from strata.launch.llm import LLM
from strata.worker import model_runner, tp_layers
from strata.worker.cpu_linear_plan import PlannedLinear
from strata.worker.cpu_memory import move_to_huge_pages

Timers = collections.defaultdict[str, list[float]]


def time_calls(owner: object, name: str, part: str, timers: Timers) -> None:
    """Replace ``owner.name`` by a wrapper that appends each call's wall time to ``timers[part]``."""
    original: Callable[..., object] = getattr(owner, name)

    def timed(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            timers[part].append(time.perf_counter() - start)

    setattr(owner, name, timed)


def time_decode_steps(core: object, timers: Timers) -> None:
    """Append to ``timers["decode step"]`` the wall time of each EngineCore step that only
    decodes: one token per running request, no request admitted."""
    schedule, step = core.scheduler.schedule, core.step
    decoding: list[bool] = []  # one entry per schedule() call of the step under way

    def noting_schedule() -> object:
        output = schedule()
        decoding.append(not output.new_requests and not output.cached.num_tokens)
        return output

    def timed_step() -> object:
        decoding.clear()
        start = time.perf_counter()
        try:
            return step()
        finally:
            if decoding == [True]:
                timers["decode step"].append(time.perf_counter() - start)

    core.scheduler.schedule = noting_schedule
    core.step = timed_step


def weight_bytes_per_row_step(model: torch.nn.Module) -> int:
    """Bytes of weights a one-row decode step reads: each linear's and the LM head's weight, the
    streamed copy where the layer streams one-row steps, the blocks where it keeps GGUF blocks."""
    total = 0
    for module in model.modules():
        if not isinstance(module, PlannedLinear):
            continue
        if module.quantized is not None:
            total += module.quantized.matrix.nbytes()
        else:
            weight = module.weight if module.streamed is None else module.streamed.weight
            total += weight.numel() * weight.element_size()
    return total


def read_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second of the fastest of a few plain reads (a sum) of ``nbytes`` on torch's
    threads, on huge pages as the engine holds its weights (faster than on 4 KB pages)."""
    data = torch.ones(nbytes // 4)
    move_to_huge_pages([data])
    data.sum()
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        fastest = min(fastest, time.perf_counter() - start)
    return nbytes / fastest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=40)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    llm = LLM(executor="uni", dtype=args.dtype)
    core = llm.engine.core
    runner = core.executor.runner
    dtype = str(runner.dtype).removeprefix("torch.")
    timers: Timers = collections.defaultdict(list)
    time_decode_steps(core, timers)

    workload = Workload(
        num_prompts=args.num_prompts, input_len_min=args.input_len, input_len_max=args.input_len, output_len=args.output_len
    )
    prompts = synthetic_prompts(llm.tokenizer.encode(CORPUS, add_special_tokens=False), workload)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    # The decode steps as the engine runs them, before the parts' timers add their calls.
    llm.reset_prefix_cache()
    timers.clear()
    llm.generate(prompts, params, use_tqdm=False)
    untimed_decode_ms = [seconds * 1e3 for seconds in timers["decode step"]]

    time_calls(core, "step", "step", timers)
    time_calls(runner, "execute", "execute", timers)
    time_calls(runner.batch, "prepare", "input preparation", timers)
    time_calls(runner.model, "forward", "decoder", timers)
    time_calls(cpu_decoder_layer, "decoder_stack", "fused layers, all in one call", timers)
    time_calls(cpu_decoder_layer, "attention_block", "fused attention halves", timers)
    time_calls(cpu_decoder_layer, "mlp_block", "fused MLP halves", timers)
    time_calls(tp_layers, "linear", "module-path linears", timers)
    for module in runner.model.modules():
        # The decoder's GGUF-block linears; the head's, also a QuantizedWeight, is the LM head's row.
        if isinstance(module, PlannedLinear) and not isinstance(module, tp_layers.ParallelLMHead) and module.quantized is not None:
            time_calls(module.quantized, "linear", "module-path linears", timers)
    time_calls(gguf_linear, "swiglu", "module-path linears", timers)  # a gate_up with its SwiGLU in the block kernel
    time_calls(cpu_attention, "paged_attention", "module-path attention, C kernel", timers)
    time_calls(cpu_attention, "chunk_attention", "module-path attention, long chunks (C)", timers)
    time_calls(reference, "chunk_attention", "module-path attention, long chunks (torch)", timers)
    time_calls(cpu_kv_cache, "write_kv_cache", "module-path KV writes", timers)
    for name in ("rms_norm", "rotary_embedding_", "silu_and_mul"):
        time_calls(cpu_layers, name, "module-path norms, rotary, SwiGLU", timers)
    time_calls(runner.model, "compute_logits", "LM head", timers)
    time_calls(model_runner, "sample", "sampler", timers)
    llm.reset_prefix_cache()
    timers.clear()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    steps = len(timers["step"])
    ms = {part: sum(seconds) * 1e3 / steps for part, seconds in timers.items()}

    decoder_parts = [
        "fused layers, all in one call", "fused attention halves", "fused MLP halves", "module-path linears", "module-path attention, C kernel",
        "module-path attention, long chunks (C)", "module-path attention, long chunks (torch)",
        "module-path KV writes", "module-path norms, rotary, SwiGLU",
    ]
    execute_parts = ["input preparation", "decoder", "LM head", "sampler"]
    rows = [("EngineCore step", ms["step"]), ("model runner execute", ms["execute"])]
    for part in execute_parts:
        rows.append((f"execute / {part}", ms.get(part, 0.0)))
        if part == "decoder":
            rows += [(f"execute / decoder / {name}", ms.get(name, 0.0)) for name in decoder_parts]
            rows.append(("execute / decoder / rest (embedding, rotary angles, Python)",
                         ms["decoder"] - sum(ms.get(name, 0.0) for name in decoder_parts)))
    rows.append(("execute / rest (batch update, metadata, sampled tokens)",
                 ms["execute"] - sum(ms.get(part, 0.0) for part in execute_parts)))
    rows.append(("scheduler and output processing", ms["step"] - ms["execute"]))
    print(f"{args.num_prompts} prompts x {args.input_len} tokens -> {args.output_len}, {dtype}: "
          f"{elapsed * 1e3 / steps:.1f} ms per step, {args.num_prompts * args.output_len / elapsed:.1f} output tokens/s")
    print("| part | ms per step | share of the step |")
    print("|---|---|---|")
    for part, value in rows:
        print(f"| {part} | {value:.2f} | {value / ms['step']:.0%} |")
    weights, bandwidth = weight_bytes_per_row_step(runner.model), read_bandwidth()
    bound_ms = weights / bandwidth * 1e3
    decode_ms = [seconds * 1e3 for seconds in timers["decode step"]]
    print(f"memory bound of a one-row step: {weights / 1e6:.0f} MB of weights / {bandwidth / 1e9:.1f} GB/s "
          f"(plain read) = {bound_ms:.2f} ms; the mean step {ms['step']:.2f} ms is {ms['step'] / bound_ms:.2f}x that")
    for label, steps_ms in (("without the parts' timers", untimed_decode_ms), ("with them", decode_ms)):
        if steps_ms:
            mean_ms, median_ms = statistics.fmean(steps_ms), statistics.median(steps_ms)
            p90_ms = sorted(steps_ms)[int(0.9 * (len(steps_ms) - 1))]
            print(f"{len(steps_ms)} decode steps {label}: mean {mean_ms:.2f} ms ({mean_ms / bound_ms:.2f}x the bound), "
                  f"median {median_ms:.2f} ms ({median_ms / bound_ms:.2f}x), p90 {p90_ms:.2f} ms, "
                  f"slowest {max(steps_ms):.2f} ms")
    llm.shutdown()


if __name__ == "__main__":
    main()
