import itertools

import pytest

from strata.engine_core.request import Request
from strata.engine_core.sampling_params import SamplingParams

_ids = itertools.count()


@pytest.fixture
def make_request():
    """Build a request with a distinct prompt; keyword arguments go to SamplingParams."""

    def make(num_prompt_tokens: int = 20, *, prompt=None, request_id=None, priority=0,
             arrival_time=0.0, eos_token_id=None, cache_salt=None, lora=None, **params) -> Request:
        params.setdefault("max_tokens", 8)
        number = next(_ids)
        return Request(
            request_id=request_id or f"req-{number}",
            prompt_token_ids=prompt if prompt is not None else [(number * 131 + i) % 900 + 3 for i in range(num_prompt_tokens)],
            sampling_params=SamplingParams(**params),
            eos_token_id=eos_token_id,
            arrival_time=arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            lora=lora,
        )

    return make
