"""Frontends and launchers: ``LLM`` (offline), the ``strata`` CLI, the OpenAI-compatible server."""

from engine_core.sampling_params import SamplingParams
from launch.llm import LLM

__all__ = ["LLM", "SamplingParams"]
