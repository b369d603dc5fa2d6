"""``--executor ray``: ranks as actors of a one-node loopback cluster (CPU bundles, gloo) shared by
the module; failures at start-up and mid-run end with an explanation, never a hang."""

import threading
import time

import psutil
import pytest
import ray

from strata.engine_core.ipc import free_tcp_port
from strata import LLM, SamplingParams
from strata.runtime.core_client import EngineDeadError

from conftest import descendants, live, rank_workers, wait_until_none_left
from prefix_cache_checks import check_reset_prefix_cache_forgets_seen_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# Long enough that no host finishes it before the rank is killed 3 s in (400 tokens took about 2 s
# on a fast host in the multiprocess executor's fault tests).
LONG = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
PROMPTS = ["The capital of France is", "def quicksort(items):", "Once upon a time, in a small village,"]


def greedy_tokens(**engine_args) -> list[list[int]]:
    with LLM(dtype="float32", **engine_args) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def single() -> list[list[int]]:
    return greedy_tokens(executor="uni")


def test_tp2_over_ray_actors_gives_the_greedy_tokens_of_tp1(ray_cluster, single):
    assert greedy_tokens(executor="ray", tensor_parallel_size=2, ray_address=ray_cluster) == single


def test_pp2_over_ray_actors_gives_the_greedy_tokens_of_one_rank(ray_cluster, single):
    assert greedy_tokens(executor="ray", pipeline_parallel_size=2, ray_address=ray_cluster) == single


def test_reset_prefix_cache_reaches_the_engine_core_of_a_ray_engine(ray_cluster):
    with LLM(dtype="float32", executor="ray", ray_address=ray_cluster) as llm:
        check_reset_prefix_cache_forgets_seen_prompts(llm)


def test_more_ranks_than_cluster_cpus_fail_within_the_placement_timeout_naming_what_is_missing(ray_cluster):
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"could not place 3 worker.*missing 1 CPU"):
        LLM(executor="ray", tensor_parallel_size=3, ray_address=ray_cluster, ray_placement_timeout_s=2)
    assert time.monotonic() - started < 2 + 30  # the EngineCore's start-up, then the timeout


def test_a_rank_actor_dying_during_start_up_fails_the_engine_at_once(ray_cluster):
    def kill_the_first_rank_actor() -> None:
        while not (actors := rank_workers()):
            time.sleep(0.05)
        actors[0].kill()

    threading.Thread(target=kill_the_first_rank_actor, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"worker rank \d died \(its Ray actor is dead: .+\) during start-up"):
        LLM(executor="ray", tensor_parallel_size=2, ray_address=ray_cluster)
    assert time.monotonic() - started < 60


def test_killed_rank_actor_fails_in_flight_requests_with_an_error_naming_the_rank(ray_cluster):
    llm = LLM(dtype="float32", executor="ray", tensor_parallel_size=2, ray_address=ray_cluster, worker_timeout_s=30)
    try:
        [victim] = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith("-rank1")]
        actor = ray.get_actor(victim["name"], namespace=victim["namespace"])
        threading.Timer(3.0, ray.kill, (actor,)).start()
        started = time.monotonic()
        outputs = llm.generate(["Tell me a long story."] * 3, LONG, use_tqdm=False)
        assert time.monotonic() - started < 3.0 + 10
        for output in outputs:
            completion = output.outputs[0]
            assert completion.finish_reason == "error"
            assert "worker rank 1 on node 127.0.0.1 died (its Ray actor is dead: it was killed by `ray.kill`)" in completion.error
        with pytest.raises(EngineDeadError):
            llm.generate("again", LONG, use_tqdm=False)
    finally:
        llm.shutdown()
    # The autouse fixture checks that the placement group is gone too.


def test_an_address_where_no_cluster_answers_fails_at_once():
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"no Ray cluster answers at 127\.0\.0\.1"):
        LLM(executor="ray", ray_address=f"127.0.0.1:{free_tcp_port()}")
    assert time.monotonic() - started < 30


def test_without_an_address_a_private_cluster_serves_and_goes_with_the_engine():
    llm = LLM(dtype="float32", executor="ray")
    try:
        engine_core = psutil.Process(llm.engine.process.pid)
        started_by_engine = descendants(engine_core)  # its workers and its whole Ray cluster
        assert any("gcs_server" in p.name() for p in started_by_engine)
        (output,) = llm.generate("The capital of France is", GREEDY, use_tqdm=False)
        assert output.outputs[0].finish_reason == "length"
    finally:
        llm.shutdown()
    wait_until_none_left(lambda: live(started_by_engine))


def test_two_replicas_on_ray_give_the_greedy_tokens_of_one_engine_with_a_placement_group_each(ray_cluster, single):
    with LLM(dtype="float32", executor="ray", data_parallel_size=2, ray_address=ray_cluster,
             dp_routing="round-robin") as llm:
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert len(groups) == 2
    assert [o.outputs[0].token_ids for o in outputs] == single
