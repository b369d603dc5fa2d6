"""strata: a distributed LLM serving engine.

``from strata import LLM, SamplingParams`` is the offline API. ``LLM`` is imported lazily so
that importing ``strata`` (as the torch-free EngineCore process does) loads neither torch nor
transformers.
"""

from strata.engine_core.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from strata.launch.llm import LLM

        return LLM
    raise AttributeError(name)
