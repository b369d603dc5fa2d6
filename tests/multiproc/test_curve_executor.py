"""The executor's TCP sockets (what ``--executor ray`` binds across nodes) refuse peers that
are not its workers: a rogue socket on a rank's step socket gets no step, a rogue pushing
fake results is never heard, and the engine serves on with the right tokens."""

import time

import msgspec
import zmq

from strata.engine_core.core import EngineCore
from strata.engine_core.protocol import EngineCoreRequest, ModelRunnerOutput, pack_tokens
from strata.engine_core.sampling_params import SamplingParams
from strata.engine_core.scheduler import SchedulerConfig
from strata.runtime.executors.mp_executor import MultiprocExecutor
from strata.worker.config import WorkerConfig

from model_factory import hf_greedy, random_prompts, save_tiny_model, tiny_llama_config

MAX_TOKENS = 8


class LoopbackTcpExecutor(MultiprocExecutor):
    """Local worker processes behind TCP sockets, bound as the Ray executor binds them."""

    def _bind_address(self, name: str) -> str:
        return "tcp://127.0.0.1:*"


def run_requests(core: EngineCore, prompts: list[list[int]]) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(index), prompt, params, None, time.time()))
    tokens: dict[str, list[int]] = {str(index): [] for index in range(len(prompts))}
    while core.has_work():
        outputs = core.step()
        for request_id, token in zip(outputs.request_ids, outputs.new_token_ids):
            tokens[request_id].append(token)
        assert all(finished.finish_reason == "length" for finished in outputs.finished)
    return tokens


def test_rogue_peers_on_the_tcp_sockets_get_nothing_and_the_engine_keeps_serving(tmp_path):
    reference_model = save_tiny_model(tiny_llama_config(), tmp_path)
    config = WorkerConfig(model=str(tmp_path), dtype="float32", num_gpu_blocks=64, max_model_len=128, max_num_seqs=8)
    executor = LoopbackTcpExecutor(config, worker_timeout_s=10)
    context = zmq.Context()
    try:
        assert executor.step_endpoints[0].startswith("tcp://")
        thief = context.socket(zmq.PULL)
        thief.connect(executor.step_endpoints[0])
        forger = context.socket(zmq.PUSH)
        forger.connect(executor.results_endpoint)
        for step in range(1, 40):  # would answer every step with token 0, were it heard
            forger.send(msgspec.msgpack.encode(ModelRunnerOutput(step, 0, pack_tokens([0] * 4))), zmq.NOBLOCK)
        time.sleep(0.5)
        core = EngineCore(SchedulerConfig(max_model_len=128), executor)
        prompts = random_prompts([5, 17, 30, 9], vocab_size=97, seed=3)
        tokens = run_requests(core, prompts)
        assert [tokens[str(i)] for i in range(len(prompts))] == [hf_greedy(reference_model, p, MAX_TOKENS) for p in prompts]
        assert not thief.poll(200), "a peer without the workers' keys received a step"
    finally:
        context.destroy(linger=0)
        executor.shutdown()
