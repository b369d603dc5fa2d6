"""A Llama decoder layer's decode steps on the CPU as two fused C calls
(``kernels.cpu_decoder_layer``): norm, qkv, rotary, KV write, attention and o_proj in one; norm,
gate_up, SwiGLU and down in the other; the tensor-parallel all-reduce after each.

``fuse_cpu_decode_layers`` gives each layer whose modules those calls reproduce exactly its
``FusedDecoderLayer``. The layer runs it in the steps the model has a ``cpu_decoder_layer.Step``
for (``LlamaModel.fused_step``: few enough rows) and its modules in the others.
"""

import logging
from dataclasses import dataclass

import torch
from torch import nn

from strata.kernels import cpu_decoder_layer, cpu_linear
from strata.worker.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from strata.worker.parallel_state import TensorParallel

logger = logging.getLogger(__name__)


@dataclass
class FusedDecoderLayer:
    """A layer's weights as the fused C halves read them, and the group that sums each half."""

    attention: cpu_decoder_layer.AttentionLayer
    mlp: cpu_decoder_layer.MlpLayer
    tp: TensorParallel

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


def fuse_cpu_decode_layers(model: nn.Module) -> None:
    """Let the decoder layers that can run decode steps as fused C calls do so; log how many did."""
    layers = [module for module in model.modules() if isinstance(module, LlamaDecoderLayer)]
    for layer in layers:
        layer.fused = fused_decoder_layer(layer)
    fused = sum(layer.fused is not None for layer in layers)
    if fused:
        logger.info("%d of %d decoder layers run decode steps of <= %d rows as fused C calls", fused, len(layers), cpu_linear.MAX_ROWS)


def fused_decoder_layer(layer: LlamaDecoderLayer) -> FusedDecoderLayer | None:
    """The layer's fused halves where they compute exactly what its modules do, else None: a
    Llama attention and MLP (not a family's variant) on the ``cpu`` attention backend, whose four
    linears stream bfloat16 weights (``tp_layers.linear``) and whose row-parallel linears have no
    bias."""
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP or attn.attn_backend.name != "cpu":
        return None
    column_parallel, row_parallel = (attn.qkv_proj, mlp.gate_up_proj), (attn.o_proj, mlp.down_proj)
    if any(linear.bias is not None for linear in row_parallel) or any(
        linear.bias is not None and (linear.bias.dtype != torch.float32 or not linear.bias.is_contiguous())
        for linear in column_parallel
    ):
        return None
    weights = [linear.bf16_weight for linear in (*column_parallel, *row_parallel)]
    if not all(weight is not None and cpu_linear.supports_weight(weight) for weight in weights):
        return None
    input_norm, post_attention_norm = layer.input_layernorm, layer.post_attention_layernorm
    if not (input_norm.weight.is_contiguous() and post_attention_norm.weight.is_contiguous()):
        return None
    qkv, gate_up, o_proj, down = weights
    return FusedDecoderLayer(
        attention=cpu_decoder_layer.AttentionLayer(
            input_norm=input_norm.weight.data_ptr(),
            qkv=qkv.data_ptr(),
            qkv_bias=attn.qkv_proj.bias.data_ptr() if attn.qkv_proj.bias is not None else None,
            o_proj=o_proj.data_ptr(),
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
            gate_up=gate_up.data_ptr(),
            gate_up_bias=mlp.gate_up_proj.bias.data_ptr() if mlp.gate_up_proj.bias is not None else None,
            down=down.data_ptr(),
            hidden=post_attention_norm.weight.numel(),
            intermediate=down.shape[1],
            eps=post_attention_norm.eps,
        ),
        tp=attn.o_proj.tp,  # the MLP's down_proj sums over the same group
    )
