"""Qwen3 and Qwen3-MoE: the Llama decoder with an RMSNorm over each query and key head before
rotary embedding; Qwen3-MoE swaps the MLP for a mixture of experts on its sparse layers."""

import torch

from strata.kernels import cpu_layers
from strata.worker.attention import AttentionBackend
from strata.worker.layers import RMSNorm, apply_rotary
from strata.worker.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from strata.worker.model_config import ModelConfig
from strata.worker.moe import SparseMoE
from strata.worker.parallel_state import TensorParallel


class Qwen3Attention(LlamaAttention):
    """Grouped-query attention whose query and key heads are RMS-normalised (``q_norm``,
    ``k_norm``, one weight per head dimension shared by all heads) before they are rotated."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallel,
        attn_backend: AttentionBackend,
        sliding_window: int | None,
    ) -> None:
        super().__init__(config, tp, attn_backend, sliding_window)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def rotated_heads(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, value = self.split_heads(qkv)
        # The heads are strided views into qkv; the fused norm reads contiguous rows.
        query = self.q_norm(query.contiguous())[0]
        key = self.k_norm(key.contiguous())[0]
        return _rotate(query, cos, sin), _rotate(key, cos, sin), value


def _rotate(heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of contiguous ``heads`` ``[T, heads, head_dim]`` (in place on the CPU)."""
    if cpu_layers.handles(heads):
        num_tokens, num_heads, head_dim = heads.shape
        cpu_layers.rotary_embedding_(heads.view(num_tokens, num_heads * head_dim), num_heads, head_dim, cos, sin)
        return heads
    return apply_rotary(heads, cos, sin)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense). Attention biases follow ``attention_bias`` (off in released models)."""

    def decoder_layer(
        self,
        config: ModelConfig,
        tp: TensorParallel,
        attn_backend: AttentionBackend,
        index: int,
        sliding_window: int | None,
    ) -> LlamaDecoderLayer:
        attention = Qwen3Attention(config, tp, attn_backend, sliding_window)
        return LlamaDecoderLayer(config, attention, self.feed_forward(config, tp, index))

    def feed_forward(self, config: ModelConfig, tp: TensorParallel, index: int) -> torch.nn.Module:
        return LlamaMLP(config, tp)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE: layer ``i`` is sparse unless listed in ``mlp_only_layers``, when ``(i + 1)`` is a
    multiple of ``decoder_sparse_step``; dense layers keep an ``intermediate_size`` MLP. The
    router renormalises its top-k weights when ``norm_topk_prob``."""

    supports_lora = False  # adapters of experts are not supported

    def feed_forward(self, config: ModelConfig, tp: TensorParallel, index: int) -> torch.nn.Module:
        sparse = (
            index not in config.mlp_only_layers
            and config.num_experts > 0
            and (index + 1) % config.decoder_sparse_step == 0
        )
        if not sparse:
            return LlamaMLP(config, tp)
        if config.hidden_act != "silu":
            raise ValueError(f"activation {config.hidden_act!r} is not supported (only silu)")
        return SparseMoE(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            renormalize=config.norm_topk_prob,
            names=("gate_proj", "up_proj", "down_proj"),
            tp=tp,
        )
