"""``LLM.reset_prefix_cache`` in the frontend's process (``uni``) and through the EngineCore
process (``mp``, a utility call); ``tests/ray`` covers ``ray``."""

import pytest

from strata import LLM

from prefix_cache_checks import check_reset_prefix_cache_forgets_seen_prompts


@pytest.mark.parametrize("executor", ["uni", "mp"])
def test_reset_prefix_cache_forgets_seen_prompts(executor):
    with LLM(dtype="float32", executor=executor) as llm:
        check_reset_prefix_cache_forgets_seen_prompts(llm)
