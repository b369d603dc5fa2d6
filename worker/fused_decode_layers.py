"""A Llama decoder layer's decode steps on the CPU as two fused C calls
(``kernels.cpu_decoder_layer``): norm, qkv, rotary, KV write, attention and o_proj in one; norm,
gate_up, SwiGLU and down in the other; the tensor-parallel all-reduce after each.

``fuse_cpu_decode_layers`` gives each layer whose modules those calls reproduce exactly its
``FusedDecoderLayer``. The layer runs it in the steps the model has a ``cpu_decoder_layer.Step``
for (``LlamaModel.fused_step``: at most the plan's ``stream_rows`` on streamed bfloat16 or
float32 weights, its block types' rows on GGUF blocks, see ``worker/cpu_linear_plan.py``) and its
modules in the others. A rank alone in its
tensor-parallel group, all of whose layers are fused, runs them all in one call instead
(``FusedDecoderStack``): no all-reduce separates the halves, so no Python needs to run between
them either, and for a few rows on GGUF blocks the C call runs them all in one parallel region.
"""

import ctypes
import logging
from dataclasses import dataclass

import torch
from torch import nn

from strata.kernels import cpu_decoder_layer, cpu_linear, native
from strata.worker.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel
from strata.worker.parallel_state import TensorParallel
from strata.worker.tp_layers import ColumnParallelLinear, RowParallelLinear

logger = logging.getLogger(__name__)


@dataclass
class FusedDecoderLayer:
    """A layer's weights as the fused C halves read them, and the group that sums each half."""

    attention: cpu_decoder_layer.AttentionLayer
    mlp: cpu_decoder_layer.MlpLayer
    tp: TensorParallel
    max_rows: int
    biases: tuple[torch.Tensor | None, ...]  # the float32 biases the structs point at, kept alive

    def forward(
        self, step: cpu_decoder_layer.Step, kv_cache: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's output and residual (as ``LlamaDecoderLayer.forward``) from the C halves
        with the all-reduces between them; None (nothing changed) where the attention kernel
        does not take the cache's block size."""
        cache = cpu_decoder_layer.kv_cache(kv_cache)
        attended = cpu_decoder_layer.attention_block(self.attention, step, cache, hidden, residual)
        if attended is None:
            return None
        residual = hidden if residual is None else residual
        hidden = self.tp.all_reduce(attended)
        out = cpu_decoder_layer.mlp_block(self.mlp, step, hidden, residual)
        return self.tp.all_reduce(out), residual


@dataclass
class FusedDecoderStack:
    """A stage's fused layers, all run by one C call (``cpu_decoder_layer.decoder_stack``) on a
    rank alone in its tensor-parallel group."""

    layers: list[FusedDecoderLayer]  # what the stack's structs point into, kept alive
    stack: cpu_decoder_layer.Stack
    _caches: tuple[list[torch.Tensor], ctypes.Array] | None = None

    @classmethod
    def of(cls, layers: list[FusedDecoderLayer]) -> "FusedDecoderStack":
        return cls(layers, cpu_decoder_layer.Stack.of([l.attention for l in layers], [l.mlp for l in layers]))

    def forward(
        self, step: cpu_decoder_layer.Step, kv_caches: list[torch.Tensor], hidden: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The last layer's output and residual, as the layers one by one give them; None
        (nothing changed) where the attention kernel does not take the cache's block size."""
        if self._caches is None or self._caches[0] is not kv_caches:  # the runner's one list of caches
            self._caches = (kv_caches, cpu_decoder_layer.kv_caches(kv_caches))
        return cpu_decoder_layer.decoder_stack(self.stack, step, self._caches[1], hidden, residual)


def fuse_cpu_decode_layers(model: nn.Module, max_rows: int) -> None:
    """Let the decoder layers that can run steps of up to ``max_rows`` rows as fused C calls do
    so, and a decoder whose every layer can, on a rank alone in its group, run them as one call;
    log how many did."""
    for decoder in model.modules():
        if not isinstance(decoder, LlamaModel):
            continue
        layers = [layer for layer in decoder.layers if isinstance(layer, LlamaDecoderLayer)]
        for layer in layers:
            layer.fused = fused_decoder_layer(layer, max_rows)
        fused = [layer.fused for layer in layers if layer.fused is not None]
        one_call = fused and len(fused) == len(layers) and fused[0].tp.size == 1
        decoder.fused_stack = FusedDecoderStack.of(fused) if one_call else None
        if fused:
            logger.info(
                "%d of %d decoder layers run steps of <= %d rows as fused C calls%s", len(fused), len(layers),
                max_rows, " (all in one)" if decoder.fused_stack is not None else "",
            )


def fused_decoder_layer(layer: LlamaDecoderLayer, max_rows: int) -> FusedDecoderLayer | None:
    """The layer's fused halves where they compute exactly what its modules do, else None: a
    Llama attention and MLP (not a family's variant) on the ``cpu`` attention backend, whose four
    linears stream bfloat16 or float32 weights (``tp_layers.StreamedWeight``) or multiply GGUF blocks
    (``tp_layers.QuantizedWeight``), and whose row-parallel linears have no bias."""
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP or attn.attn_backend.name != "cpu":
        return None
    if attn.o_proj.bias is not None or mlp.down_proj.bias is not None:
        return None
    weights = [_layer_weight(linear) for linear in (attn.qkv_proj, mlp.gate_up_proj, attn.o_proj, mlp.down_proj)]
    if any(weight is None for weight in weights):
        return None
    input_norm, post_attention_norm = layer.input_layernorm, layer.post_attention_layernorm
    if not (input_norm.weight.is_contiguous() and post_attention_norm.weight.is_contiguous()):
        return None
    qkv, gate_up, o_proj, down = weights
    qkv_bias, gate_up_bias = _float32_bias(attn.qkv_proj), _float32_bias(mlp.gate_up_proj)
    return FusedDecoderLayer(
        attention=cpu_decoder_layer.AttentionLayer(
            input_norm=input_norm.weight.data_ptr(),
            qkv=qkv,
            qkv_bias=qkv_bias.data_ptr() if qkv_bias is not None else None,
            o_proj=o_proj,
            hidden=input_norm.weight.numel(),
            heads=attn.num_heads,
            kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            sliding_window=attn.sliding_window or 0,
            eps=input_norm.eps,
            scale=attn.scale,
        ),
        mlp=cpu_decoder_layer.MlpLayer(
            post_attention_norm=post_attention_norm.weight.data_ptr(),
            gate_up=gate_up,
            gate_up_bias=gate_up_bias.data_ptr() if gate_up_bias is not None else None,
            down=down,
            hidden=post_attention_norm.weight.numel(),
            intermediate=mlp.down_proj.columns.stop - mlp.down_proj.columns.start,
            eps=post_attention_norm.eps,
        ),
        tp=attn.o_proj.tp,  # the MLP's down_proj sums over the same group
        # The streaming kernel takes at most cpu_linear.MAX_ROWS rows; the block kernel any number.
        max_rows=max_rows if all(weight.quantized for weight in weights) else min(max_rows, cpu_linear.MAX_ROWS),
        biases=(qkv_bias, gate_up_bias),
    )


def _layer_weight(linear: ColumnParallelLinear | RowParallelLinear) -> cpu_decoder_layer.LayerWeight | None:
    """The C view of a linear's weight: its GGUF blocks, or the weight it streams; None when it
    does neither."""
    if linear.quantized is not None:
        return cpu_decoder_layer.LayerWeight(quantized=ctypes.pointer(linear.quantized.matrix.struct))
    if linear.streamed is not None:
        weight = linear.streamed.weight
        return cpu_decoder_layer.LayerWeight(
            streamed=weight.data_ptr(), streamed_dtype=native.DTYPE_CODES[weight.dtype]
        )
    return None


def _float32_bias(linear: ColumnParallelLinear) -> torch.Tensor | None:
    """The bias the fused half adds to its float32 sums (the streamed one is already float32)."""
    if linear.streamed is not None:
        return linear.streamed.bias
    return None if linear.bias is None else linear.bias.data.float().contiguous()
