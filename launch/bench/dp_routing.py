"""Data-parallel routing policies compared on one multi-tenant load, in one run.

    python -m strata.launch.bench.dp_routing NUM_GPU_BLOCKS [POLICY ...] [-- BENCH_SERVE_FLAGS ...]

For each policy (default: cache-aware, round-robin, least-loaded) a fresh ``strata serve`` with
two replicas of ``NUM_GPU_BLOCKS`` KV blocks each takes the same ``strata bench serve`` load; one
JSON line per policy goes to stdout (bench serve's result with the policy added), then that
server is stopped. The default load, which flags after ``--`` replace: 8 tenants with system
prompts of about 240 tokens, 96 requests, 4 in flight, 4 output tokens each. Servers and loads run
with ``OMP_NUM_THREADS=1`` unless it is set.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from strata.launch.bench.server_process import ServerProcess, free_port, strata_serve_command
from strata.runtime.engine_args import DP_ROUTING_POLICIES

DEFAULT_POLICIES = ("cache-aware", "round-robin", "least-loaded")
DEFAULT_LOAD = (
    "--workload", "multi-tenant", "--tenants", "8", "--system-prompt-words", "200",
    "--num-prompts", "96", "--max-tokens", "4", "--max-concurrency", "4",
)


def routing_policy(name: str) -> str:
    """``name``, checked to be a routing policy (not by ``choices``: argparse would check the
    default list against them as one value)."""
    if name not in DP_ROUTING_POLICIES:
        raise argparse.ArgumentTypeError(f"{name!r} is not a policy ({', '.join(DP_ROUTING_POLICIES)})")
    return name


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line; what follows ``--`` becomes ``bench_flags``, ``DEFAULT_LOAD`` without it."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("num_gpu_blocks", type=int, metavar="NUM_GPU_BLOCKS", help="each replica's KV cache, in blocks")
    parser.add_argument(
        "policies", nargs="*", type=routing_policy, default=list(DEFAULT_POLICIES), metavar="POLICY",
        help=f"any of {', '.join(DP_ROUTING_POLICIES)}",
    )
    parser.add_argument("--logs", type=Path, default=Path("/tmp"), help="each server's output: LOGS/dp_routing_POLICY.log")
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.bench_flags = argv[cut + 1:] or list(DEFAULT_LOAD)
    return args


def run_policy(policy: str, num_gpu_blocks: int, bench_flags: list[str], log: Path) -> dict:
    """``strata bench serve``'s result for one policy, against a server of its own."""
    port = free_port()
    flags = ["--data-parallel-size", "2", "--dp-routing", policy, "--num-gpu-blocks", str(num_gpu_blocks)]
    with ServerProcess(strata_serve_command(port, flags), port, log) as server:
        server.wait_healthy()
        # bench serve's own command line takes the flags after --, whichever of its flags they are.
        load = [sys.executable, "-m", "strata.launch.cli", "bench", "serve", "--url", server.url, *bench_flags, "--json"]
        result = json.loads(subprocess.run(load, check=True, stdout=subprocess.PIPE, text=True).stdout)
    return {**result, "policy": policy}


def main() -> None:
    args = parse_args(sys.argv[1:])
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # for the servers and loads started below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the with that stops the server
    args.logs.mkdir(parents=True, exist_ok=True)
    for policy in args.policies:
        result = run_policy(policy, args.num_gpu_blocks, args.bench_flags, args.logs / f"dp_routing_{policy}.log")
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
