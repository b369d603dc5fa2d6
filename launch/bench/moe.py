"""``python -m strata.launch.bench.moe``: one mixture-of-experts layer step (``worker/moe.py``) on
random weights, profiled, and its two tensor-parallel splits timed on two gloo ranks.

The profile runs the router and experts of one step under the torch profiler and splits the
step's wall time into the expert matmuls, the other torch ops, and what is left: Python,
dispatch and, on the CPU, the fused C SwiGLU kernel (called through ctypes, so the profiler
does not see it). The split comparison times one step, all-reduce included, with each rank holding
whole experts (expert parallel, what the engine does) or every expert's share of the
intermediate features (the dense-MLP split).
"""

import argparse
import json
import socket
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

from strata.worker.model_loader import resolve_dtype
from strata.worker.moe import Experts, TopKRouter, expert_parallel_share
from strata.worker.parallel_state import TensorParallel, init_tensor_parallel

MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"}
SPLITS = ("expert_parallel", "split_features")


@dataclass(frozen=True)
class MoEShape:
    """A tiny MoE layer: Qwen3-MoE's proportions (many narrow experts, top-k of them) scaled down."""

    hidden_size: int = 512
    intermediate_size: int = 256
    num_experts: int = 16
    top_k: int = 4
    num_tokens: int = 256
    steps: int = 20
    dtype: str = "auto"  # as the engine resolves it on this CPU (``--dtype``)


def build(shape: MoEShape, tp: TensorParallel, split: str) -> tuple[TopKRouter, Experts]:
    """Router and this rank's experts, with the same random weights on every rank."""
    if split == "expert_parallel":
        experts, features = expert_parallel_share(shape.num_experts, tp), slice(0, shape.intermediate_size)
    else:
        experts, features = slice(0, shape.num_experts), tp.shard(shape.intermediate_size)
    generator = torch.Generator().manual_seed(0)
    router = TopKRouter(shape.num_experts, shape.hidden_size, shape.top_k, renormalize=True)
    router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
    layer = Experts(
        shape.hidden_size, shape.intermediate_size, shape.num_experts, experts, features, ("gate", "up", "down")
    )
    gate_up = torch.randn(shape.num_experts, 2, shape.intermediate_size, shape.hidden_size, generator=generator) * 0.05
    down = torch.randn(shape.num_experts, shape.hidden_size, shape.intermediate_size, generator=generator) * 0.05
    layer.gate_up_proj.copy_(gate_up[experts, :, features].flatten(1, 2))
    layer.down_proj.copy_(down[experts, :, features])
    dtype = resolve_dtype(shape.dtype, "cpu")[0]
    return router.to(dtype), layer.to(dtype)


def _inputs(shape: MoEShape) -> torch.Tensor:
    x = torch.randn(shape.num_tokens, shape.hidden_size, generator=torch.Generator().manual_seed(1))
    return x.to(resolve_dtype(shape.dtype, "cpu")[0])


def _step(router: TopKRouter, layer: Experts, tp: TensorParallel, x: torch.Tensor) -> torch.Tensor:
    weights, expert_ids = router(x)
    return tp.all_reduce(layer(x, weights, expert_ids))


@torch.inference_mode()
def profile_step(shape: MoEShape) -> dict:
    """Where one step's wall time goes on one rank (milliseconds per step, and shares)."""
    torch.set_num_threads(1)  # as each rank runs below; a shared machine's second core mostly waits
    tp = TensorParallel(rank=0, size=1)
    router, layer = build(shape, tp, "expert_parallel")
    x = _inputs(shape)
    for _ in range(3):
        _step(router, layer, tp, x)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        start = time.perf_counter()
        for _ in range(shape.steps):
            _step(router, layer, tp, x)
        wall = (time.perf_counter() - start) * 1e3 / shape.steps
    events = profiler.key_averages()
    # Self times partition the time spent inside torch ops; the rest of the wall time is outside them.
    op_self = sum(event.self_cpu_time_total for event in events) / 1e3 / shape.steps
    matmul = sum(event.self_cpu_time_total for event in events if event.key in MATMUL_OPS) / 1e3 / shape.steps
    top = sorted(events, key=lambda event: event.self_cpu_time_total, reverse=True)[:8]
    return {
        "wall_ms": round(wall, 3),
        "expert_matmul_ms": round(matmul, 3),
        "other_ops_ms": round(op_self - matmul, 3),
        "outside_torch_ops_ms": round(wall - op_self, 3),
        "expert_matmul_share": round(matmul / wall, 3),
        "top_ops_self_ms": {event.key: round(event.self_cpu_time_total / 1e3 / shape.steps, 3) for event in top},
    }


def _time_rank(rank: int, size: int, port: int, shape: MoEShape, results: "mp.Queue") -> None:
    torch.set_num_threads(1)  # one core per rank
    tp = init_tensor_parallel(rank, size, f"tcp://127.0.0.1:{port}") if size > 1 else TensorParallel(0, 1)
    try:
        x = _inputs(shape)
        timings = {}
        outputs = {}
        with torch.inference_mode():
            for split in SPLITS:
                router, layer = build(shape, tp, split)
                outputs[split] = _step(router, layer, tp, x)
                samples = []
                for _ in range(shape.steps):
                    start = time.perf_counter()
                    _step(router, layer, tp, x)
                    samples.append((time.perf_counter() - start) * 1e3)
                timings[split] = round(statistics.median(samples), 3)
        agree = torch.allclose(outputs[SPLITS[0]].float(), outputs[SPLITS[1]].float(), atol=1e-2, rtol=1e-2)
        results.put((rank, timings, agree))
    finally:
        tp.destroy()


def time_splits(shape: MoEShape, size: int) -> dict:
    """Median ms per step of each split on ``size`` ranks (one thread each); rank 0's timings."""
    context = mp.get_context("spawn")
    results = context.Queue()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = [context.Process(target=_time_rank, args=(rank, size, port, shape, results)) for rank in range(size)]
    for process in ranks:
        process.start()
    try:
        by_rank = dict((rank, (timings, agree)) for rank, timings, agree in (results.get(timeout=300) for _ in ranks))
    finally:
        for process in ranks:
            process.join(30)
            if process.is_alive():
                process.kill()
    timings, _ = by_rank[0]
    return {**timings, "outputs_agree": all(agree for _, agree in by_rank.values())}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m strata.launch.bench.moe", description=__doc__.splitlines()[0])
    defaults = MoEShape()
    for field, value in asdict(defaults).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args()
    shape = MoEShape(**{field: getattr(args, field) for field in asdict(defaults)})
    result = {
        "shape": asdict(shape),
        "dtype": str(resolve_dtype(shape.dtype, "cpu")[0]),
        "profile_one_rank": profile_step(shape),
        "tp1_ms": time_splits(shape, 1),
        "tp2_ms": time_splits(shape, 2),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
