"""compare_vllm's bookkeeping, without starting an engine: which engines ``--engines`` names,
the faster vLLM dtype as the baseline of every ratio, the rounds, the table, and what it reads
from lscpu."""

import pytest

from strata.launch.bench.compare_vllm import (
    WORKLOADS, CpuInfo, engine_names, faster_vllm, format_table, measure_engines, summarize,
)
from strata.launch.bench.throughput import Workload

ENGINES = ["strata-uni", "strata-mp", "vllm-bfloat16", "vllm-float32"]

LSCPU = """\
Architecture:                            x86_64
Vendor ID:                               AuthenticAMD
BIOS Model name:                         pc-i440fx-9.0  CPU @ 2.0GHz
Model name:                              AMD EPYC 9R14 96-Core Processor
CPU family:                              25
Model:                                   17
Flags:                                   fpu sse2 fma avx avx2 avx512f avx512_bf16 avx512_vnni amx_tile aes
"""


def test_the_four_workloads():
    assert WORKLOADS == {
        "A": Workload(num_prompts=64, input_len_min=32, input_len_max=512, output_len=128),
        "B": Workload(num_prompts=16, input_len_min=32, input_len_max=32, output_len=64, prefix_len=384),
        "single": Workload(num_prompts=1, input_len_min=128, input_len_max=128, output_len=256),
        "long": Workload(num_prompts=4, input_len_min=3000, input_len_max=3000, output_len=128),
    }


def test_vllm_becomes_one_engine_per_dtype():
    assert engine_names(["strata-uni", "strata-mp", "vllm"], ["bfloat16", "float32"]) == ENGINES
    assert engine_names(["vllm", "strata-mp"], ["float32"]) == ["vllm-float32", "strata-mp"]
    with pytest.raises(ValueError, match="unknown engine 'sglang'"):
        engine_names(["sglang"], ["bfloat16"])


@pytest.mark.parametrize(("bfloat16", "float32", "faster"), [(30.0, 20.0, "vllm-bfloat16"), (20.0, 30.0, "vllm-float32")])
def test_the_baseline_is_the_faster_vllm_dtype(bfloat16, float32, faster):
    medians = {"strata-uni": 100.0, "strata-mp": 90.0, "vllm-bfloat16": bfloat16, "vllm-float32": float32}
    assert faster_vllm(medians) == faster


def test_no_baseline_without_vllm():
    assert faster_vllm({"strata-uni": 100.0}) is None
    assert "vllm_baseline" not in summarize(WORKLOADS["single"], {"strata-uni": [10.0]})


def test_ratios_are_to_the_faster_dtypes_median():
    rates = {"strata-uni": [60.0, 80.0, 70.0], "strata-mp": [35.0], "vllm-bfloat16": [10.0, 14.0, 12.0], "vllm-float32": [20.0]}
    summary = summarize(WORKLOADS["A"], rates)
    assert summary["median_output_tokens_per_s"] == {"strata-uni": 70.0, "strata-mp": 35.0, "vllm-bfloat16": 12.0, "vllm-float32": 20.0}
    assert summary["vllm_baseline"] == "vllm-float32"
    assert summary["ratio_to_vllm"] == {"strata-uni": 3.5, "strata-mp": 1.75}
    assert summary["output_tokens_per_s"] == rates
    assert summary["num_prompts"] == 64


def test_the_table_keeps_both_vllm_figures_and_names_the_faster():
    summaries = {
        "A": summarize(WORKLOADS["A"], {"strata-uni": [70.0], "strata-mp": [35.0], "vllm-bfloat16": [12.0], "vllm-float32": [20.0]}),
        "long": summarize(WORKLOADS["long"], {"strata-uni": [9.0], "strata-mp": [6.0], "vllm-bfloat16": [3.0], "vllm-float32": [2.0]}),
    }
    header, rule, a, long = format_table(ENGINES, summaries).splitlines()
    assert header == (
        "| workload | strata-uni tok/s | strata-mp tok/s | vllm-bfloat16 tok/s | vllm-float32 tok/s "
        "| faster vLLM | strata-uni / faster vLLM | strata-mp / faster vLLM |"
    )
    assert rule == "|" + "---|" * 8
    assert a == "| A | 70.0 | 35.0 | 12.0 | 20.0 | float32 | 3.50 | 1.75 |"
    assert long == "| long | 9.0 | 6.0 | 3.0 | 2.0 | bfloat16 | 3.00 | 2.00 |"


def test_the_table_without_vllm_has_no_ratios():
    table = format_table(["strata-uni"], {"single": summarize(WORKLOADS["single"], {"strata-uni": [25.0]})})
    assert table.splitlines() == ["| workload | strata-uni tok/s |", "|---|---|", "| single | 25.0 |"]


def test_strata_engines_also_get_ratios_to_llama_cpp_beside_its_column():
    rates = {"strata-uni": [150.0], "strata-uni-dequantized": [60.0], "llama.cpp": [75.0]}
    summary = summarize(WORKLOADS["single"], rates)
    assert summary["ratio_to_llama_cpp"] == {"strata-uni": 2.0, "strata-uni-dequantized": 0.8}
    header, _, row = format_table(list(rates), {"single": summary}).splitlines()
    assert header.endswith("| llama.cpp tok/s | strata-uni / llama.cpp | strata-uni-dequantized / llama.cpp |")
    assert row == "| single | 150.0 | 60.0 | 75.0 | 2.00 | 0.80 |"


def test_llama_cpp_and_the_dequantized_strata_are_engines_of_their_own():
    assert engine_names(["strata-uni-dequantized", "llama.cpp"], ["bfloat16"]) == ["strata-uni-dequantized", "llama.cpp"]


def test_lscpu_model_name_numbers_and_flags():
    cpu = CpuInfo.parse(LSCPU)
    assert (cpu.model_name, cpu.cpu_family, cpu.model) == ("AMD EPYC 9R14 96-Core Processor", "25", "17")
    assert cpu.flags == ["fpu", "sse2", "fma", "avx", "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "aes"]
    assert cpu.simd_flags == ["fma", "avx", "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile"]
    assert cpu.describe() == (
        "CPU: AMD EPYC 9R14 96-Core Processor (family 25, model 17)\n"
        "SIMD flags: fma avx avx2 avx512f avx512_bf16 avx512_vnni amx_tile"
    )


def test_lscpu_without_the_fields():
    cpu = CpuInfo.parse("Architecture: aarch64\n")
    assert (cpu.model_name, cpu.flags) == ("unknown", [])
    assert cpu.describe() == "CPU: unknown\nSIMD flags: none"


class FakeEngine:
    """Made `rate` tokens/s at every run; records its starts and stops in `log`."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log, self.rss_mib = name, log, 100.0
        self.rate = {"strata-uni": 10.0, "strata-mp": 20.0}[name] + log.count(f"start {name}")
        log.append(f"start {name}")

    def time_run(self, prompts: list[list[int]], max_tokens: int) -> float:
        return self.rate

    def stop(self) -> None:
        self.log.append(f"stop {self.name}")


def test_rounds_start_the_engines_in_turn_and_pool_their_runs():
    log: list[str] = []
    workloads = {"B": WORKLOADS["B"]}
    rates, rss_mib = measure_engines(
        ["strata-uni", "strata-mp"], lambda name: FakeEngine(name, log), workloads, {"B": [[1, 2]]}, reps=2, rounds=2
    )
    assert log == ["start strata-uni", "stop strata-uni", "start strata-mp", "stop strata-mp"] * 2
    assert rates == {"B": {"strata-uni": [10.0, 10.0, 11.0, 11.0], "strata-mp": [20.0, 20.0, 21.0, 21.0]}}
    assert rss_mib == {"strata-uni": 100.0, "strata-mp": 100.0}
