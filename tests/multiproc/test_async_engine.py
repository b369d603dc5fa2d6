"""Many concurrent streams through the asyncio client; leaving a stream aborts its request."""

import asyncio

import pytest
from transformers import AutoTokenizer

from strata.launch.async_engine import AsyncEngine
from strata.runtime.engine_args import EngineArgs
from strata.engine_core.sampling_params import SamplingParams

from model_factory import save_tiny_model, tiny_llama_config

NUM_REQUESTS = 200
MAX_TOKENS = 12


async def consume(engine: AsyncEngine, index: int, leave_after: int | None) -> tuple[int, str | None]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens, reason = 0, None
    stream = engine.generate(f"Request {index}: count slowly,", params)
    async for delta in stream:
        tokens += len(delta.token_ids)
        reason = delta.finish_reason or reason
        if leave_after is not None and tokens >= leave_after:
            await stream.aclose()  # what an HTTP disconnect does
            break
    return tokens, reason


async def run_concurrent_with_half_aborted() -> tuple[list, dict, dict]:
    engine = await AsyncEngine.start(EngineArgs(dtype="float32", executor="mp", max_num_seqs=64))
    try:
        results = await asyncio.gather(
            *(consume(engine, i, leave_after=3 if i % 2 else None) for i in range(NUM_REQUESTS))
        )
        for _ in range(100):  # aborts are asynchronous: wait until the engine has drained
            state = await engine.debug_state()
            if state["num_requests"] == 0:
                break
            await asyncio.sleep(0.05)
        return results, state, engine.processor._completions
    finally:
        engine.shutdown()


def test_200_concurrent_streams_finish_and_aborted_half_frees_its_blocks():
    results, state, leftover_completions = asyncio.run(run_concurrent_with_half_aborted())
    completed = results[0::2]
    aborted = results[1::2]
    assert all(result == (MAX_TOKENS, "length") for result in completed)
    assert all(3 <= tokens < MAX_TOKENS for tokens, _ in aborted)
    assert state["num_requests"] == 0
    assert state["invariants"] == "ok"
    assert state["num_free_blocks"] == state["num_blocks"]
    assert leftover_completions == {}


async def duplicate_id_while_the_first_streams(model_path: str) -> list[int]:
    engine = await AsyncEngine.start(
        EngineArgs(model=model_path, dtype="float32", executor="mp", max_model_len=128, num_gpu_blocks=64)
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        first = engine.generate([5, 6, 7], params, request_id="shared-id")
        tokens = list((await first.__anext__()).token_ids)
        with pytest.raises(ValueError, match="already in use"):
            await engine.generate([8, 9], params, request_id="shared-id").__anext__()

        async def rest() -> None:
            async for delta in first:
                tokens.extend(delta.token_ids)

        await asyncio.wait_for(rest(), timeout=60)  # before the fix, the first stream hung here
        return tokens
    finally:
        engine.shutdown()


def test_duplicate_request_id_is_refused_and_the_first_stream_still_finishes(tmp_path, default_model_path):
    save_tiny_model(tiny_llama_config(), tmp_path)
    AutoTokenizer.from_pretrained(default_model_path).save_pretrained(tmp_path)
    assert len(asyncio.run(duplicate_id_while_the_first_streams(str(tmp_path)))) == MAX_TOKENS
