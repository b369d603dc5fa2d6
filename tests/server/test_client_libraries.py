"""Real client libraries against ``strata serve`` on the default model: the OpenAI Agents SDK
(an agent with a function tool, through the Responses API), LangChain's ``ChatOpenAI``
(structured output, tools, the Responses API) and LiteLLM (chat, streamed, Responses).

Every connection the test process makes is checked: one to anywhere but loopback fails the
test, so no client reaches out (tracing, cost maps, telemetry) unnoticed.
"""

import asyncio
import ipaddress
import socket
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from server_helpers import running_server

QUESTION = "What is the weather in Paris?"


class City(BaseModel):
    """A city and its country."""

    name: Literal["Paris", "Rome"]
    country: Literal["France", "Italy"]


@pytest.fixture(scope="module", autouse=True)
def loopback_only():
    """Refuse, and remember, every connection or name lookup for a host that is not loopback."""
    reached: list[str] = []
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def is_loopback(host: object) -> bool:
        if host in ("localhost", None):
            return True
        try:
            return ipaddress.ip_address(str(host)).is_loopback
        except ValueError:
            return False

    def connect(sock: socket.socket, address) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not is_loopback(address[0]):
            reached.append(str(address))
            raise OSError(f"the test may only reach loopback, not {address}")
        return real_connect(sock, address)

    def getaddrinfo(host, *args, **kwargs):
        if not is_loopback(host):
            reached.append(str(host))
            raise socket.gaierror(f"the test may only reach loopback, not {host}")
        return real_getaddrinfo(host, *args, **kwargs)

    patch = pytest.MonkeyPatch()
    patch.setattr(socket.socket, "connect", connect)
    patch.setattr(socket, "getaddrinfo", getaddrinfo)
    patch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    patch.setenv("LITELLM_TELEMETRY", "False")
    yield
    patch.undo()
    assert not reached, f"clients tried to reach the network: {reached}"


@pytest.fixture(scope="module")
def server(log_dir, loopback_only):
    # Whole and streamed greedy answers are compared: float32 and no prefix cache, so that a
    # repeated prompt is computed exactly as the first time (see test_openai_api.py).
    with running_server(log_dir, "--dtype", "float32", "--no-enable-prefix-caching") as server:
        yield server


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return f"{server.url}/v1"


# ---- OpenAI Agents SDK ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def agents(loopback_only):
    import agents  # after the environment says: no tracing

    agents.set_tracing_disabled(True)
    return agents


def weather_agent(agents, base_url: str, model: str, calls: list[str]):
    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is 21 degrees and sunny in {city}."

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    return agents.Agent(
        name="weather",
        instructions="Answer questions about the weather; use the tool.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=model, openai_client=client),
        # The 135M model calls tools only when made to; after the call the SDK lets it answer.
        model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=40, temperature=0),
    )


def test_an_agent_calls_its_function_tool_then_answers(agents, base_url, model):
    calls: list[str] = []
    result = asyncio.run(agents.Runner.run(weather_agent(agents, base_url, model, calls), QUESTION, max_turns=3))
    assert calls and calls[0] in ("Paris", "Oslo")
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, str) and result.final_output.strip()


def test_a_streamed_agent_run_calls_its_tool_and_answers(agents, base_url, model):
    calls: list[str] = []

    async def run() -> tuple[list[str], object]:
        streamed = agents.Runner.run_streamed(weather_agent(agents, base_url, model, calls), QUESTION, max_turns=3)
        deltas = [
            event.data.delta async for event in streamed.stream_events()
            if event.type == "raw_response_event" and event.data.type == "response.output_text.delta"
        ]
        return deltas, streamed.final_output

    deltas, final_output = asyncio.run(run())
    assert calls and "".join(deltas) == final_output and final_output.strip()


# ---- LangChain ---------------------------------------------------------------------------


def chat_model(base_url: str, model: str, **options):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=base_url, api_key="unused", model=model, max_tokens=60, temperature=0, max_retries=0, **options
    )


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_is_a_valid_instance(base_url, model, method):
    structured = chat_model(base_url, model).with_structured_output(City, method=method, strict=True)
    city = structured.invoke("Which city is the capital of France?")
    assert isinstance(city, City)


def test_langchain_bound_tools_come_back_as_tool_calls(base_url, model):
    llm = chat_model(base_url, model).bind_tools([City], tool_choice="City", strict=True)
    [call] = llm.invoke("Which city is the capital of France?").tool_calls
    assert call["name"] == "City"
    City.model_validate(call["args"])


def test_langchain_on_the_responses_api_answers_and_calls_tools(base_url, model):
    llm = chat_model(base_url, model, use_responses_api=True)
    assert llm.invoke("What is the capital of France?").text.strip()
    with_tools = llm.bind_tools([City], tool_choice="City", strict=True)
    [call] = with_tools.invoke("Which city is the capital of France?").tool_calls
    City.model_validate(call["args"])


def test_langchain_structured_output_over_the_responses_api_is_a_valid_instance(base_url, model):
    structured = chat_model(base_url, model, use_responses_api=True).with_structured_output(City, strict=True)
    assert isinstance(structured.invoke("Which city is the capital of France?"), City)


def test_langchain_streams_from_the_responses_api(base_url, model):
    llm = chat_model(base_url, model, use_responses_api=True)
    whole = llm.invoke("Name a color.")
    streamed = "".join(chunk.text for chunk in llm.stream("Name a color."))
    assert streamed == whole.text and streamed.strip()


# ---- LiteLLM -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def litellm(loopback_only):
    import litellm  # after the environment says: the local cost map

    return litellm


def test_litellm_completion_whole_and_streamed_agree(litellm, base_url, model):
    options = dict(
        model=f"openai/{model}", api_base=base_url, api_key="unused", max_tokens=12, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    whole = litellm.completion(**options)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in litellm.completion(**options, stream=True))
    assert whole.choices[0].message.content.strip() and streamed == whole.choices[0].message.content
    assert whole.usage.completion_tokens <= 12


def test_litellm_responses(litellm, base_url, model):
    response = litellm.responses(
        model=f"openai/{model}", api_base=base_url, api_key="unused", input="What is the capital of France?",
        max_output_tokens=12, temperature=0,
    )
    [message] = response.output
    assert message.type == "message" and message.content[0].text.strip()
    assert response.usage.output_tokens <= 12
