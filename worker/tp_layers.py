"""Tensor-parallel layers. Each rank holds one shard of every weight and reads only that shard.

Loading goes through ``load_weight(name, source)``: ``source`` is the *full* checkpoint tensor,
either a torch tensor or a lazy safetensors slice, and the layer indexes out its own rows or
columns, so with safetensors a rank never reads the other ranks' shards from disk.
With one rank every layer is a plain linear or embedding.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels import cpu_layers, cpu_linear, gguf_linear, onednn_linear
from strata.worker.gguf_weights import GgufTensor
from strata.worker.parallel_state import TensorParallel
from strata.worker.scaled_linear import ScaledWeight


class TensorSource(Protocol):
    """A checkpoint tensor read piecewise: a ``torch.Tensor`` or a safetensors ``get_slice`` handle
    (whose shape is ``get_shape()`` rather than ``shape``)."""

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor: ...


class OutputDelta(Protocol):
    """Something a linear adds to its output for ``x``: ``worker/lora.py``'s adapter pool."""

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


def read_shard(source: TensorSource, full_shape: tuple[int, ...], index: slice | tuple[slice, ...]) -> torch.Tensor:
    """``source[index]``, once the whole checkpoint tensor is known to have ``full_shape``: a
    larger tensor would otherwise be cut down to the parameter's shard without a word."""
    shape = tuple(source.get_shape() if hasattr(source, "get_shape") else source.shape)
    if shape != full_shape:
        raise ValueError(f"shape {shape} does not match the {full_shape} the model's config implies")
    return source[index]


def load_full(param: nn.Parameter, source: TensorSource) -> None:
    """Copy a whole checkpoint tensor into a parameter that every rank holds entirely."""
    copy_shard(param.data, source[:])


def copy_shard(destination: torch.Tensor, shard: torch.Tensor) -> None:
    """Copy a rank's shard of a checkpoint tensor into (part of) a parameter of the same shape."""
    if destination.shape != shard.shape:
        raise ValueError(
            f"checkpoint shard of shape {tuple(shard.shape)} does not fit a parameter of shape "
            f"{tuple(destination.shape)}"
        )
    destination.copy_(shard)


def empty_parameter(*shape: int) -> nn.Parameter:
    """An uninitialised, frozen parameter in the default dtype and device."""
    # Weights are overwritten by the loader, so skip initialisation; inference needs no grad.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


@dataclass(frozen=True)
class StreamedWeight:
    """What a layer streams through ``cpu_linear`` for steps of at most ``max_rows`` rows: its
    bfloat16 or float32 weight and its bias in float32 (the kernel adds it to its float32 sums)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    max_rows: int

    def takes(self, x: torch.Tensor) -> bool:
        return x.shape[0] <= self.max_rows and cpu_linear.supports(x, self.weight)


def streamed_weight(weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int) -> StreamedWeight | None:
    """The ``StreamedWeight`` of a layer that streams steps of up to ``max_rows`` rows, or None:
    ``max_rows`` is 0 or the kernel cannot stream ``weight``."""
    if not max_rows or not cpu_linear.supports_weight(weight):
        return None
    return StreamedWeight(weight.data, None if bias is None else bias.data.float().contiguous(), max_rows)


@dataclass
class QuantizedWeight:
    """A layer's weight kept in a GGUF file's blocks (``--quantization gguf``): steps of at most
    ``max_rows`` rows multiply the blocks as stored (``kernels.gguf_linear``); larger ones, whose
    GEMM outweighs a dequantization, dequantize the weight for the step and run the GEMM (the
    crossover is measured at start, ``worker/cpu_linear_plan.py``)."""

    matrix: gguf_linear.QuantizedMatrix
    max_rows: int = 16

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x W^T + b``, rounded to ``out_dtype`` (default ``x``'s)."""
        if x.shape[0] <= self.max_rows:
            return gguf_linear.linear(x, self.matrix, bias, out_dtype)
        y = F.linear(x, gguf_linear.dequantize(self.matrix, x.dtype), None if bias is None else bias.to(x.dtype))
        return y if out_dtype is None else y.to(out_dtype)

    def swiglu(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``silu(gate) * up`` of a merged gate/up weight's ``linear(x, bias)``: inside the block
        kernel (``gguf_linear.swiglu``) for the steps that multiply the blocks."""
        if x.shape[0] <= self.max_rows:
            return gguf_linear.swiglu(x, self.matrix, bias)
        return cpu_layers.silu_and_mul(self.linear(x, bias))


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    streamed: StreamedWeight | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x W^T + b`` in the weight's dtype, the result rounded back to ``x``'s.

    On the CPU a bfloat16 or float32 model's layers follow its ``CpuLinearPlan``
    (``worker/cpu_linear_plan.py``): a step ``streamed`` takes runs the streaming kernel; others
    run the GEMM on ``weight`` (``packed``: its oneDNN-packed copy), which may be a float32 copy:
    the matmul then runs in float32 on the bfloat16 values, as a native bfloat16 GEMM
    accumulates, and the activations stay bfloat16.
    """
    if streamed is not None and streamed.takes(x):
        return cpu_linear.small_batch_linear(x, streamed.weight, streamed.bias)
    y = _gemm(x if x.dtype == weight.dtype else _convert(x, weight.dtype), weight, bias, packed)
    return y if y.dtype == x.dtype else _convert(y, x.dtype)


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias) if packed is None else onednn_linear.linear(x, packed, bias)


def _convert(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if cpu_layers.handles(x) and x.is_contiguous():
        return cpu_layers.convert(x, dtype)
    return x.to(dtype)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with the output features of W split across ranks; ``y`` stays split.

    ``shards`` gives, for each checkpoint matrix the layer merges (one, or q/k/v, or gate/up),
    the rows of it that this rank holds, and ``matrix_rows`` the rows each matrix has in all.
    The local weight stacks those row ranges in order, so one matmul computes all of them;
    ``load_weight(..., part=i)`` fills matrix ``i``'s rows.
    """

    def __init__(
        self, input_size: int, shards: Sequence[slice], bias: bool = False, *, matrix_rows: Sequence[int]
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.shards = list(shards)
        self.matrix_rows = list(matrix_rows)
        self.output_sizes = [shard.stop - shard.start for shard in self.shards]
        self.weight = empty_parameter(sum(self.output_sizes), input_size)
        self.bias = empty_parameter(sum(self.output_sizes)) if bias else None
        self.streamed: StreamedWeight | None = None
        self.packed: torch.Tensor | None = None
        self.quantized: QuantizedWeight | None = None
        self.scaled: ScaledWeight | None = None  # 8-bit weight, per-row scales (worker/scaled_weights.py)
        self._quantized_parts: list[gguf_linear.QuantizedPart | None] = [None] * len(self.shards)
        self.lora: OutputDelta | None = None  # LoRA adapter slots, added after the base matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            y = self.quantized.linear(x, self.bias)
        elif self.scaled is not None:
            y = self.scaled.linear(x, self.bias)
        else:
            y = linear(x, self.weight, self.bias, self.streamed, self.packed)
        return y if self.lora is None else self.lora.apply(x, y)

    def plan_cpu_(self, gemm_dtype: torch.dtype, stream_rows: int, pack: bool) -> None:
        """Stream steps of up to ``stream_rows`` rows; hold the weight and bias for the GEMM in
        ``gemm_dtype``, the weight oneDNN-packed if ``pack`` (see ``linear``)."""
        self.streamed = streamed_weight(self.weight, self.bias, stream_rows)
        self.weight = nn.Parameter(self.weight.to(gemm_dtype), requires_grad=False)
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.to(gemm_dtype), requires_grad=False)
        self.packed = onednn_linear.pack(self.weight.data) if pack else None

    def load_weight(self, name: str, source: "TensorSource | GgufTensor", part: int = 0) -> None:
        """Copy this rank's rows of checkpoint matrix ``part`` (``name`` is ``weight`` or ``bias``);
        a ``GgufTensor`` weight keeps its blocks, and once every part has come, the layer multiplies
        them (its float weight is dropped)."""
        if isinstance(source, GgufTensor):
            source.check_shape((self.matrix_rows[part], self.input_size))
            self._quantized_parts[part] = gguf_linear.interleaved(source.part(self.shards[part]))
            if all(p is not None for p in self._quantized_parts):
                self.quantized = QuantizedWeight(gguf_linear.QuantizedMatrix(self._quantized_parts, self.input_size))
                self.weight = None
            return
        offset = sum(self.output_sizes[:part])
        destination = getattr(self, name).data[offset : offset + self.output_sizes[part]]
        full_shape = (self.matrix_rows[part], self.input_size) if name == "weight" else (self.matrix_rows[part],)
        copy_shard(destination, read_shard(source, full_shape, self.shards[part]))


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with the input features of W split across ranks.

    Each rank multiplies its slice of ``x`` (the split output of a column-parallel layer) and the
    partial sums are all-reduced; the bias is added once, after the reduce.
    """

    def __init__(
        self, input_size: int, output_size: int, tp: TensorParallel, bias: bool = False, columns: slice | None = None
    ) -> None:
        """``columns``: this rank's input features when they are not an equal share."""
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_size = output_size
        self.columns = columns or tp.shard(input_size)
        self.weight = empty_parameter(output_size, self.columns.stop - self.columns.start)
        self.bias = empty_parameter(output_size) if bias else None
        self.streamed: StreamedWeight | None = None
        self.packed: torch.Tensor | None = None
        self.quantized: QuantizedWeight | None = None
        self.scaled: ScaledWeight | None = None  # 8-bit weight, per-row scales (worker/scaled_weights.py)
        # LoRA adapter slots: their delta joins the partial sum, so the all-reduce sums it too.
        self.lora: OutputDelta | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            partial = self.quantized.linear(x)
        elif self.scaled is not None:
            partial = self.scaled.linear(x)
        else:
            partial = linear(x, self.weight, None, self.streamed, self.packed)
        if self.lora is not None:
            partial = self.lora.apply(x, partial)
        y = self.tp.all_reduce(partial)
        return y if self.bias is None else y + self.bias

    def plan_cpu_(self, gemm_dtype: torch.dtype, stream_rows: int, pack: bool) -> None:
        """Stream steps of up to ``stream_rows`` rows; hold the weight for the GEMM in
        ``gemm_dtype``, oneDNN-packed if ``pack`` (see ``linear``). The bias, added after the
        reduce, keeps the activations' dtype."""
        self.streamed = streamed_weight(self.weight, None, stream_rows)
        self.weight = nn.Parameter(self.weight.to(gemm_dtype), requires_grad=False)
        self.packed = onednn_linear.pack(self.weight.data) if pack else None

    def load_weight(self, name: str, source: "TensorSource | GgufTensor") -> None:
        """Copy this rank's columns of the weight (a ``GgufTensor``'s: keep their blocks), or the
        whole bias."""
        if isinstance(source, GgufTensor):
            source.check_shape((self.weight.shape[0], self.input_size))
            part = gguf_linear.interleaved(gguf_linear.QuantizedPart(source.columns(self.columns), source.type))
            self.quantized = QuantizedWeight(gguf_linear.QuantizedMatrix([part], self.columns.stop - self.columns.start))
            self.weight = None
        elif name == "weight":
            full_shape = (self.weight.shape[0], self.input_size)
            copy_shard(self.weight.data, read_shard(source, full_shape, (slice(None), self.columns)))
        else:
            load_full(self.bias, source)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary: rank ``r`` holds ids ``[r * n, (r + 1) * n)``.

    ``n`` is ``ceil(vocab_size / size)``; the last rank's shard is padded with zero rows so every
    rank's shard has the same shape (the LM head all-gathers them). A rank embeds only the ids
    in its range, zeros for the rest, and the all-reduce fills in every token.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        rows_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = min(tp.rank * rows_per_rank, vocab_size)
        self.vocab_end = min(self.vocab_start + rows_per_rank, vocab_size)
        self.rows_per_rank, self.hidden_size, self.dtype = rows_per_rank, hidden_size, torch.get_default_dtype()
        # Not zeros: a layer on GGUF blocks never touches (so never holds) these pages.
        self.weight = nn.Parameter(torch.empty(rows_per_rank, hidden_size), requires_grad=False)
        self.quantized: QuantizedWeight | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._embed(input_ids)
        local_ids = input_ids - self.vocab_start
        elsewhere = (local_ids < 0) | (local_ids >= self.vocab_end - self.vocab_start)
        embedded = self._embed(local_ids.masked_fill(elsewhere, 0))
        embedded.masked_fill_(elsewhere.unsqueeze(-1), 0)
        return self.tp.all_reduce(embedded)

    def _embed(self, local_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is None:
            return F.embedding(local_ids, self.weight)
        [part] = self.quantized.matrix.parts
        return gguf_linear.lookup(part, self.hidden_size, local_ids, self.dtype)

    def load_weight(self, name: str, source: "TensorSource | GgufTensor") -> None:
        """Copy this rank's vocabulary rows (a ``GgufTensor``'s: keep their blocks, and look up
        rows by dequantizing just them); the padding rows stay zero (zero blocks are zeros)."""
        rows = self.vocab_end - self.vocab_start
        full_shape = (self.vocab_size, self.hidden_size)
        if isinstance(source, GgufTensor):
            source.check_shape(full_shape)
            blocks = source.rows(slice(self.vocab_start, self.vocab_end))
            padded = torch.zeros(self.rows_per_rank, blocks.shape[1], dtype=torch.uint8)
            padded[:rows] = blocks
            part = gguf_linear.interleaved(gguf_linear.QuantizedPart(padded, source.type))
            self.quantized = QuantizedWeight(gguf_linear.QuantizedMatrix([part], self.hidden_size))
            self.weight = None
            return
        copy_shard(self.weight.data[:rows], read_shard(source, full_shape, slice(self.vocab_start, self.vocab_end)))
        self.weight.data[rows:].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, sharded like the embedding so a tied model shares one weight.

    Each rank computes the logits of its vocabulary range; the all-gather assembles the full
    vocabulary on every rank and the padding columns are dropped. The logits come out in the
    weight's dtype: a head widened to float32 keeps them float32 (no rounding to create ties).
    """

    streamed: StreamedWeight | None = None
    packed: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            logits = self.quantized.linear(hidden, out_dtype=torch.float32)
        elif self.streamed is not None and self.streamed.takes(hidden):
            logits = cpu_linear.small_batch_linear(hidden, self.streamed.weight, out_dtype=self.weight.dtype)
        else:
            logits = _gemm(hidden.to(self.weight.dtype), self.weight, None, self.packed)
        logits = self.tp.all_gather_last_dim(logits)
        return logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size]

    def plan_cpu_(self, gemm_dtype: torch.dtype, stream_rows: int, pack: bool) -> None:
        """Stream steps of up to ``stream_rows`` rows; hold the weight for the GEMM in
        ``gemm_dtype`` (oneDNN-packed if ``pack``): a head tied to the embedding and widened gets
        its own copy, so the embedding keeps the activations' dtype (and the bfloat16 weight the
        head streams, see ``linear``, is the embedding's own)."""
        self.streamed = streamed_weight(self.weight, None, stream_rows)
        if gemm_dtype != self.weight.dtype:
            self.weight = nn.Parameter(self.weight.to(gemm_dtype), requires_grad=False)
        self.packed = onednn_linear.pack(self.weight.data) if pack else None
