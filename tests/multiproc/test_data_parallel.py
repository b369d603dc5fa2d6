"""Data parallelism with local processes: two replicas give the same greedy tokens as one
engine, requests sharing a prefix land on one replica, and a replica whose worker dies fails
only its own requests while the other keeps serving."""

import os
import signal
import threading

import psutil
import pytest

from strata import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SYSTEM_A = "You are a pirate who answers every question about ships, maps and the open sea. " * 8
SYSTEM_B = "You are a careful librarian who answers every question about books and reading. " * 8


@pytest.fixture(autouse=True)
def one_thread_per_process(monkeypatch):
    """Two replicas on two cores: one OpenMP thread per worker keeps them from fighting."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def routed_replicas(llm: LLM) -> list[int]:
    """Record the replica each request is sent to, in order."""
    replicas = llm.engine.replicas
    seen: list[int] = []
    route = replicas.route

    def spy(request):
        seen.append(route(request))
        return seen[-1]

    replicas.route = spy
    return seen


def worker_pids(llm: LLM, replica: int) -> list[int]:
    engine_core = psutil.Process(llm.engine.clients[replica].process.pid)
    return [p.pid for p in engine_core.children() if "strata.worker.worker_process" in " ".join(p.cmdline())]


def test_two_replicas_give_the_greedy_tokens_of_one_engine():
    prompts = ["The capital of France is", "Water boils at", "A haiku about rain:", "def fib(n):", "1, 2, 3,", "Hello"]
    with LLM(executor="uni", dtype="float32") as single:
        expected = [output.outputs[0].token_ids for output in single.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(executor="mp", dtype="float32", data_parallel_size=2, dp_routing="round-robin") as replicated:
        routed = routed_replicas(replicated)
        outputs = replicated.generate(prompts, GREEDY, use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == expected
    assert routed == [0, 1, 0, 1, 0, 1]


def test_requests_sharing_a_prefix_land_on_the_same_replica():
    questions = ["Where is the treasure?", "What is a good first book?", "How fast is a ship?", "Why read at night?"]
    with LLM(executor="mp", dtype="float32", data_parallel_size=2) as llm:
        routed = routed_replicas(llm)
        interleaved = [SYSTEM_A + questions[0], SYSTEM_B + questions[1], SYSTEM_A + questions[2], SYSTEM_B + questions[3]]
        llm.generate(interleaved, GREEDY, use_tqdm=False)
        llm.generate([SYSTEM_B + "Which shelf?", SYSTEM_A + "Which flag?"], GREEDY, use_tqdm=False)
        replicas = llm.engine.replicas
        published = [subscriber.next_seq for subscriber in replicas.subscribers]
    a, b = routed[0], routed[1]
    assert a != b and routed == [a, b, a, b, b, a]
    assert all(count > 0 for count in published), "every replica's KV events reached the router"


def test_a_dead_replica_fails_only_its_requests_and_the_other_keeps_serving():
    # Long enough that replica 1's requests are still running when its worker is killed a second
    # in, on a host that decodes the float32 model at hundreds of tokens a second.
    long = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    with LLM(executor="mp", dtype="float32", data_parallel_size=2, dp_routing="round-robin", worker_timeout_s=30) as llm:
        routed = routed_replicas(llm)
        [victim] = worker_pids(llm, 1)
        threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)).start()
        outputs = llm.generate(["Tell me a story.", "Tell me a joke.", "Tell me a fact.", "Tell me a poem."], long,
                               use_tqdm=False)
        for replica, output in zip(routed, outputs):
            completion = output.outputs[0]
            if replica == 0:
                assert completion.finish_reason == "length" and len(completion.token_ids) == long.max_tokens
            else:
                assert completion.finish_reason == "error" and "replica 1" in completion.error
        assert llm.engine.replicas.live == [0] and llm.engine.replicas.health()[0] == "ok"
        (again,) = llm.generate("Still there?", GREEDY, use_tqdm=False)
        assert again.outputs[0].finish_reason == "length" and routed[-1] == 0
