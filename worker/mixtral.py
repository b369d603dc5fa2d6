"""Mixtral: the Mistral decoder with a mixture of experts in every layer (softmax top-2 router,
renormalised). Checkpoints call the MoE block ``block_sparse_moe`` and the experts' gate, down
and up matrices ``w1``, ``w2`` and ``w3``."""


from strata.worker.attention import AttentionBackend
from strata.worker.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from strata.worker.model_config import ModelConfig
from strata.worker.moe import SparseMoE
from strata.worker.parallel_state import TensorParallel


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: Llama attention and a ``SparseMoE`` feed-forward in every layer."""

    supports_lora = False  # adapters of experts are not supported

    def decoder_layer(
        self,
        config: ModelConfig,
        tp: TensorParallel,
        attn_backend: AttentionBackend,
        index: int,
        sliding_window: int | None,
    ) -> LlamaDecoderLayer:
        if config.hidden_act != "silu":
            raise ValueError(f"activation {config.hidden_act!r} is not supported (only silu)")
        moe = SparseMoE(
            config.hidden_size,
            config.intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            renormalize=True,
            names=("w1", "w3", "w2"),
            tp=tp,
        )
        return LlamaDecoderLayer(config, LlamaAttention(config, tp, attn_backend, sliding_window), moe)

    def checkpoint_name(self, name: str) -> str:
        return name.replace(".mlp.", ".block_sparse_moe.")
