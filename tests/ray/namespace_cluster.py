"""A Ray cluster of network namespaces (``strata.launch.bench.netns_cluster``) for one test module.

``joined_cluster(cpus)`` skips, saying why, where namespaces cannot be made; otherwise it starts
the cluster, puts the test process in the head's namespace (everything it starts, engines and
servers, runs there and reaches the other nodes only over the veth links), and on the way out
leaves that namespace, stops the cluster and checks that none of its namespaces is left.
"""

import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from strata.launch.bench.netns_cluster import NamespaceCluster, NamespaceError, Node, check_namespaces_available

from conftest import command_line, live


def joined_cluster(cpus: list[int]) -> Iterator[NamespaceCluster]:
    """For a module-scoped fixture: the running cluster, with this process in its head's namespace."""
    try:
        check_namespaces_available()
    except NamespaceError as error:
        pytest.skip(f"a multi-node cluster needs network namespaces: {error}")
    cluster = NamespaceCluster(cpus)
    names = [cluster.bridge_namespace, *(node.namespace for node in cluster.nodes)]
    try:
        with cluster, cluster.entered(cluster.head):
            yield cluster
    finally:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not [name for name in names if name in listed], f"namespaces left behind:\n{listed}"


def rank_workers_on(cluster: NamespaceCluster, node: Node) -> list[psutil.Process]:
    """The rank actors running on ``node``."""
    processes = live([psutil.Process(pid) for pid in cluster.pids(node) if psutil.pid_exists(pid)])
    return [process for process in processes if "ray::RankWorker" in command_line(process)]


def save_tiny_model_with_tokenizer(path: Path, max_model_len: int = 512) -> str:
    """A tiny random Llama with the default model's tokenizer, which ``strata serve`` can load."""
    from transformers import AutoTokenizer

    from strata.worker.model_loader import resolve_model_path

    from model_factory import save_tiny_model, tiny_llama_config

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(None))
    config = tiny_llama_config(vocab_size=len(tokenizer), max_position_embeddings=max_model_len, num_key_value_heads=4)
    save_tiny_model(config, path)
    tokenizer.save_pretrained(path)
    return str(path)
