"""``strata bench scheduler``: the cost of the EngineCore's per-step bookkeeping.

The real scheduler and KV manager, a model-free runner, steady decode: N running requests
with 128-token prompts, one token each per step. Reports microseconds per step for
``schedule()`` + ``update_from_output()`` and the encoded ``SchedulerOutput`` size.
"""

import gc
import time

import msgspec

from strata.engine_core.protocol import ModelRunnerOutput, SchedulerOutput, pack_tokens, unpack_handles
from strata.engine_core.request import Request
from strata.engine_core.sampling_params import SamplingParams
from strata.engine_core.scheduler import Scheduler, SchedulerConfig

PROMPT_LEN = 128


def _num_rows(output: SchedulerOutput) -> int:
    return len(output.new_requests) + len(unpack_handles(output.cached.handles))


def run(num_running: int, steps: int, block_size: int = 16) -> dict[str, float]:
    budget = max(8192, num_running)
    # Requests admitted first decode while the rest prefill: they must outlive the warm-up.
    max_tokens = steps + num_running * PROMPT_LEN // budget + 64
    max_len = PROMPT_LEN + max_tokens
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=num_running,
        max_model_len=max_len,
        block_size=block_size,
    )
    scheduler = Scheduler(config, num_blocks=num_running * (-(-max_len // block_size) + 1))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_running):
        prompt = [(i * 7 + j) % 30000 + 3 for j in range(PROMPT_LEN)]
        scheduler.add_request(Request(f"request-{i}", prompt, params, 2, time.time()))
    while True:  # prefill until a step is pure decode
        output = scheduler.schedule()
        tokens = pack_tokens([5] * _num_rows(output))
        scheduler.update_from_output(output, ModelRunnerOutput(output.step, sampled_token_ids=tokens))
        if output.total_num_scheduled_tokens == _num_rows(output) == num_running:
            break

    encoder = msgspec.msgpack.Encoder()
    tokens = pack_tokens([5] * num_running)
    gc.collect()
    elapsed = 0.0
    total_bytes = 0
    for _ in range(steps):
        start = time.perf_counter()
        output = scheduler.schedule()
        scheduler.update_from_output(output, ModelRunnerOutput(output.step, sampled_token_ids=tokens))
        elapsed += time.perf_counter() - start
        total_bytes += len(encoder.encode(output))
        assert _num_rows(output) == num_running, "the benchmark left steady decode"
    return {
        "num_running": num_running,
        "steps": steps,
        "us_per_step": elapsed / steps * 1e6,
        "us_per_request": elapsed / steps / num_running * 1e6,
        "bytes_per_step": total_bytes / steps,
        "bytes_per_request": total_bytes / steps / num_running,
    }
