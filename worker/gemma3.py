"""Gemma 3 text models (``gemma3_text``): one tensor-parallel decoder over a paged KV cache.

What sets it apart from the Llama family (``worker.llama``), each as HF transformers computes it:
embeddings scaled by sqrt(hidden_size) rounded to the model dtype; RMSNorm weights stored as an
offset from one, the scaling done in float32; RMSNorm of each query and key head before rotary;
norms after attention and after the MLP as well as before them; a GeGLU MLP (tanh-approximated
GELU); local layers with a sliding window and their own rotary base (``layer_types``) between
global ones; scores scaled by ``query_pre_attn_scalar ** -0.5``; optional final logit
softcapping; a head tied to the embedding.
"""

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from strata.worker.attention import AttentionBackend, AttentionMetadata
from strata.worker.layers import RotaryEmbedding, apply_rotary
from strata.worker.llama import LlamaAttention, LlamaForCausalLM
from strata.worker.model_config import ModelConfig
from strata.worker.parallel_state import TensorParallel
from strata.worker.pipeline_parallel import WHOLE_MODEL, PipelineStage
from strata.worker.tp_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")

# Gemma's turn format, for GGUF files that carry no template: BOS, then each message as
# "<start_of_turn>{user|model}\n{text}<end_of_turn>\n"; a system message opens the first user turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] | trim + '\n\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n'"
    " + ns.system + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% set ns.system = '' %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
END_OF_TURN = "<end_of_turn>"  # ends a model turn: a chat answer stops on it
_LAYER_TYPES = ("sliding_attention", "full_attention")


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)`` in float32, rounded to ``x``'s dtype once at the end."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(LlamaAttention):
    """Llama attention with per-head q/k norms before rotary and scores scaled by
    ``query_pre_attn_scalar ** -0.5``, over the last ``sliding_window`` positions in a local layer."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallel,
        attn_backend: AttentionBackend,
        sliding_window: int | None,
    ) -> None:
        super().__init__(config, tp, attn_backend, sliding_window)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = config.query_pre_attn_scalar**-0.5

    def rotated_heads(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, value = self.split_heads(qkv)
        return apply_rotary(self.q_norm(query), cos, sin), apply_rotary(self.k_norm(key), cos, sin), value


class Gemma3MLP(nn.Module):
    """GeGLU feed-forward (tanh-approximated GELU), its intermediate features split across ranks."""

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        rows = tp.shard(config.intermediate_size)
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, [rows, rows], matrix_rows=[config.intermediate_size] * 2
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    """Attention and MLP, each between a norm of its input and a norm of its output."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallel,
        attn_backend: AttentionBackend,
        sliding_window: int | None,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = Gemma3Attention(config, tp, attn_backend, sliding_window)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = Gemma3MLP(config, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma3Model(nn.Module):
    """Scaled embedding, decoder layers and final norm (the checkpoint's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, layers: Iterable[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        # HF multiplies by sqrt(hidden_size) rounded to the model dtype (25.25, not 25.3, in bf16).
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        self.layer_types = list(config.layer_types)
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # Local and global layers rotate with their own base (and scaling): one table per type.
        self.rotary_emb = nn.ModuleDict(
            {kind: RotaryEmbedding(config.rope_parameters[kind], config.head_dim) for kind in set(self.layer_types)}
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        stage_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert stage_input is None, "Gemma 3 runs as one pipeline stage"
        embedded = self.embed_tokens(input_ids)
        hidden = embedded * self.embed_scale.to(embedded.dtype)
        rotations = {kind: rotary(positions) for kind, rotary in self.rotary_emb.items()}
        for layer, kind, kv_cache in zip(self.layers, self.layer_types, kv_caches, strict=True):
            hidden = layer(hidden, *rotations[kind], kv_cache, meta)
        return self.norm(hidden)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """A Gemma 3 text model on one tensor-parallel rank: the Llama family's loading, checkpoint
    names and KV-cache attributes around Gemma's own layers and decoder."""

    supports_pipeline_parallel = False  # its decoder scales embeddings and rotates per layer type: one stage only

    def __init__(
        self, config: ModelConfig, tp: TensorParallel, attn_backend: AttentionBackend, stage: PipelineStage = WHOLE_MODEL
    ) -> None:
        _check_supported(config)
        super().__init__(config, tp, attn_backend, stage)
        self.final_logit_softcapping = config.final_logit_softcapping

    def decoder_layer(
        self,
        config: ModelConfig,
        tp: TensorParallel,
        attn_backend: AttentionBackend,
        index: int,
        sliding_window: int | None,
    ) -> Gemma3DecoderLayer:
        return Gemma3DecoderLayer(config, tp, attn_backend, sliding_window)

    def decoder(
        self, config: ModelConfig, tp: TensorParallel, layers: Iterable[nn.Module], stage: PipelineStage
    ) -> Gemma3Model:
        return Gemma3Model(config, tp, layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the full vocabulary, on every rank, softcapped if the config says so."""
        logits = super().compute_logits(hidden)
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits


def _check_supported(config: ModelConfig) -> None:
    """Refuse, naming the setting, what this implementation does not compute."""
    if config.hidden_act not in _GELU_TANH:
        raise ValueError(f"activation {config.hidden_act!r} is not supported (only gelu_pytorch_tanh)")
    if config.attn_logit_softcapping:
        raise ValueError("attn_logit_softcapping is not supported (no released Gemma 3 model uses it)")
    if config.use_bidirectional_attention:
        raise ValueError("use_bidirectional_attention is not supported: strata serves causal language models")
    unknown = set(config.layer_types) - set(_LAYER_TYPES)
    if unknown:
        raise ValueError(f"layer types {sorted(unknown)} are not supported (only {', '.join(_LAYER_TYPES)})")
