"""The Llama family (Llama, Mistral, Qwen2, SmolLM): one tensor-parallel decoder over a paged KV cache.

Its attention, MLP, decoder layer and weight loading are the parts the other families
(``worker/qwen3.py``, ``worker/mixtral.py``, ``worker/gemma3.py``) build on; the layers they are
made of (RMSNorm, rotary embedding, SwiGLU, the split of heads across ranks) are in ``worker/layers.py``.

The model runs a flat, ragged batch: ``T`` tokens from any mix of prefills and decodes, each
with its position; where each token's keys and values live is the attention metadata's job.
On the CPU the elementwise steps (RMSNorm + residual, rotary, SwiGLU) run fused C kernels
(``kernels.cpu_layers``) where they built, and a decode step may run each layer as two fused C
calls (``worker/fused_decode_layers.py``). Module and parameter names follow the HF
checkpoints, except that q/k/v and gate/up are merged into one matmul each (``qkv_proj``,
``gate_up_proj``).
"""

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from strata.kernels import cpu_decoder_layer, cpu_layers
from strata.worker.attention import AttentionBackend, AttentionMetadata, CpuAttentionBackend
from strata.worker.layers import RMSNorm, RotaryEmbedding, apply_rotary, partition_heads, silu_and_mul
from strata.worker.model_config import ModelConfig
from strata.worker.parallel_state import TensorParallel
from strata.worker.pipeline_parallel import WHOLE_MODEL, PipelineStage
from strata.worker.tp_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TensorSource,
    VocabParallelEmbedding,
    load_full,
)

if TYPE_CHECKING:  # only for the annotations: both modules import this one
    from strata.worker.fused_decode_layers import FusedDecoderLayer, FusedDecoderStack
    from strata.worker.lora import LoRAStep

# The checkpoint matrices a merged layer holds, in part order.
_MERGED_LAYERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def sliding_windows(config: ModelConfig) -> list[int | None]:
    """Each layer's sliding window (None: full attention), read as HF does: the config's
    ``layer_types`` where it has them (Qwen2, Qwen3, Gemma 3), else ``sliding_window`` on every
    layer (Mistral, Mixtral, Qwen3-MoE)."""
    window = config.sliding_window or None
    if config.layer_types is not None:
        return [window if layer_type == "sliding_attention" else None for layer_type in config.layer_types]
    return [window] * config.num_hidden_layers


class LlamaAttention(nn.Module):
    """Grouped-query attention over this rank's query heads and the KV heads they read, within
    ``sliding_window`` positions if given."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallel,
        attn_backend: AttentionBackend,
        sliding_window: int | None,
    ) -> None:
        super().__init__()
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        q_heads, kv_heads = partition_heads(num_heads, num_kv_heads, tp)
        self.num_heads = q_heads.stop - q_heads.start
        self.num_kv_heads = kv_heads.stop - kv_heads.start
        q_rows = slice(q_heads.start * self.head_dim, q_heads.stop * self.head_dim)
        kv_rows = slice(kv_heads.start * self.head_dim, kv_heads.stop * self.head_dim)
        # Qwen2 always has q/k/v biases and never an o_proj bias; Llama's flag covers all four.
        is_qwen2 = config.model_type == "qwen2"
        attention_bias = config.attention_bias
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            [q_rows, kv_rows, kv_rows],
            bias=is_qwen2 or attention_bias,
            matrix_rows=[num_heads * self.head_dim, num_kv_heads * self.head_dim, num_kv_heads * self.head_dim],
        )
        self.o_proj = RowParallelLinear(
            num_heads * self.head_dim, config.hidden_size, tp, bias=attention_bias and not is_qwen2, columns=q_rows
        )
        self.attn_backend = attn_backend
        self.scale = self.head_dim**-0.5
        self.sliding_window = sliding_window

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        query, key, value = self.rotated_heads(self.qkv_proj(hidden), cos, sin)
        out = self.attn_backend.forward(query, key, value, kv_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of ``qkv`` as query ``[T, heads, head_dim]``, key and value ``[T, kv_heads, head_dim]``."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return (
            query.view(-1, self.num_heads, self.head_dim),
            key.view(-1, self.num_kv_heads, self.head_dim),
            value.view(-1, self.num_kv_heads, self.head_dim),
        )

    def rotated_heads(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query, key and value heads of the projected ``qkv``, with query and key rotated."""
        if cpu_layers.handles(qkv):  # q and k heads sit side by side at the start of each row
            cpu_layers.rotary_embedding_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, cos, sin)
            return self.split_heads(qkv)
        query, key, value = self.split_heads(qkv)
        return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin), value


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward, its intermediate features split across ranks."""

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"activation {config.hidden_act!r} is not supported (only silu)")
        bias = config.mlp_bias
        rows = tp.shard(config.intermediate_size)
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, [rows, rows], bias=bias, matrix_rows=[config.intermediate_size] * 2
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, tp, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up_proj = self.gate_up_proj
        if gate_up_proj.quantized is not None and gate_up_proj.lora is None:  # LoRA adds to gate_up's output
            return self.down_proj(gate_up_proj.quantized.swiglu(x, gate_up_proj.bias))
        gate_up = gate_up_proj(x)
        fused = cpu_layers.handles(gate_up)
        return self.down_proj(cpu_layers.silu_and_mul(gate_up) if fused else silu_and_mul(gate_up))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm feed-forward, each norm fused with the preceding residual add.

    ``self_attn`` and ``mlp`` are the family's own (a Qwen3 attention, a mixture of experts).
    """

    def __init__(self, config: ModelConfig, self_attn: LlamaAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp
        self.fused: "FusedDecoderLayer | None" = None  # set by fused_decode_layers.fuse_cpu_decode_layers

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        fused_step: cpu_decoder_layer.Step | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the layer's output and the residual stream it has not been added to yet. With a
        ``fused_step`` (``LlamaModel.fused_step``) a fused layer runs its C halves instead."""
        if fused_step is not None and self.fused is not None:
            fused = self.fused.forward(fused_step, kv_cache, hidden, residual)
            if fused is not None:
                return fused
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class OtherStageLayer(nn.Module):
    """Holds the place of a decoder layer another pipeline stage runs, so that layer indices,
    and the checkpoint names built from them, stay the model's own."""


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (the checkpoint's ``model.`` prefix), or the part
    of them one pipeline stage holds: the embedding on the first stage (and on the last when the
    head is tied to it), the norm on the last."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallel,
        layers: Iterable[nn.Module],
        stage: PipelineStage = WHOLE_MODEL,
    ) -> None:
        super().__init__()
        self.stage = stage
        self.stage_layers = stage.layers(config.num_hidden_layers)
        if stage.is_first or (stage.is_last and config.tie_word_embeddings):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(layers)
        if stage.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rope_parameters, self.layers[self.stage_layers.start].self_attn.head_dim)
        self.lora_step: "LoRAStep | None" = None  # set by lora.attach_lora_pools
        self.fused_stack: "FusedDecoderStack | None" = None  # set by fused_decode_layers.fuse_cpu_decode_layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        stage_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states, or on a stage before the last the ``[2, T, hidden]`` output and
        residual of its last layer for the next stage, which passes them as ``stage_input``."""
        if stage_input is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = stage_input[0], stage_input[1]
        cos, sin = self.rotary_emb(positions)
        fused_step = self.fused_step(hidden, cos, sin, meta)
        stacked = None
        if fused_step is not None and self.fused_stack is not None:
            stacked = self.fused_stack.forward(fused_step, kv_caches, hidden, residual)
        if stacked is not None:
            hidden, residual = stacked
        else:
            stage_layers = self.layers[self.stage_layers.start : self.stage_layers.stop]
            for layer, kv_cache in zip(stage_layers, kv_caches, strict=True):
                hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta, fused_step)
        if not self.stage.is_last:
            return torch.stack((hidden, residual))
        return self.norm(hidden, residual)[0]

    def fused_step(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> cpu_decoder_layer.Step | None:
        """The step's arguments for the layers' fused C halves, or None: no layer is fused, the
        step has more rows than they take, a chunk long enough for the module path's chunk
        attention (the fused halves attend with the paged kernel only), or rows with LoRA
        adapters (the C halves cannot add their deltas)."""
        fused = self.layers[self.stage_layers.start].fused
        if fused is None or hidden.shape[0] > fused.max_rows:
            return None
        if meta.max_query_len is not None and meta.max_query_len >= CpuAttentionBackend.LONG_CHUNK_TOKENS:
            return None
        if self.lora_step is not None and self.lora_step.active:
            return None
        return cpu_decoder_layer.decode_step(
            hidden, cos, sin, meta.slot_mapping, meta.block_tables, meta.query_start_loc, meta.seq_lens
        )


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM on one tensor-parallel rank.

    Attributes the model runner sizes the KV cache with: ``num_layers``,
    ``num_kv_heads_per_rank``, ``head_dim`` (each layer's cache is
    ``[2, num_blocks, block_size, num_kv_heads_per_rank, head_dim]``) and ``vocab_size``.
    Other families subclass it and override ``decoder_layer`` (``decoder`` too where the layers
    are joined differently, and ``checkpoint_name`` where their checkpoints name modules
    differently). With a pipeline ``stage`` it holds that stage's layers only (``num_layers``
    counts them); ``supports_pipeline_parallel`` says whether a family's decoder can be split,
    ``supports_lora`` whether its layers can hold LoRA adapters.
    """

    supports_pipeline_parallel = True
    supports_lora = True  # every decoder layer has the four adaptable linears (worker/lora.py)

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallel,
        attn_backend: AttentionBackend,
        stage: PipelineStage = WHOLE_MODEL,
    ) -> None:
        super().__init__()
        if stage.size > 1 and not self.supports_pipeline_parallel:
            raise ValueError(f"{type(self).__name__} does not support pipeline parallelism")
        self.stage = stage
        stage_layers = stage.layers(config.num_hidden_layers)
        layers = (
            self.decoder_layer(config, tp, attn_backend, index, window) if index in stage_layers else OtherStageLayer()
            for index, window in enumerate(sliding_windows(config))
        )
        self.model = self.decoder(config, tp, layers, stage)
        self.tie_word_embeddings = config.tie_word_embeddings
        if stage.is_last:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
            if self.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight
        # Checkpoint tensors of the modules other stages hold: skipped, never read.
        self._other_stage_prefixes = tuple(
            prefix
            for prefix, here in (
                ("model.embed_tokens.", hasattr(self.model, "embed_tokens")),
                ("model.norm.", stage.is_last),
                ("lm_head.", stage.is_last),
            )
            if not here
        )
        self._stage_layers = stage_layers
        self.hidden_size = config.hidden_size
        attention = self.model.layers[stage_layers.start].self_attn
        self.num_layers = len(stage_layers)
        self.num_kv_heads_per_rank = attention.num_kv_heads
        self.head_dim = attention.head_dim
        self.vocab_size = config.vocab_size

    def decoder_layer(
        self,
        config: ModelConfig,
        tp: TensorParallel,
        attn_backend: AttentionBackend,
        index: int,
        sliding_window: int | None,
    ) -> nn.Module:
        """Layer ``index`` of the decoder, attending within ``sliding_window`` positions if given."""
        return LlamaDecoderLayer(config, LlamaAttention(config, tp, attn_backend, sliding_window), LlamaMLP(config, tp))

    def decoder(
        self, config: ModelConfig, tp: TensorParallel, layers: Iterable[nn.Module], stage: PipelineStage
    ) -> nn.Module:
        """The decoder around ``layers``: embedding, the layers and the final norm, as far as
        ``stage`` holds them."""
        return LlamaModel(config, tp, layers, stage)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        stage_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of a flat batch of ``T`` tokens; with pipeline
        stages, see ``LlamaModel.forward``."""
        return self.model(input_ids, positions, kv_caches, meta, stage_input)

    def stage_input_buffer(self, num_tokens: int) -> torch.Tensor | None:
        """Room for a step's ``stage_input`` from the previous stage; None on the first stage."""
        if self.stage.is_first:
            return None
        weight = next(self.parameters())
        return torch.empty(2, num_tokens, self.hidden_size, dtype=weight.dtype, device=weight.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the full vocabulary, on every rank."""
        logits = self.lm_head(hidden)
        return logits if logits.dtype == torch.float32 else logits.float()

    def load_weights(self, weights: Iterable[tuple[str, TensorSource]]) -> None:
        """Fill every parameter from ``(checkpoint name, full tensor)`` pairs, each rank taking its shard.

        Raises, naming the checkpoint tensor, if one matches nothing, does not fit its parameter,
        or is missing.
        """
        targets = self._checkpoint_targets()
        modules = dict(self.named_modules())
        parameters = dict(self.named_parameters())
        missing = dict(targets)
        for name, source in weights:
            # Rotary frequencies come from the config; a tied head is the embedding tensor.
            if name.endswith("rotary_emb.inv_freq") or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if self._held_by_other_stage(name):
                continue
            if name not in targets:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model")
            key, part = targets[name]
            module_name, _, param_name = key.rpartition(".")
            module = modules[module_name]
            try:
                if part is not None:
                    module.load_weight(param_name, source, part)
                elif hasattr(module, "load_weight"):
                    module.load_weight(param_name, source)
                else:
                    load_full(parameters[key], source)
            except ValueError as error:
                raise ValueError(f"checkpoint tensor {name!r}: {error}") from error
            missing.pop(name, None)
        if missing:
            raise ValueError(f"checkpoint lacks tensors: {', '.join(sorted(missing))}")
        if self.stage.is_last and self.tie_word_embeddings and self.model.embed_tokens.quantized is not None:
            self.lm_head.quantized, self.lm_head.weight = self.model.embed_tokens.quantized, None

    def _held_by_other_stage(self, name: str) -> bool:
        layer = _LAYER_INDEX.match(name)
        if layer is not None:
            return int(layer[1]) not in self._stage_layers
        return name.startswith(self._other_stage_prefixes)

    def _checkpoint_targets(self) -> dict[str, tuple[str, int | None]]:
        """Checkpoint tensor name -> (our parameter, part of it or None) for every tensor the
        checkpoint must hold. A merged layer's parts are its checkpoint matrices (q/k/v,
        gate/up); a module with ``checkpoint_parts`` (the experts) names its own."""
        modules = dict(self.named_modules())
        targets: dict[str, tuple[str, int | None]] = {}
        for key, _ in self.named_parameters():  # a tied head is the embedding: listed once
            module_name, _, param_name = key.rpartition(".")
            module = modules[module_name]
            parent, _, leaf = module_name.rpartition(".")
            if hasattr(module, "checkpoint_parts"):
                names = [f"{module_name}.{part}" for part in module.checkpoint_parts(param_name)]
            elif leaf in _MERGED_LAYERS:
                names = [f"{parent}.{matrix}.{param_name}" for matrix in _MERGED_LAYERS[leaf]]
            else:
                targets[self.checkpoint_name(key)] = (key, None)
                continue
            for part, name in enumerate(names):
                targets[self.checkpoint_name(name)] = (key, part)
        return targets

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name for the tensor this model calls ``name`` (the same, for Llama)."""
        return name
