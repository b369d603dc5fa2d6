"""strata: a distributed LLM serving engine.

``from strata import LLM, SamplingParams`` is the offline API (``LoRARequest`` runs a prompt
with a LoRA adapter). ``LLM`` and ``LoRARequest`` are imported lazily so that importing
``strata`` (as the torch-free EngineCore process does) loads neither torch nor transformers.
"""

from strata.engine_core.sampling_params import SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from strata.launch.llm import LLM

        return LLM
    if name == "LoRARequest":
        from strata.launch.lora_registry import LoRARequest

        return LoRARequest
    raise AttributeError(name)
