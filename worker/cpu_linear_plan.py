"""How a bfloat16 or float32 model's linear layers run on the CPU at hand, chosen at start.

Two paths compute ``x W^T`` on the CPU, and each wins at one end of the step sizes:
- a GEMM (oneDNN): in bfloat16 where the CPU multiplies bfloat16 natively (AVX512-BF16, AMX),
  on weights packed once into oneDNN's layout (``kernels.onednn_linear``), else in float32
  (``F.linear``) on float32 copies of the bfloat16 weights, exact but twice their memory (an
  emulated bfloat16 GEMM is several times slower than either); a float32 model's own float32 GEMM;
- the streamed small-batch kernel (``kernels.cpu_linear``), which reads the model's bfloat16 or
  float32 weights once per step at close to the memory bandwidth, where a GEMM tuned for many
  rows reads them at a fraction of it; its cost grows with the rows.

A step of at most ``stream_rows`` rows streams (and Llama layers then run as two fused C calls,
``worker/fused_decode_layers.py``); larger steps run the GEMM. ``stream_rows`` is the crossover
measured at start on a slice of the model's own largest linear: the largest row count of
``CANDIDATE_ROWS`` up to which streaming is no slower than the GEMM. Every tensor-parallel rank
adds up the same timings, so all ranks choose alike.

The two paths round differently, so a crossover moved by a noisy timing changes the bits a step
computes, and with them a sampled token at a near tie. A single rank therefore measures each
crossover once per machine (kernels, torch and thread count) and keeps it under
``$STRATA_CACHE_DIR/plans``; every engine started later, in this process or another, reuses it:
two engines on the same weights compute alike (the test of drafts against no drafts relies on
it), and a start skips the second or two the timings take.
"""

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels import cpu_features, cpu_linear, gguf_linear, native, onednn_linear
from strata.worker.config import CPU_BF16_LINEAR_MODES
from strata.worker.fused_decode_layers import fuse_cpu_decode_layers
from strata.worker.parallel_state import TensorParallel
from strata.worker.tp_layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, linear

CANDIDATE_ROWS = (1, 2, 4, 8, 16, 32)
QUANTIZED_CANDIDATE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# Where the int16 kernel may give way to vdpbf16ps. Not below 32 rows: the slice timed here sits
# in L2, where a group's dequantization costs little, and from memory, as a step's layers come,
# it does not pay for itself (EPYC-Zen4, 30 layers' linears: 12-24 rows 0.80-0.96x the int16
# kernel's speed where the slice timed them faster from 9 rows; 32 rows 1.02x, 64 1.14x).
DOT_CANDIDATE_ROWS = (32, 48, 64, 128, 256)
SAMPLE_FEATURES = 1024  # output features of the timed slice: the per-weight cost, in a few ms
TIMED_REPEATS = 5

PlannedLinear = ColumnParallelLinear | RowParallelLinear | ParallelLMHead  # the layers a plan applies to
Crossover = tuple[int, list[tuple[int, float, float]]]  # (rows, [(rows, small s, large s), ...])

logger = logging.getLogger(__name__)

_measured: dict[tuple, Crossover] = {}  # this process's single-rank crossovers, by what was timed


@dataclass(frozen=True)
class CpuLinearPlan:
    """The GEMM's weight dtype, whether its weights are oneDNN-packed, and up to how many rows a
    step streams the model's own weights (``streamed_dtype``) instead (0: never)."""

    gemm_dtype: torch.dtype
    packed: bool
    stream_rows: int
    reason: str
    streamed_dtype: torch.dtype = torch.bfloat16

    def describe(self) -> str:
        gemm = f"{'packed ' if self.packed else ''}{str(self.gemm_dtype).removeprefix('torch.')} GEMM"
        if not self.stream_rows:
            return f"{gemm} at every step ({self.reason})"
        body = cpu_linear.body() if self.streamed_dtype == torch.bfloat16 else "float32 FMAs"
        return (
            f"steps of <= {self.stream_rows} rows stream the {str(self.streamed_dtype).removeprefix('torch.')} "
            f"weights ({body}), larger steps run the {gemm} ({self.reason})"
        )


def plan_cpu_linears(
    mode: str, model: nn.Module, dtype: torch.dtype, device: torch.device | str, tp: TensorParallel
) -> CpuLinearPlan | None:
    """The plan for ``--cpu-bf16-linear mode``, or None where there is no choice to make: a model
    that is neither bfloat16 nor float32, or not on the CPU, or a float32 one with no linear to
    stream (GGUF blocks: ``plan_quantized_linears``).

    A bfloat16 model: ``native``: oneDNN's bfloat16 GEMM at every step. ``float32``: float32
    GEMMs on float32 copies, streaming below the measured crossover. ``auto``: the bfloat16 GEMM
    where the CPU has native bfloat16, else float32 copies; streaming below the crossover either
    way. A float32 model streams its weights below the crossover with its float32 GEMM (``mode``
    has nothing to choose there): at few rows that GEMM reads them at a fraction of a plain read.
    """
    if mode not in CPU_BF16_LINEAR_MODES:
        raise ValueError(f"cpu_bf16_linear must be one of {', '.join(CPU_BF16_LINEAR_MODES)}, got {mode!r}")
    if dtype not in (torch.bfloat16, torch.float32) or torch.device(device).type != "cpu":
        return None
    if dtype == torch.float32:
        weight = _largest_streamable_weight(model)
        if weight is None:
            return None
        return _streaming_plan(weight, torch.float32, False, "a float32 model", tp)
    if mode == "native":
        return CpuLinearPlan(torch.bfloat16, _packs(torch.bfloat16), 0, "--cpu-bf16-linear native")
    if mode == "float32":
        gemm_dtype, why = torch.float32, "--cpu-bf16-linear float32"
    elif cpu_features.has_native_bf16():
        gemm_dtype, why = torch.bfloat16, f"auto: the CPU ({cpu_features.isa_level()}) computes bfloat16 natively"
    else:
        gemm_dtype, why = torch.float32, f"auto: the CPU ({cpu_features.isa_level()}) lacks native bfloat16"
    packed = _packs(gemm_dtype)
    weight = _largest_streamable_weight(model)
    if weight is None:
        return CpuLinearPlan(gemm_dtype, packed, 0, f"{why}; no linear can be streamed")
    return _streaming_plan(weight, gemm_dtype, packed, why, tp)


def _streaming_plan(
    weight: torch.Tensor, gemm_dtype: torch.dtype, packed: bool, why: str, tp: TensorParallel
) -> CpuLinearPlan:
    """The plan streaming ``weight``'s dtype up to the crossover measured on a slice of it."""
    sample = weight[:SAMPLE_FEATURES].contiguous()
    stream_rows, timings = _measured_once(
        (f"{sample.dtype} streamed", tuple(sample.shape), gemm_dtype, packed),
        tp,
        lambda: measure_crossover(sample, gemm_dtype, packed, tp),
    )
    measured = ", ".join(f"{rows}: {stream * 1e6:.0f}/{gemm * 1e6:.0f}" for rows, stream, gemm in timings)
    reason = f"{why}; us streamed/GEMM by rows on {list(sample.shape)}: {measured}"
    return CpuLinearPlan(gemm_dtype, packed, stream_rows, reason, sample.dtype)


def measure_crossover(
    weight: torch.Tensor, gemm_dtype: torch.dtype, packed: bool, tp: TensorParallel
) -> Crossover:
    """The largest of ``CANDIDATE_ROWS`` up to which streaming ``weight`` (bfloat16 or float32) is
    no slower than the GEMM on its ``gemm_dtype`` copy (``packed`` or not), with the (rows, stream
    s, GEMM s) timings summed over the ranks of ``tp``, on rows of the weight's dtype."""
    gemm_weight = weight.to(gemm_dtype)
    gemm_packed = onednn_linear.pack(gemm_weight) if packed else None
    return _crossover(
        CANDIDATE_ROWS,
        weight.shape[1],
        weight.dtype,
        lambda x: cpu_linear.small_batch_linear(x, weight),
        lambda x: linear(x, gemm_weight, packed=gemm_packed),
        tp,
    )


def _crossover(
    candidates: tuple[int, ...],
    features: int,
    dtype: torch.dtype,
    small: Callable[[torch.Tensor], object],
    large: Callable[[torch.Tensor], object],
    tp: TensorParallel,
) -> Crossover:
    """The row count (one of ``candidates``, or 0) up to which ``small`` on that many random rows
    of ``features`` values is no slower than ``large`` and past which it is slower, with the
    (rows, small s, large s) timings summed over the ranks of ``tp`` (so that every rank chooses
    alike).

    A neighbour's burst can slow one timing tenfold, so the crossover is not where ``small``
    first loses but the split that the most row counts agree with (ties: the fewest rows)."""
    generator = torch.Generator().manual_seed(0)
    seconds = torch.zeros(len(candidates), 2, dtype=torch.float64)
    for i, rows in enumerate(candidates):
        x = torch.randn(rows, features, generator=generator).to(dtype)
        seconds[i, 0] = _fastest_seconds(lambda: small(x))
        seconds[i, 1] = _fastest_seconds(lambda: large(x))
    timings = [(rows, small_s, large_s) for rows, (small_s, large_s) in zip(candidates, tp.all_reduce(seconds).tolist())]
    wins = [small_s <= large_s for _, small_s, large_s in timings]
    agreeing = [sum(wins[:split]) + wins[split:].count(False) for split in range(len(wins) + 1)]
    split = agreeing.index(max(agreeing))
    return (candidates[split - 1] if split else 0), timings


@dataclass(frozen=True)
class QuantizedLinearPlan:
    """Up to how many rows a step multiplies GGUF blocks as stored, by block type
    (``block_rows``: ggml type code -> rows); larger steps dequantize the weight for the step and
    run the GEMM in the activations' dtype. Types differ: a Q8_0 head decodes cheaply in the block
    kernel but costs more to dequantize than a Q4 linear, so its crossover lies further out.
    ``dot_rows`` (type -> rows, 0: never; types absent: never) is where the block kernel turns
    from int16 dot products to AVX512-BF16 ones, on CPUs that have both
    (``QuantizedMatrix.bfloat16_dot_rows``)."""

    block_rows: dict[int, int]
    dtype: torch.dtype
    reason: str
    dot_rows: dict[int, int] = field(default_factory=dict)

    def rows_for(self, matrix: gguf_linear.QuantizedMatrix) -> int:
        """The rows up to which ``matrix`` multiplies its blocks: its parts' smallest crossover."""
        return min(self.block_rows[part.base_type] for part in matrix.parts)

    def dot_rows_for(self, matrix: gguf_linear.QuantizedMatrix) -> int:
        """The rows from which ``matrix`` multiplies by AVX512-BF16 products: its parts' largest
        crossover, or 0 (never) where some part's type never does."""
        rows = [self.dot_rows.get(part.base_type, 0) for part in matrix.parts]
        return 0 if 0 in rows else max(rows)

    def describe(self) -> str:
        rows = ", ".join(f"{rows} ({gguf_linear.TYPE_NAMES[code]})" for code, rows in self.block_rows.items())
        dots = ", ".join(f"{rows or 'never'} ({gguf_linear.TYPE_NAMES[code]})" for code, rows in self.dot_rows.items())
        gemm = f"dequantize each weight for the step and run the {str(self.dtype).removeprefix('torch.')} GEMM"
        products = f"; AVX512-BF16 products from {dots} rows" if dots else ""
        return (
            f"steps of at most {rows} rows multiply the blocks ({gguf_linear.body()}{products}), "
            f"larger ones {gemm} ({self.reason})"
        )


def plan_quantized_linears(model: nn.Module, dtype: torch.dtype, tp: TensorParallel) -> QuantizedLinearPlan | None:
    """The plan for a model whose linears keep GGUF blocks (``tp_layers.QuantizedWeight``), or
    None where none does: for each block type, the crossover of ``QUANTIZED_CANDIDATE_ROWS``
    between the block kernel and dequantize-then-GEMM, timed on a slice of the largest part of
    that type (the layouts as held: interleaved where the layer holds them so)."""
    largest: dict[int, tuple[gguf_linear.QuantizedPart, int]] = {}  # type -> (part, its in_features)
    for module in model.modules():
        if isinstance(module, PlannedLinear) and module.quantized is not None:
            for part in module.quantized.matrix.parts:
                held = largest.get(part.base_type)
                if held is None or part.data.numel() > held[0].data.numel():
                    largest[part.base_type] = (part, module.quantized.matrix.in_features)
    if not largest:
        return None
    block_rows, dot_rows, measured = {}, {}, []
    # Every rank times the products or none does (each timing is a collective); ranks on CPUs of
    # different kinds keep the int16 kernel unless all have the products.
    ranks_with_products = torch.tensor([float(gguf_linear.bfloat16_dot_products())], dtype=torch.float64)
    products = dtype == torch.bfloat16 and tp.all_reduce(ranks_with_products).item() == tp.size
    for code, (part, in_features) in sorted(largest.items()):
        slice_ = gguf_linear.QuantizedPart(part.data[:SAMPLE_FEATURES].contiguous(), part.type)
        if products and part.type & gguf_linear.INTERLEAVED:
            dot_rows[code], dot_timings = _dot_crossover(slice_, in_features, tp)
            measured.append(f"{gguf_linear.TYPE_NAMES[code]} int16/AVX512-BF16 products by rows: " + ", ".join(
                f"{rows}: {int16 * 1e6:.0f}/{dot * 1e6:.0f}" for rows, int16, dot in dot_timings
            ))
        sample = gguf_linear.QuantizedMatrix([slice_], in_features, dot_rows.get(code, 0))
        crossover, timings = _measured_once(
            ("gguf blocks", part.type, tuple(slice_.data.shape), in_features, dtype, dot_rows.get(code, 0)),
            tp,
            lambda: _crossover(
                QUANTIZED_CANDIDATE_ROWS,
                in_features,
                dtype,
                lambda x: gguf_linear.linear(x, sample),
                lambda x: F.linear(x, gguf_linear.dequantize(sample, dtype)),
                tp,
            ),
        )
        # A dequantization reads the blocks and writes 2-4x their bytes: at one row it cannot win,
        # and where timings on a busy machine say otherwise they are noise.
        block_rows[code] = max(crossover, 1)
        shape = [sample.out_features, in_features]
        measured.append(f"{gguf_linear.TYPE_NAMES[code]} {shape}: " + ", ".join(
            f"{rows}: {small * 1e6:.0f}/{large * 1e6:.0f}" for rows, small, large in timings
        ))
    return QuantizedLinearPlan(block_rows, dtype, "us blocks/dequantize+GEMM by rows on " + "; ".join(measured), dot_rows)


def _dot_crossover(part: gguf_linear.QuantizedPart, in_features: int, tp: TensorParallel) -> tuple[int, list]:
    """The rows from which the block kernel multiplies the interleaved ``part`` faster by
    AVX512-BF16 products than by int16 ones (0: at none of ``DOT_CANDIDATE_ROWS``), with the
    (rows, int16 s, AVX512-BF16 s) timings. The crossover depends on the CPU: how fast it issues
    vdpbf16ps beside the int16 kernel's instructions."""
    int16 = gguf_linear.QuantizedMatrix([part], in_features)
    dot = gguf_linear.QuantizedMatrix([part], in_features, bfloat16_dot_rows=1)
    crossover, timings = _measured_once(
        ("gguf bfloat16 products", DOT_CANDIDATE_ROWS, part.type, tuple(part.data.shape), in_features),
        tp,
        lambda: _crossover(
            DOT_CANDIDATE_ROWS,
            in_features,
            torch.bfloat16,
            lambda x: gguf_linear.linear(x, int16),
            lambda x: gguf_linear.linear(x, dot),
            tp,
        ),
    )
    if crossover == DOT_CANDIDATE_ROWS[-1]:
        return 0, timings
    return max(crossover + 1, DOT_CANDIDATE_ROWS[0]), timings


def apply_quantized_linear_plan(model: nn.Module, plan: QuantizedLinearPlan) -> None:
    """Let every GGUF-block linear (the LM head too) multiply the blocks in steps of up to its
    types' rows, and the Llama decoder layers run the steps all their linears take as fused C
    calls."""
    layer_rows = []
    for module in model.modules():
        quantized = getattr(module, "quantized", None)
        if isinstance(module, PlannedLinear) and quantized is not None:
            quantized.max_rows = plan.rows_for(quantized.matrix)
            quantized.matrix.set_bfloat16_dot_rows(plan.dot_rows_for(quantized.matrix))
            if not isinstance(module, ParallelLMHead):
                layer_rows.append(quantized.max_rows)
    if layer_rows:
        fuse_cpu_decode_layers(model, min(layer_rows))


def apply_cpu_linear_plan(model: nn.Module, plan: CpuLinearPlan) -> None:
    """Hold the linear and LM-head weights as ``plan`` says, and let the Llama decoder layers run
    the streamed steps as fused C calls."""
    for module in model.modules():
        if isinstance(module, PlannedLinear) and module.quantized is None:
            module.plan_cpu_(plan.gemm_dtype, plan.stream_rows, plan.packed)
    if plan.stream_rows:
        fuse_cpu_decode_layers(model, plan.stream_rows)


def _packs(gemm_dtype: torch.dtype) -> bool:
    """Whether the GEMM runs on oneDNN-packed weights: bfloat16 ones, where it was measured faster
    (``kernels/onednn_linear.py``)."""
    return gemm_dtype == torch.bfloat16 and onednn_linear.available(gemm_dtype)


def _largest_streamable_weight(model: nn.Module) -> torch.Tensor | None:
    weights = [
        module.weight.data
        for module in model.modules()
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear))
        and module.quantized is None
        and cpu_linear.supports_weight(module.weight)
    ]
    return max(weights, key=torch.Tensor.numel, default=None)


def _measured_once(key: tuple, tp: TensorParallel, measure: Callable[[], Crossover]) -> Crossover:
    """``measure()``, or on a single rank what it gave the last time this machine timed ``key``
    with the same kernels, torch and threads: in this process, or in another one, from the file it
    left under ``$STRATA_CACHE_DIR/plans`` (delete the folder to time anew). Ranks of a group
    always measure: each takes part in the sum of the timings, and one cannot know whether the
    others measured before."""
    if tp.size > 1:
        return measure()
    if key not in _measured:
        _measured[key] = _stored(key, measure)
    return _measured[key]


def _stored(key: tuple, measure: Callable[[], Crossover]) -> Crossover:
    """``measure()``'s result for ``key`` as this machine's plans folder holds it, measured and
    written there first if it holds none (a later start then skips the second or two of timing)."""
    facts = repr((key, native.library_key(), torch.__version__, torch.get_num_threads()))
    path = native.cache_dir("plans") / f"crossover-{hashlib.sha256(facts.encode()).hexdigest()[:16]}.json"
    try:
        stored = json.loads(path.read_text())
        logger.info("linear crossover reused from %s", path)
        return stored["rows"], [tuple(timing) for timing in stored["timings"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    rows, timings = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Concurrent starts each write their own file; the rename makes one win whole.
        fd, staging = tempfile.mkstemp(prefix=".crossover-", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as file:
            json.dump({"measured": facts, "rows": rows, "timings": timings}, file)
        os.replace(staging, path)
    except OSError as error:
        logger.warning("could not keep the linear crossover in %s (%s): later starts time it again", path, error)
    return rows, timings


def _fastest_seconds(run: Callable[[], object]) -> float:
    """The fastest of a few timed runs: on a shared machine the others only add what other
    processes took."""
    run()  # first-call costs (oneDNN builds its kernel for the shape)
    times = []
    for _ in range(TIMED_REPEATS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)
