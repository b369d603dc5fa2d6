"""``strata bench serve`` without a server: what it accepts, what it sends and how it reads streams."""

import asyncio
import json

import httpx
import pytest

from strata.launch.bench.serve import Load, make_prompts, stream_events


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


class Pieces(httpx.AsyncByteStream):
    """A response body arriving in fixed-size pieces."""

    def __init__(self, body: bytes, size: int) -> None:
        self.pieces = [body[i:i + size] for i in range(0, len(body), size)]

    async def __aiter__(self):
        for piece in self.pieces:
            yield piece


def test_stream_events_keep_events_whole_across_unicode_line_separators_and_cut_pieces():
    texts = ["one\u2028two", "three\u2029four\u0085five", "six"]
    frames = "".join(f"data: {json.dumps({'text': text}, ensure_ascii=False)}\r\n\r\n" for text in texts)
    # 7-byte pieces cut inside events, inside line ends and inside multi-byte characters.
    response = httpx.Response(200, stream=Pieces((frames + "data: [DONE]\n\n").encode(), 7))

    async def read() -> list[dict]:
        return [event async for event in stream_events(response)]

    assert [event["text"] for event in asyncio.run(read())] == texts
