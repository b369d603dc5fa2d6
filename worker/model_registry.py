"""Which model class serves a checkpoint: one entry per HF ``model_type`` (config.json)."""

from strata.worker.gemma3 import Gemma3ForCausalLM
from strata.worker.llama import LlamaForCausalLM
from strata.worker.mixtral import MixtralForCausalLM
from strata.worker.qwen3 import Qwen3ForCausalLM, Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "mixtral": MixtralForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
}


def model_class(model_type: str, architectures: list[str] | None) -> type[LlamaForCausalLM]:
    """The class for a config's ``model_type``; a one-line ``ValueError`` naming the
    architecture and the supported model types if there is none."""
    if model_type not in MODEL_CLASSES:
        named = ", ".join(architectures or []) or "no architectures listed"
        raise ValueError(
            f"model type {model_type!r} ({named}) is not supported; "
            f"supported model types: {', '.join(sorted(MODEL_CLASSES))}"
        )
    return MODEL_CLASSES[model_type]
