"""Frontends and launchers: ``LLM`` (offline), the ``strata`` CLI, the OpenAI-compatible server.

``LLM`` is imported lazily: the EngineCore process lives in this package too and must start
without torch or transformers.
"""

from engine_core.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from launch.llm import LLM

        return LLM
    raise AttributeError(name)
