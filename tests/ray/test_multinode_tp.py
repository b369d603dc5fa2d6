"""Tensor and pipeline parallelism across two Ray nodes, each in a network namespace of its own:
the steps (CurveZMQ) and gloo cross veth links, never loopback. TP=2, PP=2 and PP=2 x TP=2 (each
stage's two ranks on one node) give one rank's greedy tokens; a node that dies or a link that
drops under two tensor-parallel ranks or two pipeline stages fails the in-flight requests,
naming a rank and its node, and the engine ends within 30 s instead of waiting forever."""

import re
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from strata import LLM, SamplingParams
from strata.launch.bench.netns_cluster import NamespaceCluster, Node
from strata.runtime.core_client import EngineDeadError
from strata.runtime.executors.ray_executor import _join_cluster

from model_factory import random_prompts
from namespace_cluster import joined_cluster, rank_workers_on, save_tiny_model_with_tokenizer

MAX_MODEL_LEN = 2048
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=MAX_MODEL_LEN - 100, ignore_eos=True)
PROMPTS = random_prompts([9, 30, 50], vocab_size=1000)
FAULT_AFTER_S = 1.5  # into a generation of about 30 s
WORKER_TIMEOUT_S = 5.0
ENDS_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[NamespaceCluster]:
    """A head without CPUs and two nodes of 2 CPUs each: both ranks fit on one node, so only
    STRICT_SPREAD puts them on two."""
    yield from joined_cluster([0, 2, 2])


@pytest.fixture(autouse=True)
def restore_cluster(cluster: NamespaceCluster) -> Iterator[None]:
    """After each test, undo its faults: a rank cut off from the engine is ended with its node."""
    yield
    cluster.restore()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny-llama"), MAX_MODEL_LEN)


def spread_engine(model: str, cluster: NamespaceCluster, strategy: str = "STRICT_SPREAD", **parallel: int) -> LLM:
    """Two ranks, one on each node: TP=2 unless ``parallel`` says otherwise."""
    return LLM(
        model, dtype="float32", executor="ray", ray_address=cluster.address, ray_placement_strategy=strategy,
        worker_timeout_s=WORKER_TIMEOUT_S, **(parallel or {"tensor_parallel_size": 2}),
    )


def rank_nodes(cluster: NamespaceCluster) -> list[str]:
    """Each rank's node address, from the one engine's placement group (rank r is its bundle r)."""
    import ray

    _join_cluster(cluster.address, num_cpus=0)
    try:
        [group] = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
        addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        return [addresses[node_id] for _, node_id in sorted(group["bundles_to_node_id"].items())]
    finally:
        ray.shutdown()


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def one_rank_tokens(model: str) -> list[list[int]]:
    with LLM(model, dtype="float32", executor="uni") as llm:
        return greedy_tokens(llm)


def test_tp2_with_a_rank_on_each_node_gives_the_greedy_tokens_of_tp1(cluster, model, one_rank_tokens):
    with spread_engine(model, cluster) as llm:
        assert [len(rank_workers_on(cluster, node)) for node in cluster.nodes] == [0, 1, 1]
        assert greedy_tokens(llm) == one_rank_tokens


def test_pp2_with_a_stage_on_each_node_gives_the_greedy_tokens_of_one_rank(cluster, model, one_rank_tokens):
    # Hidden states and residuals cross the veth link one way, sampled tokens the other.
    with spread_engine(model, cluster, pipeline_parallel_size=2) as llm:
        assert [len(rank_workers_on(cluster, node)) for node in cluster.nodes] == [0, 1, 1]
        assert greedy_tokens(llm) == one_rank_tokens


def test_pp2_by_tp2_with_a_stage_on_each_node_gives_the_greedy_tokens_of_one_rank(cluster, model, one_rank_tokens):
    # PACK fills a node before the next: each stage's all-reduces stay on its node, and only
    # the hidden states and sampled tokens between the stages cross the link.
    with spread_engine(model, cluster, "PACK", pipeline_parallel_size=2, tensor_parallel_size=2) as llm:
        first, _, second, _ = placed = rank_nodes(cluster)
        assert placed == [first, first, second, second] and {first, second} == {n.address for n in cluster.nodes[1:]}
        assert greedy_tokens(llm) == one_rank_tokens


# Two ranks, one on each node: two tensor-parallel ranks, or two pipeline stages.
SPANS = {"tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}


def errors_after(fault: Callable[[], None], model: str, cluster: NamespaceCluster, span: str) -> list[str]:
    """The errors that end a long generation's requests when ``fault`` strikes during it, on an
    engine whose ranks span the nodes as ``SPANS[span]``; the engine refuses work afterwards and
    must shut down within ``ENDS_WITHIN_S`` of the fault."""
    llm = spread_engine(model, cluster, **SPANS[span])
    struck_at: list[float] = []

    def strike() -> None:
        fault()
        struck_at.append(time.monotonic())

    timer = threading.Timer(FAULT_AFTER_S, strike)
    try:
        timer.start()
        outputs = llm.generate(PROMPTS[:2], LONG, use_tqdm=False)
        timer.join()
        with pytest.raises(EngineDeadError):
            llm.generate(PROMPTS[2], GREEDY, use_tqdm=False)
    finally:
        timer.cancel()
        llm.shutdown()
    assert struck_at and time.monotonic() - struck_at[0] < ENDS_WITHIN_S
    assert [o.outputs[0].finish_reason for o in outputs] == ["error", "error"], "the fault came after the end"
    return [o.outputs[0].error for o in outputs]


@pytest.mark.parametrize("span", list(SPANS))
def test_a_node_dying_under_a_rank_fails_in_flight_requests_and_the_engine_ends(cluster, model, span):
    for error in errors_after(lambda: cluster.kill_node(cluster.nodes[2]), model, cluster, span):
        assert re.search(r"worker rank \d on node 10\.213\.0\.[23] (died|failed) .*during step \d+", error), error


def drop_link(cluster: NamespaceCluster, node: Node) -> None:
    cluster.set_link(node, up=False)


def lose_every_packet(cluster: NamespaceCluster, node: Node) -> None:
    cluster.blackhole(node, on=True)


# Each way of cutting a node off, and each span, once: the four pairs took two minutes of CI.
@pytest.mark.parametrize(
    "cut_off,span", [(drop_link, "tp2"), (lose_every_packet, "pp2")], ids=["drop_link-tp2", "lose_every_packet-pp2"]
)
def test_a_node_cut_off_is_detected_by_the_step_timeout_naming_the_ranks_and_their_nodes(cluster, model, cut_off, span):
    node = cluster.nodes[2]
    # Usually both ranks are silent (the other waits in an all-reduce); the other's reply can
    # also have left before the cut.
    silent = (
        rf"(worker rank 0 on node \S+, )?worker rank \d on node \S+ did not answer step \d+ within {WORKER_TIMEOUT_S:.0f} s"
    )
    only_it_cut_off = (
        rf"worker rank \d on node {re.escape(node.address)} did not answer Ray within 2 s either: cut off from this node"
    )
    for error in errors_after(lambda: cut_off(cluster, node), model, cluster, span):
        assert re.fullmatch(f"{silent}; {only_it_cut_off}", error), error
