"""strata beside vLLM-CPU, offline, on the same prompts, in one run: the table of issue 12.

    python -m strata.launch.bench.compare_vllm [--vllm-python /tmp/peers/vllm/bin/python] [--json out.json]

Every engine (strata ``--executor uni``, strata ``mp``, vLLM-CPU from its own environment, made by
``../shared/peers/setup_vllm_cpu.sh``) is loaded once in its own process (``compare_vllm_driver.py``)
and held while the others run. Workloads, seeded as in ``strata bench throughput``: A (64 prompts
of 32-512 tokens -> 128 each), B (16 prompts: a shared 384-token prefix + 32 -> 64 each) and long
(8 prompts of 4000 tokens -> 256 each). Per workload: one untimed run on each engine, then
``--reps`` rounds that time each engine in turn, clearing its prefix cache before every run
(sharing within a run still counts). Greedy, EOS ignored, same model directory, dtype and
``max_model_len`` for all. Reported: the median output tokens/s per engine and its ratio to vLLM.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from transformers import AutoTokenizer

from strata.launch.bench import compare_vllm_driver
from strata.launch.bench.throughput import CORPUS, Workload, synthetic_prompts
from strata.worker.model_loader import resolve_model_path

# Run by path, not with -m: vLLM's environment has no strata.
DRIVER = Path(compare_vllm_driver.__file__)
WORKLOADS = {
    "A": Workload(num_prompts=64, input_len_min=32, input_len_max=512, output_len=128),
    "B": Workload(num_prompts=16, input_len_min=32, input_len_max=32, output_len=64, prefix_len=384),
    "long": Workload(num_prompts=8, input_len_min=4000, input_len_max=4000, output_len=256),
}
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "HF_HUB_OFFLINE": "1"}
BASELINE = "vllm"


def quick(workload: Workload) -> Workload:
    """A few short requests of the same shape, to check the whole run end to end in a minute."""
    return replace(
        workload,
        num_prompts=min(workload.num_prompts, 4),
        input_len_min=max(1, workload.input_len_min // 16),
        input_len_max=max(1, workload.input_len_max // 16),
        prefix_len=workload.prefix_len // 16,
        output_len=max(2, workload.output_len // 16),
    )


@dataclass
class Engine:
    """One engine's driver process, loaded and waiting for prompts."""

    name: str
    process: subprocess.Popen

    @classmethod
    def start(cls, name: str, python: str, model: Path, dtype: str, max_model_len: int, kv_cache_gib: int) -> "Engine":
        command = [python, str(DRIVER), "--model", str(model), "--dtype", dtype, "--max-model-len", str(max_model_len)]
        env = dict(os.environ)
        if name == BASELINE:
            command += ["--engine", "vllm"]
            env = {**VLLM_ENV, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), **env}
        else:
            command += ["--engine", "strata", "--executor", name.removeprefix("strata-"), "--kv-cache-gib", str(kv_cache_gib)]
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        engine = cls(name, process)
        engine._reply()  # {"ready": true}
        return engine

    def time_run(self, prompts: list[list[int]], max_tokens: int) -> float:
        """Output tokens/s of one run of ``prompts``."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.process.stdin.flush()
        reply = self._reply()
        return reply["output_tokens"] / reply["elapsed_s"]

    def _reply(self) -> dict:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(compare_vllm_driver.REPLY_MARK):
                return json.loads(line[len(compare_vllm_driver.REPLY_MARK):])
            sys.stderr.write(line)  # the engine's own logging
        raise RuntimeError(f"the {self.name} driver exited (code {self.process.wait()}); its log is above")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.terminate()  # the driver shuts its engine down on SIGTERM
                try:
                    self.process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()


def compare(engines: list[Engine], prompts: list[list[int]], output_len: int, reps: int) -> dict[str, list[float]]:
    for engine in engines:
        engine.time_run(prompts, output_len)  # warm-up
    rates: dict[str, list[float]] = {engine.name: [] for engine in engines}
    for _ in range(reps):
        for engine in engines:
            rates[engine.name].append(engine.time_run(prompts, output_len))
    return rates


def cpu_name() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.partition(":")[2].strip()
    return "unknown"


def format_table(report: dict) -> str:
    names = report["engines"]
    others = [name for name in names if name != BASELINE] if BASELINE in names else []
    header = ["workload", *(f"{name} tok/s" for name in names), *(f"{name} / {BASELINE}" for name in others)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for workload, result in report["workloads"].items():
        medians = [f"{result['median_output_tokens_per_s'][name]:.1f}" for name in names]
        ratios = [f"{result['ratio_to_' + BASELINE][name]:.2f}" for name in others]
        lines.append("| " + " | ".join([workload, *medians, *ratios]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default="/tmp/peers/vllm/bin/python", help="the peer environment's interpreter")
    parser.add_argument("--engines", default=f"strata-uni,strata-mp,{BASELINE}")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--strata-dtype", help="strata's dtype, if not --dtype (auto: float32 on a CPU without native bfloat16)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="every engine's KV cache")
    parser.add_argument("--quick", action="store_true", help="tiny workloads, to check the run end to end")
    parser.add_argument("--dump-prompts", type=Path, help="also write each workload's prompt file (vllm_offline.py's format) here")
    parser.add_argument("--json", type=Path, help="write the report here as JSON")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the finally that stops the drivers

    model = resolve_model_path(None)
    tokenizer = AutoTokenizer.from_pretrained(model)
    corpus = tokenizer.encode(CORPUS, add_special_tokens=False)
    workloads = {name: WORKLOADS[name] for name in args.workloads.split(",")}
    if args.quick:
        workloads = {name: quick(workload) for name, workload in workloads.items()}
    prompts = {name: synthetic_prompts(corpus, workload) for name, workload in workloads.items()}
    longest = max(max(map(len, prompts[name])) + workload.output_len for name, workload in workloads.items())
    max_model_len = -(-longest // 16) * 16
    if args.dump_prompts:
        args.dump_prompts.mkdir(parents=True, exist_ok=True)
        for name, workload in workloads.items():
            spec = {"prompts": prompts[name], "max_tokens": workload.output_len}
            (args.dump_prompts / f"{name}.json").write_text(json.dumps(spec))

    names = args.engines.split(",")
    engines: list[Engine] = []
    try:
        for name in names:
            python = args.vllm_python if name == BASELINE else sys.executable
            dtype = args.dtype if name == BASELINE else args.strata_dtype or args.dtype
            engines.append(Engine.start(name, python, model, dtype, max_model_len, args.kv_cache_gib))
        report: dict = {
            "cpu": cpu_name(), "model": str(model), "dtype": args.dtype, "strata_dtype": args.strata_dtype or args.dtype, "max_model_len": max_model_len,
            "reps": args.reps, "engines": names, "workloads": {},
        }
        for name, workload in workloads.items():
            rates = compare(engines, prompts[name], workload.output_len, args.reps)
            medians = {engine: statistics.median(values) for engine, values in rates.items()}
            result = {
                **asdict(workload), "output_tokens_per_s": rates, "median_output_tokens_per_s": medians,
            }
            if BASELINE in medians:
                result["ratio_to_" + BASELINE] = {e: m / medians[BASELINE] for e, m in medians.items() if e != BASELINE}
            report["workloads"][name] = result
            print(f"{name}: " + ", ".join(f"{e} {m:.1f} tok/s" for e, m in medians.items()), file=sys.stderr, flush=True)
    finally:
        for engine in engines:
            engine.stop()
    print(format_table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
