"""``strata bench serve`` without a server: what it accepts and what it sends."""

import pytest

from strata.launch.bench.serve import Load, make_prompts


def test_prompts_are_deterministic_for_a_seed():
    assert make_prompts(16, seed=1) == make_prompts(16, seed=1)
    assert make_prompts(16, seed=1) != make_prompts(16, seed=2)
    assert len(set(make_prompts(64, seed=0))) == 64


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8000", "http://localhost:1234", "http://[::1]:8000", "http://127.0.0.2"]
)
def test_loopback_urls_are_accepted(url):
    Load(url=url)


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "ftp://127.0.0.1", "127.0.0.1:8000"])
def test_urls_off_this_machine_are_refused(url):
    with pytest.raises(ValueError, match="url must"):
        Load(url=url)


@pytest.mark.parametrize(
    ("field", "value"), [("num_prompts", 0), ("request_rate", 0.0), ("max_concurrency", 0), ("max_tokens", 0)]
)
def test_non_positive_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        Load(**{field: value})


def test_an_unknown_structured_load_is_refused():
    with pytest.raises(ValueError, match="structured must be one of json-schema"):
        Load(structured="xml")
