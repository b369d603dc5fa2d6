"""Tensor parallelism on one Ray node against two, on a cluster of network namespaces (as root).

    python -m strata.launch.bench.multinode [--model PATH] [--max-tokens 64] [--requests 3] [-- SERVE_FLAGS ...]

Starts a ``NamespaceCluster`` (a head without CPUs, two nodes of 2 CPUs each) and, from the head's
namespace, for each layout a fresh ``strata serve --executor ray --tensor-parallel-size 2`` with
the ranks on one node (``STRICT_PACK``) or one on each (``STRICT_SPREAD``): the steps and the
all-reduces then cross the veth links. One JSON line per layout: the seconds from launching the
server to its first answer (a one-token completion), and the time between streamed tokens
(median and mean over ``--requests`` greedy completions of ``--max-tokens`` tokens). Servers run
with ``OMP_NUM_THREADS=1`` unless it is set.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from strata.launch.bench.netns_cluster import NamespaceCluster, check_namespaces_available
from strata.launch.bench.server_process import ServerProcess, free_port, strata_serve_command

LAYOUTS = {"one-node": "STRICT_PACK", "two-nodes": "STRICT_SPREAD"}
MODEL_NAME = "bench"
PROMPT = "Once upon a time, in a small village by the sea,"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the default model)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=3, help="timed completions per layout")
    parser.add_argument("serve_flags", nargs="*", help="more `strata serve` flags, after --")
    return parser.parse_args(argv)


def first_answer(server: ServerProcess) -> float:
    """Seconds from the server's launch to its first completed one-token completion."""
    server.wait_healthy()
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1}
    while httpx.post(f"{server.url}/v1/completions", json=body, timeout=300, trust_env=False).status_code != 200:
        server.check_running()
        time.sleep(0.2)
    return time.perf_counter() - server.started


def inter_token_seconds(url: str, max_tokens: int) -> list[float]:
    """The gaps between the streamed chunks of one greedy completion of ``max_tokens`` tokens."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    arrivals = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300, trust_env=False) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())
    return [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]


def measure(cluster: NamespaceCluster, placement: str, args: argparse.Namespace, log: Path) -> dict:
    flags = ["--executor", "ray", "--ray-address", cluster.address, "--tensor-parallel-size", "2",
             "--ray-placement-strategy", placement, "--served-model-name", MODEL_NAME, *args.serve_flags]
    if args.model is not None:
        flags += ["--model", args.model]
    port = free_port()
    env = {**os.environ, **cluster.env, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with ServerProcess(strata_serve_command(port, flags), port, log, env) as server:
        to_first_answer = first_answer(server)
        gaps = [gap for _ in range(args.requests) for gap in inter_token_seconds(server.url, args.max_tokens)]
    return {
        "placement": placement,
        "seconds_to_first_answer": round(to_first_answer, 2),
        "inter_token_ms_median": round(statistics.median(gaps) * 1e3, 2),
        "inter_token_ms_mean": round(statistics.fmean(gaps) * 1e3, 2),
        "tokens_timed": len(gaps),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_namespaces_available()
    log_dir = Path(tempfile.mkdtemp(prefix="multinode-logs-"))
    with NamespaceCluster([0, 2, 2]) as cluster, cluster.entered(cluster.head):
        for layout, placement in LAYOUTS.items():
            result = measure(cluster, placement, args, log_dir / f"serve-{layout}.log")
            print(json.dumps({"layout": layout, **result}), flush=True)
    print(f"server logs: {log_dir}", flush=True)


if __name__ == "__main__":
    main()
